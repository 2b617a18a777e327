// Plain CPU kernels moving data between tiles and whole arrays; no StarPU here.
#pragma once
#include <cstddef>
#include <cstdint>

namespace jnntile::cpu {

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
