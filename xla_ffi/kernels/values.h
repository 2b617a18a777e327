// Filling, copying and counter-based random initialisation of tiles, and the
// geometry that maps a tile's elements to their indices in the whole tensor.
//
// Random values depend only on (seed, global element index), never on the
// tiling, the worker or the device: the CPU and the GPU compute them with the
// same functions below.
#pragma once
#include <math.h>

#include <cstddef>

#include "kernels/device.h"

namespace jnntile {

constexpr int kMaxDims = 8;

// A tile of a row-major tensor of shape `shape`: it starts at element `offset`
// (per axis) and spans `extent`; its own elements are row-major and contiguous.
struct TileGeometry {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t offset[kMaxDims];
  int64_t extent[kMaxDims];

  JNNTILE_HD int64_t numel() const {
    int64_t n = 1;
    for (int a = 0; a < ndim; ++a) n *= extent[a];
    return n;
  }
  // Elements of a contiguous row (the last axis).
  JNNTILE_HD int64_t row_length() const { return ndim == 0 ? 1 : extent[ndim - 1]; }
  // Index in the whole tensor of element i of the tile.
  JNNTILE_HD int64_t global_index(int64_t i) const {
    int64_t global = 0, stride = 1;
    for (int a = ndim - 1; a >= 0; --a) {
      global += (offset[a] + i % extent[a]) * stride;
      i /= extent[a];
      stride *= shape[a];
    }
    return global;
  }
};

// Calls row(tile_start, global_start) for every row of the tile: host loops
// find global indices once per row, then walk the row.
template <class Row>
void for_each_row(const TileGeometry& g, Row row) {
  int64_t length = g.row_length(), n = g.numel();
  for (int64_t start = 0; start < n; start += length) row(start, g.global_index(start));
}

JNNTILE_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1) from (seed, counter) alone: 24 random bits, never exactly 0
// (random_value takes its log). Exact in double, so the same bits on every device.
JNNTILE_HD double uniform01(uint64_t seed, uint64_t counter) {
  uint64_t bits = splitmix64(seed ^ splitmix64(counter)) >> 40;
  return (double(bits) + 0.5) / double(uint64_t(1) << 24);
}

// The random value of global element g: normal with mean a and standard
// deviation b (Box-Muller), or uniform in [a, b).
JNNTILE_HD float random_value(uint64_t seed, int64_t g, bool normal, float a, float b) {
  double u1 = uniform01(seed, 2 * uint64_t(g));
  if (!normal) return float(a + (b - a) * u1);
  double u2 = uniform01(seed, 2 * uint64_t(g) + 1);
  double z = sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
  return float(a + b * z);
}

// dst[0..n) = value, for T in float, int32_t, int64_t, bfloat16.
template <Device D, class T>
void fill(int64_t n, T value, T* dst);
// Every element of the tile gets random_value(seed, its global index, normal, a, b).
template <Device D>
void fill_random(const TileGeometry& g, uint64_t seed, bool normal, float a, float b, float* tile);

// dst[0..n) = src converted between float types (bfloat16 rounded to nearest even).
template <Device D>
void convert(int64_t n, FloatType from, const void* src, FloatType to, void* dst);

// CPU only, they touch host arrays: copies between a tile and its part of a
// whole row-major array (to_tile picks the direction), and adds its part of a
// whole float32 array into a tile.
void copy_tile(const TileGeometry& g, size_t elem_size, bool to_tile, void* tile, void* array);
void add_to_tile(const TileGeometry& g, const float* array, float* tile);

}  // namespace jnntile
