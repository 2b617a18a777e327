#include "kernels/optim.h"

namespace jnntile {
namespace {

// Each loop stores the bfloat16 copy under a flag that is a constant of its instantiation (`visit_flag`):
// tested per element, the store kept the loop from vectorising and doubled the update's time (AVX2 EPYC,
// GPT-2 124M: adamw 928 against 494 ms per step without a copy).
template <class Body>
void with_copy(bfloat16* copy, Body&& body) {
  visit_flag(copy != nullptr, [&](auto copied) {
    body([&](int64_t i, float value) {
      if constexpr (decltype(copied)::value) copy[i] = from_float<bfloat16>(value);
    });
  });
}

}  // namespace

template <>
void adamw<Device::Cpu>(int64_t n, const AdamwStep& step, GradClip clip, float* p, const float* g, float* m,
                        float* v, bfloat16* copy) {
  const float factor = clip.factor();
  // A local copy: the step's fields, read through a reference, could alias the float tiles written in the
  // loop, and reloading them each element kept the loop scalar (4.6 ns per element, the whole AdamW task).
  const AdamwStep local = step;
  with_copy(copy, [&](auto store_copy) {
    if (factor == 1.0f) {
      for (int64_t i = 0; i < n; ++i) {
        local.apply(p[i], g[i], m[i], v[i]);
        store_copy(i, p[i]);
      }
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      local.apply_scaled(p[i], g[i], m[i], v[i], factor);
      store_copy(i, p[i]);
    }
  });
}

template <>
void adamw_apart<Device::Cpu>(int64_t n, const AdamwStep& step, const float* p, const float* g, const float* m,
                              const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  const AdamwStep local = step;
  for (int64_t i = 0; i < n; ++i) adamw_apart_at(i, local, p, g, m, v, p_out, m_out, v_out, copy);
}

template <>
void adamw_rescale<Device::Cpu>(int64_t n, const AdamwStep& step, float scale, const float* p, const float* m,
                                const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  const AdamwStep local = step;
  for (int64_t i = 0; i < n; ++i) {
    local.rescale(p[i], m[i], v[i], scale, p_out[i], m_out[i], v_out[i]);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p_out[i]);
  }
}

template <>
void sgd<Device::Cpu>(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy) {
  const float factor = clip.factor();
  with_copy(copy, [&](auto store_copy) {
    for (int64_t i = 0; i < n; ++i) {
      float p_next = p[i] - lr * g[i];
      p[i] = factor == 1.0f ? p_next : sgd_rescaled(p[i], p_next, factor);
      store_copy(i, p[i]);
    }
  });
}

template <>
void sgd_apart<Device::Cpu>(int64_t n, float lr, const float* p, const float* g, float* p_out, bfloat16* copy) {
  for (int64_t i = 0; i < n; ++i) {
    p_out[i] = p[i] - lr * g[i];
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p_out[i]);
  }
}

template <>
void sgd_rescale<Device::Cpu>(int64_t n, float scale, const float* p, float* p_out, bfloat16* copy) {
  for (int64_t i = 0; i < n; ++i) {
    p_out[i] = sgd_rescaled(p[i], p_out[i], scale);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p_out[i]);
  }
}

template <>
void clip_by_norm<Device::Cpu>(int64_t n, float max_norm, const float* norm, float* x) {
  if (!clips(*norm, max_norm)) return;
  float factor = max_norm / *norm;
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace jnntile
