// The SiLU-gated product of Llama's MLP (SwiGLU): y = silu(gate) * up, with
// silu(a) = a * sigmoid(a), elementwise over a gate tile and the up tile of the
// same coordinates, in float32 as PyTorch's silu.
#pragma once

#include "kernels/device.h"
#include "kernels/math.h"

namespace jnntile {
namespace gated {

// Branch-free on exp_approx, which clamps its argument (no overflow for any a; 0 and 1 at the ends), so
// the CPU loops vectorise: with libm's expf on two branches, a forward task of SmolLM's shape (512 x 1536)
// took 3.7 ms and a backward one 4.7 (7% of a step's busy time); now 0.6 and 1.0.
JNNTILE_HD float sigmoid(float a) { return 1.0f / (1.0f + exp_approx(-a)); }

JNNTILE_HD float silu(float a) { return a * sigmoid(a); }

JNNTILE_HD float forward(float gate, float up) { return silu(gate) * up; }

// dgate += dy * up * silu'(gate), dup += dy * silu(gate), with silu'(a) = s (1 + a (1 - s)), s = sigmoid(a).
JNNTILE_HD void backward(float gate, float up, float dy, float& dgate, float& dup) {
  const float s = sigmoid(gate);
  dgate += dy * up * (s * (1.0f + gate * (1.0f - s)));
  dup += dy * (gate * s);
}

}  // namespace gated

// y = silu(gate) * up over n elements.
// gate, up, y and their gradients are elements of tiles of `type` (float32 or bfloat16), computed in float32.
template <Device D>
void swiglu_forward(FloatType type, int64_t n, const void* gate, const void* up, void* y);

// dgate += ..., dup += ... over n elements (gated::backward); = with `overwrite` (they hold nothing yet; the
// CPU loop takes it through visit_flag).
template <Device D>
void swiglu_backward(FloatType type, int64_t n, bool overwrite, const void* gate, const void* up, const void* dy,
                     void* dgate, void* dup);

}  // namespace jnntile
