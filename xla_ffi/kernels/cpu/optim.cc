#include "kernels/optim.h"

#include <algorithm>

#include "kernels/cpu/chunks.h"

namespace jnntile {
namespace {

// Runs update(begin, end) over chunks of a tile and, where there is a bfloat16 compute copy, rounds each
// chunk of the updated master into it while the chunk is in cache. Stored in the update's own loop, the copy
// took a per-element test (which kept the loop scalar: AdamW 928 against 494 ms per GPT-2 124M step on an AMD
// EPYC), and then, as a constant of the loop, the rounding's vectors on top of the update's (AdamW 197 against
// 148 ms in float32).
template <class Update>
void update_in_chunks(int64_t n, const float* master, bfloat16* copy, Update update) {
  for (int64_t begin = 0; begin < n; begin += kFloatChunk) {
    const int64_t end = std::min(n, begin + kFloatChunk);
    update(begin, end);
    if (copy != nullptr) round_chunk(end - begin, master + begin, copy + begin);
  }
}

}  // namespace

template <>
void adamw<Device::Cpu>(int64_t n, const AdamwStep& step, GradClip clip, float* p, const float* g, float* m,
                        float* v, bfloat16* copy) {
  const float factor = clip.factor();
  // A local copy: the step's fields, read through a reference, could alias the float tiles written in the
  // loop, and reloading them each element kept the loop scalar (4.6 ns per element, the whole AdamW task).
  const AdamwStep local = step;
  update_in_chunks(n, p, copy, [&](int64_t begin, int64_t end) {
    if (factor == 1.0f)
      for (int64_t i = begin; i < end; ++i) local.apply(p[i], g[i], m[i], v[i]);
    else
      for (int64_t i = begin; i < end; ++i) local.apply_scaled(p[i], g[i], m[i], v[i], factor);
  });
}

template <>
void adamw_apart<Device::Cpu>(int64_t n, const AdamwStep& step, const float* p, const float* g, const float* m,
                              const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  const AdamwStep local = step;
  update_in_chunks(n, p_out, copy, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) adamw_apart_at(i, local, p, g, m, v, p_out, m_out, v_out, nullptr);
  });
}

template <>
void adamw_rescale<Device::Cpu>(int64_t n, const AdamwStep& step, float scale, const float* p, const float* m,
                                const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  const AdamwStep local = step;
  update_in_chunks(n, p_out, copy, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) local.rescale(p[i], m[i], v[i], scale, p_out[i], m_out[i], v_out[i]);
  });
}

template <>
void sgd<Device::Cpu>(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy) {
  const float factor = clip.factor();
  update_in_chunks(n, p, copy, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float p_next = p[i] - lr * g[i];
      p[i] = factor == 1.0f ? p_next : sgd_rescaled(p[i], p_next, factor);
    }
  });
}

template <>
void sgd_apart<Device::Cpu>(int64_t n, float lr, const float* p, const float* g, float* p_out, bfloat16* copy) {
  update_in_chunks(n, p_out, copy, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) p_out[i] = p[i] - lr * g[i];
  });
}

template <>
void sgd_rescale<Device::Cpu>(int64_t n, float scale, const float* p, float* p_out, bfloat16* copy) {
  update_in_chunks(n, p_out, copy, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) p_out[i] = sgd_rescaled(p[i], p_out[i], scale);
  });
}

template <>
void clip_by_norm<Device::Cpu>(int64_t n, float max_norm, const float* norm, float* x) {
  if (!clips(*norm, max_norm)) return;
  float factor = max_norm / *norm;
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace jnntile
