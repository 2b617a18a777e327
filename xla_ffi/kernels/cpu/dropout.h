// Dropout on one tile with a counter-based mask; no StarPU here.
//
// Element g (global row-major index in the whole tensor of shape `shape`) is
// kept when uniform01(seed, g) >= rate, so the mask depends only on (seed, g):
// the same for any tiling and worker count, and the backward recomputes it
// instead of storing it.
#pragma once
#include <cstdint>

namespace jnntile::cpu {

// The tile starts at global element `offset` (per axis) and has `extent`.
// out = in * mask / (1 - rate), or out += that when `accumulate` (the backward).
void dropout(int ndim, const int64_t* shape, const int64_t* offset, const int64_t* extent, uint64_t seed,
             double rate, bool accumulate, const float* in, float* out);

}  // namespace jnntile::cpu
