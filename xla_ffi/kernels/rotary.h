// Rotary position embedding (RoPE) on one tile, halves paired as Hugging Face's
// Llama does (`rotate_half`): for c < D/2 the pair (x[c], x[c + D/2]) of a head
// turns by the angle pos * inv_freq[c], computed in float32 as there.
//
// A tile (nb, nt, 1, nh, d) of x (B, T, P, H, D) is nb * nt rows of nh heads of
// d values; row t of the tile is at sequence position pos0 + t, or, in a packed
// batch (examples restart at 0), at the position a positions tile gives. The tiles of
// the parts that are not rotated (the values, in a fused q/k/v tensor) are
// copied, and their gradient passes unchanged.
#pragma once
#include <math.h>

#include "kernels/device.h"

namespace jnntile {

// Head dimensions up to twice this: the frequencies travel in the task's arguments. Python reads the limit
// as jnntile._xla_ffi.rotary_max_head_dim (module.cc).
constexpr int64_t kRotaryMaxHalf = 256;

struct RotaryTile {
  int64_t nb, nt, nh, d;  // tile extents: batch rows, sequence rows, heads, head dimension
  int64_t pos0;           // sequence position of the tile's first row
  bool rotate;            // false: a part that is copied (forward) or passed on (backward)
  bool overwrite;         // backward: dx holds nothing yet (= instead of +=)
  float inv_freq[kRotaryMaxHalf];
  // Packed batches: (nb, nt) int32 on the task's device, the position of each row, in place of pos0 + t. The
  // kernel sets it from the task's buffer (ops/rotary.cc).
  const int32_t* positions = nullptr;
};

namespace rotary {

JNNTILE_HD int64_t numel(const RotaryTile& t) { return t.nb * t.nt * t.nh * t.d; }

// The sequence position of row r of batch row b.
JNNTILE_HD int64_t position(const RotaryTile& t, int64_t b, int64_t r) {
  return t.positions == nullptr ? t.pos0 + r : t.positions[b * t.nt + r];
}

// The angle of pair c at the position of element i of the tile (row-major), and the index of its first
// value: i is any element of the pair.
JNNTILE_HD float angle(const RotaryTile& t, int64_t i) {
  const int64_t half = t.d / 2, rows = i / (t.nh * t.d), c = i % t.d % half;
  return float(position(t, rows / t.nt, rows % t.nt)) * t.inv_freq[c];
}

// What a backward adds dy's share to: dx's value, or 0 where dx holds nothing yet.
template <class T>
JNNTILE_HD float backward_base(const RotaryTile& t, const T* dx, int64_t i) {
  return t.overwrite ? 0.0f : to_float(dx[i]);
}

// The pair (a, b) = (x[c], x[c + D/2]) turned by +angle (forward) or -angle (backward, the transpose).
JNNTILE_HD void turn(float a, float b, float cos_a, float sin_a, float& out_a, float& out_b) {
  out_a = a * cos_a - b * sin_a;
  out_b = b * cos_a + a * sin_a;
}

}  // namespace rotary

// y = x turned by the tile's angles (or copied where !t.rotate), every element of the tile.
// x, y, dy and dx are tiles of `type` (float32 or bfloat16), turned in float32.
template <Device D>
void rotary_forward(FloatType type, const RotaryTile& t, const void* x, void* y);

// dx += dy turned back (or dx += dy where !t.rotate); = with t.overwrite.
template <Device D>
void rotary_backward(FloatType type, const RotaryTile& t, const void* dy, void* dx);

}  // namespace jnntile
