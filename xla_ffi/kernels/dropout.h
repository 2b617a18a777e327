// Dropout on one tile with a counter-based mask.
//
// Element g (global row-major index in the whole tensor) is kept when
// uniform01(seed, g) >= rate, so the mask depends only on (seed, g): the same
// for any tiling, worker count and device, and the backward recomputes it
// instead of storing it.
#pragma once
#include "kernels/values.h"

namespace jnntile {

// Separates dropout's stream from random_value's when a seed is reused for both.
constexpr uint64_t kDropoutStream = 0xD60F0A7E5EEDull;

// Kept elements are scaled by this, so the expected output is the input.
JNNTILE_HD float dropout_scale(double rate) { return float(1.0 / (1.0 - rate)); }

// The dropped-out value of input x at global element g; scale = dropout_scale(rate).
JNNTILE_HD float dropout_value(uint64_t seed, int64_t g, double rate, float scale, float x) {
  return uniform01(seed ^ kDropoutStream, uint64_t(g)) >= rate ? x * scale : 0.0f;
}

// out = in * mask / (1 - rate), or out += that when `accumulate` (the backward); tiles of `type`.
template <Device D>
void dropout(FloatType type, const TileGeometry& g, uint64_t seed, double rate, bool accumulate, const void* in,
             void* out);

}  // namespace jnntile
