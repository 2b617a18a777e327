// Plain CPU kernels moving data between tiles and whole arrays; no StarPU here.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace jnntile::cpu {

// Calls row(tile_row_index, global_row_start_index) for every contiguous row
// (last axis) of the tile. Shared by every kernel that needs global element
// indices (copies, counter-based random numbers, dropout masks).
template <class Row>
void for_each_row(int ndim, const int64_t* shape, const int64_t* offset, const int64_t* extent,
                  Row row) {
  if (ndim == 0) {
    row(0, 0);
    return;
  }
  int64_t rows = 1;
  for (int a = 0; a + 1 < ndim; ++a) rows *= extent[a];
  std::vector<int64_t> coord(ndim, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t global = 0;
    for (int a = 0; a < ndim; ++a) global = global * shape[a] + offset[a] + coord[a];
    row(r * extent[ndim - 1], global);
    for (int a = ndim - 2; a >= 0; --a) {  // advance the row coordinate
      if (++coord[a] < extent[a]) break;
      coord[a] = 0;
    }
  }
}

// Uniform in (0, 1) from (seed, counter) alone: 24 random bits, never exactly 0
// (random_f32 takes its log).
double uniform01(uint64_t seed, uint64_t counter);

// Copies the tile starting at global element `offset` (per axis) with extent
// `extent` between a whole row-major array of shape `shape` and the tile's own
// contiguous row-major buffer. `to_tile` picks the direction.
void copy_tile(void* tile, void* array, int ndim, const int64_t* shape, const int64_t* offset,
               const int64_t* extent, size_t elem_size, bool to_tile);
// Adds the matching part of a whole float32 array into a tile.
void add_to_tile(float* tile, const float* array, int ndim, const int64_t* shape, const int64_t* offset,
                 const int64_t* extent);

void fill_f32(float* dst, int64_t n, float value);
void fill_i32(int32_t* dst, int64_t n, int32_t value);
void fill_i64(int64_t* dst, int64_t n, int64_t value);

// Counter-based random numbers: element with global row-major index g of an
// array of shape `shape` gets a value that depends only on (seed, g), so any
// tiling and any worker count give the same array.
void random_f32(float* tile, int ndim, const int64_t* shape, const int64_t* offset,
                const int64_t* extent, uint64_t seed, bool normal, float a, float b);

}  // namespace jnntile::cpu
