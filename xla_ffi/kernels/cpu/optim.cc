#include "kernels/optim.h"

namespace jnntile {

template <>
void adamw<Device::Cpu>(int64_t n, const AdamwStep& step, GradClip clip, float* p, const float* g, float* m,
                        float* v, bfloat16* copy) {
  const float factor = clip.factor();
  // A local copy: the step's fields, read through a reference, could alias the float tiles written in the
  // loop, and reloading them each element kept the loop scalar (4.6 ns per element, the whole AdamW task).
  const AdamwStep local = step;
  for (int64_t i = 0; i < n; ++i) {
    local.apply(p[i], g[i] * factor, m[i], v[i]);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p[i]);
  }
}

template <>
void sgd<Device::Cpu>(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy) {
  const float factor = clip.factor();
  for (int64_t i = 0; i < n; ++i) {
    p[i] -= lr * (g[i] * factor);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p[i]);
  }
}

template <>
void clip_by_norm<Device::Cpu>(int64_t n, float max_norm, const float* norm, float* x) {
  if (!clips(*norm, max_norm)) return;
  float factor = max_norm / *norm;
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace jnntile
