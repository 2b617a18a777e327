// The SiLU-gated product of Llama's MLP (SwiGLU): y = silu(gate) * up, with
// silu(a) = a * sigmoid(a), elementwise over a gate tile and the up tile of the
// same coordinates, in float32 as PyTorch's silu.
#pragma once
#include <math.h>

#include "kernels/device.h"

namespace jnntile {
namespace gated {

// Without overflow for any a: exp of a non-positive number only.
JNNTILE_HD float sigmoid(float a) {
  if (a >= 0.0f) return 1.0f / (1.0f + expf(-a));
  const float e = expf(a);
  return e / (1.0f + e);
}

JNNTILE_HD float silu(float a) { return a * sigmoid(a); }

// d silu / da = sigmoid(a) * (1 + a * (1 - sigmoid(a)))
JNNTILE_HD float silu_grad(float a) {
  const float s = sigmoid(a);
  return s * (1.0f + a * (1.0f - s));
}

JNNTILE_HD float forward(float gate, float up) { return silu(gate) * up; }

// dgate += dy * up * silu'(gate), dup += dy * silu(gate)
JNNTILE_HD void backward(float gate, float up, float dy, float& dgate, float& dup) {
  dgate += dy * up * silu_grad(gate);
  dup += dy * silu(gate);
}

}  // namespace gated

// y = silu(gate) * up over n elements.
// gate, up, y and their gradients are elements of tiles of `type` (float32 or bfloat16), computed in float32.
template <Device D>
void swiglu_forward(FloatType type, int64_t n, const void* gate, const void* up, void* y);

// dgate += ..., dup += ... over n elements (gated::backward).
template <Device D>
void swiglu_backward(FloatType type, int64_t n, const void* gate, const void* up, const void* dy, void* dgate,
                     void* dup);

}  // namespace jnntile
