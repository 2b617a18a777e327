// Optimizer steps on parameter tiles: in place, or written apart (a speculative update, see below).
#pragma once
#include <math.h>

#include "kernels/device.h"

namespace jnntile {

// One AdamW step, as optax.adamw: moments m and v, bias corrections
// bc1 = 1 - b1^t and bc2 = 1 - b2^t, decoupled weight decay, p -= lr * update.
//
// A step whose gradient a global-norm clip scales is computed as the step of the unscaled gradient, then
// rescaled (`rescale`): the update after the backward (`apply_scaled`) and a speculative update that finds
// the norm clipping (adamw_apart, then adamw_rescale) run the same arithmetic and give the same bits.
struct AdamwStep {
  float lr, b1, b2, eps, weight_decay, bc1, bc2;

  // The moments after a step of gradient g.
  JNNTILE_HD void moments(float m, float v, float g, float& m_out, float& v_out) const {
    m_out = b1 * m + (1.0f - b1) * g;
    v_out = b2 * v + (1.0f - b2) * g * g;
  }
  JNNTILE_HD void apply(float& p, float g, float& m, float& v) const {
    moments(m, v, g, m, v);
    p = updated(p, m, v);
  }
  // The step of gradient scale * g (scale < 1: a clip).
  JNNTILE_HD void apply_scaled(float& p, float g, float& m, float& v, float scale) const {
    float m_next, v_next;
    moments(m, v, g, m_next, v_next);
    rescale(p, m, v, scale, p, m_next, v_next);
    m = m_next;
    v = v_next;
  }
  // p after the step whose new moments are m and v.
  JNNTILE_HD float updated(float p, float m, float v) const {
    // Products by the corrections' reciprocals (the loops hoist them): one division and one square root per
    // element, where three divisions and a root kept the CPU loop on its divider (0.66 -> 0.35 ns per element
    // in cache).
    float update = (m * (1.0f / bc1)) / (sqrtf(v * (1.0f / bc2)) + eps) + weight_decay * p;
    return p - lr * update;
  }
  // The step of gradient scale * g, from the moments before (m, v) and after (m_out, v_out) the step of g:
  // m_out - b1 m = (1 - b1) g and v_out - b2 v = (1 - b2) g^2, so the moments of the scaled step are
  // scale m_out + (1 - scale) b1 m and scale^2 v_out + (1 - scale^2) b2 v (exact up to rounding).
  JNNTILE_HD void rescale(float p, float m, float v, float scale, float& p_out, float& m_out, float& v_out) const {
    m_out = scale * m_out + (1.0f - scale) * b1 * m;
    v_out = scale * scale * v_out + (1.0f - scale * scale) * b2 * v;
    p_out = updated(p, m_out, v_out);
  }
};

// SGD's step of gradient scale * g as the step of g rescaled, as AdamwStep's: p_next = p - lr * g, then
// p + scale (p_next - p), the same bits in place and speculatively (sgd_apart, then sgd_rescale).
JNNTILE_HD float sgd_rescaled(float p, float p_next, float scale) { return p + scale * (p_next - p); }

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
// A speculative update (jnntile.optim's fused update, clipping after the fact) writes the unclipped step
// apart, leaving p, m and v as they were: into p_out, m_out, v_out (and the bfloat16 copy of p_out).
JNNTILE_HD void adamw_apart_at(int64_t i, const AdamwStep& step, const float* p, const float* g, const float* m,
                               const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  float pi = p[i], mi = m[i], vi = v[i];
  step.apply(pi, g[i], mi, vi);
  p_out[i] = pi;
  m_out[i] = mi;
  v_out[i] = vi;
  if (copy != nullptr) copy[i] = from_float<bfloat16>(pi);
}
template <Device D>
void adamw_apart(int64_t n, const AdamwStep& step, const float* p, const float* g, const float* m, const float* v,
                 float* p_out, float* m_out, float* v_out, bfloat16* copy);
// When the global norm then clips (scale = max_norm / norm, read on the host once the backward is done): the
// step of scale * g replaces the speculative one (AdamwStep::rescale).
template <Device D>
void adamw_rescale(int64_t n, const AdamwStep& step, float scale, const float* p, const float* m, const float* v,
                   float* p_out, float* m_out, float* v_out, bfloat16* copy);
// p -= lr * g
template <Device D>
void sgd(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy);
// p_out = p - lr * g, p unchanged; then, when the norm clips, p_out = p + scale (p_out - p) (`sgd_rescaled`).
template <Device D>
void sgd_apart(int64_t n, float lr, const float* p, const float* g, float* p_out, bfloat16* copy);
template <Device D>
void sgd_rescale(int64_t n, float scale, const float* p, float* p_out, bfloat16* copy);
// x *= max_norm / *norm when clips(*norm, max_norm); norm is a scalar in the device's memory.
template <Device D>
void clip_by_norm(int64_t n, float max_norm, const float* norm, float* x);

}  // namespace jnntile
