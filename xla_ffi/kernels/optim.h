// Optimizer steps on parameter tiles, in place.
#pragma once
#include <math.h>

#include "kernels/device.h"

namespace jnntile {

// One AdamW step, as optax.adamw: moments m and v, bias corrections
// bc1 = 1 - b1^t and bc2 = 1 - b2^t, decoupled weight decay, p -= lr * update.
struct AdamwStep {
  float lr, b1, b2, eps, weight_decay, bc1, bc2;

  JNNTILE_HD void apply(float& p, float g, float& m, float& v) const {
    m = b1 * m + (1.0f - b1) * g;
    v = b2 * v + (1.0f - b2) * g * g;
    float update = (m / bc1) / (sqrtf(v / bc2) + eps) + weight_decay * p;
    p -= lr * update;
  }
};

// As optax.clip_by_global_norm: x is scaled by max_norm / norm when norm >= max_norm.
JNNTILE_HD bool clips(float norm, float max_norm) { return norm >= max_norm; }

// A clip that an update applies to the gradient as it reads it (jnntile.optim
// folds clip_by_global_norm into the update: one pass over the gradients
// fewer). norm: a scalar in the device's memory, or null for no clip.
struct GradClip {
  const float* norm;
  float max_norm;

  // Read once per kernel; g * factor() is what an in-place clip would have stored.
  JNNTILE_HD float factor() const { return norm != nullptr && clips(*norm, max_norm) ? max_norm / *norm : 1.0f; }
};

// `copy`, when not null, receives the updated p rounded to bfloat16 (the compute copy of a model in
// bfloat16), in the same pass.
template <Device D>
void adamw(int64_t n, const AdamwStep& step, GradClip clip, float* p, const float* g, float* m, float* v,
           bfloat16* copy);
// p -= lr * g
template <Device D>
void sgd(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy);
// x *= max_norm / *norm when clips(*norm, max_norm); norm is a scalar in the device's memory.
template <Device D>
void clip_by_norm(int64_t n, float max_norm, const float* norm, float* x);

}  // namespace jnntile
