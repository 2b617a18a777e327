#include "kernels/cpu/data.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace jnntile::cpu {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

double uniform01(uint64_t seed, uint64_t counter) {
  uint64_t bits = splitmix64(seed ^ splitmix64(counter)) >> 40;
  return (double(bits) + 0.5) / double(uint64_t(1) << 24);
}

void copy_tile(void* tile, void* array, int ndim, const int64_t* shape, const int64_t* offset,
               const int64_t* extent, size_t elem_size, bool to_tile) {
  size_t row_bytes = (ndim == 0 ? 1 : extent[ndim - 1]) * elem_size;
  char* t = static_cast<char*>(tile);
  char* a = static_cast<char*>(array);
  for_each_row(ndim, shape, offset, extent, [&](int64_t tile_start, int64_t global_start) {
    if (to_tile) std::memcpy(t + tile_start * elem_size, a + global_start * elem_size, row_bytes);
    else std::memcpy(a + global_start * elem_size, t + tile_start * elem_size, row_bytes);
  });
}

void add_to_tile(float* tile, const float* array, int ndim, const int64_t* shape, const int64_t* offset,
                 const int64_t* extent) {
  int64_t row_len = ndim == 0 ? 1 : extent[ndim - 1];
  for_each_row(ndim, shape, offset, extent, [&](int64_t tile_start, int64_t global_start) {
    for (int64_t i = 0; i < row_len; ++i) tile[tile_start + i] += array[global_start + i];
  });
}

void fill_f32(float* dst, int64_t n, float value) { std::fill(dst, dst + n, value); }
void fill_i32(int32_t* dst, int64_t n, int32_t value) { std::fill(dst, dst + n, value); }
void fill_i64(int64_t* dst, int64_t n, int64_t value) { std::fill(dst, dst + n, value); }

void random_f32(float* tile, int ndim, const int64_t* shape, const int64_t* offset,
                const int64_t* extent, uint64_t seed, bool normal, float a, float b) {
  int64_t row_len = ndim == 0 ? 1 : extent[ndim - 1];
  for_each_row(ndim, shape, offset, extent, [&](int64_t tile_start, int64_t global_start) {
    for (int64_t i = 0; i < row_len; ++i) {
      uint64_t g = uint64_t(global_start + i);
      double u1 = uniform01(seed, 2 * g);
      if (normal) {  // Box-Muller: mean a, standard deviation b
        double u2 = uniform01(seed, 2 * g + 1);
        double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
        tile[tile_start + i] = float(a + b * z);
      } else {  // uniform in [a, b)
        tile[tile_start + i] = float(a + (b - a) * u1);
      }
    }
  });
}

}  // namespace jnntile::cpu
