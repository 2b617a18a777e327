// What the row kernels share on the GPU: a warp per row, its lanes taking every
// 32nd element of the row (coalesced), their partial results merged by shuffles
// in a tree of fixed shape, so a row gives the same bits every run.
#pragma once
#include <string.h>

#include "kernels/cuda/context.h"

namespace jnntile::cuda {

constexpr int kWarp = 32;

__device__ inline int lane() { return int(threadIdx.x % kWarp); }
// The calling warp and the number of warps in the grid, for a grid-stride loop
// over rows: the loop condition is the same for all lanes, so every lane of a
// warp reaches the shuffles of warp_reduce.
__device__ inline int64_t warp_index() { return (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; }
__device__ inline int64_t warp_count() { return int64_t(gridDim.x) * blockDim.x / kWarp; }
// Blocks of kThreads (a multiple of kWarp) holding a warp per row.
inline unsigned blocks_for_rows(int64_t rows) { return blocks_for(rows * kWarp); }

// The value of lane (lane ^ mask), for any trivially copyable type, 32 bits at a time.
template <class T>
__device__ T shuffle_xor(T value, int mask) {
  static_assert(sizeof(T) % sizeof(int) == 0, "shuffled in 32-bit words");
  int words[sizeof(T) / sizeof(int)];
  memcpy(words, &value, sizeof(T));
  for (int& word : words) word = __shfl_xor_sync(0xffffffffu, word, mask);
  memcpy(&value, words, sizeof(T));
  return value;
}

// Every lane gets the merge of the 32 lanes' values (a butterfly). All 32 lanes must call it.
template <class T, class Merge>
__device__ T warp_reduce(T value, Merge merge) {
  for (int mask = kWarp / 2; mask > 0; mask /= 2) value = merge(value, shuffle_xor(value, mask));
  return value;
}

}  // namespace jnntile::cuda
