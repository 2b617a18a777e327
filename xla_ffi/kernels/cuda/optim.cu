#include "kernels/cuda/groups.h"
#include "kernels/optim.h"

namespace jnntile {
namespace {

using cuda::for_each_element;
using cuda::for_groups;
using cuda::kPerThread;
using cuda::load;
using cuda::store;

// All three on register copies of a thread's elements (kernels/cuda/groups.h); every thread reads the norm (one
// cached load). With a copy, each thread also stores its updated p rounded to bfloat16.
__global__ void adamw_kernel(int64_t n, AdamwStep step, GradClip clip, float* p, const float* g, float* m, float* v,
                             bfloat16* copy) {
  const float factor = clip.factor();
  for_groups(n, [&](int64_t i0, int64_t stride) {
    float ps[kPerThread], gs[kPerThread], ms[kPerThread], vs[kPerThread];
    load(n, i0, stride, static_cast<const float*>(p), ps);
    load(n, i0, stride, g, gs);
    load(n, i0, stride, static_cast<const float*>(m), ms);
    load(n, i0, stride, static_cast<const float*>(v), vs);
    for_each_element(n, i0, stride, [&](int k, int64_t i) {
      if (factor == 1.0f) step.apply(ps[k], gs[k], ms[k], vs[k]);
      else step.apply_scaled(ps[k], gs[k], ms[k], vs[k], factor);
      p[i] = ps[k];
      m[i] = ms[k];
      v[i] = vs[k];
      if (copy != nullptr) copy[i] = from_float<bfloat16>(ps[k]);
    });
  });
}

__global__ void adamw_apart_kernel(int64_t n, AdamwStep step, const float* p, const float* g, const float* m,
                                   const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    float ps[kPerThread], gs[kPerThread], ms[kPerThread], vs[kPerThread], p_outs[kPerThread], m_outs[kPerThread],
        v_outs[kPerThread];
    bfloat16 copies[kPerThread];
    load(n, i0, stride, p, ps);
    load(n, i0, stride, g, gs);
    load(n, i0, stride, m, ms);
    load(n, i0, stride, v, vs);
    for_each_element(n, i0, stride, [&](int k, int64_t) {
      adamw_apart_at(k, step, ps, gs, ms, vs, p_outs, m_outs, v_outs, copy != nullptr ? copies : nullptr);
    });
    store(n, i0, stride, p_outs, p_out);
    store(n, i0, stride, m_outs, m_out);
    store(n, i0, stride, v_outs, v_out);
    if (copy != nullptr) store(n, i0, stride, copies, copy);
  });
}

__global__ void adamw_rescale_kernel(int64_t n, AdamwStep step, float scale, const float* p, const float* m,
                                     const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    float ps[kPerThread], ms[kPerThread], vs[kPerThread], p_outs[kPerThread], m_outs[kPerThread],
        v_outs[kPerThread];
    load(n, i0, stride, p, ps);
    load(n, i0, stride, m, ms);
    load(n, i0, stride, v, vs);
    load(n, i0, stride, static_cast<const float*>(m_out), m_outs);
    load(n, i0, stride, static_cast<const float*>(v_out), v_outs);
    for_each_element(n, i0, stride, [&](int k, int64_t i) {
      step.rescale(ps[k], ms[k], vs[k], scale, p_outs[k], m_outs[k], v_outs[k]);  // reads m_out, v_out
      p_out[i] = p_outs[k];
      m_out[i] = m_outs[k];
      v_out[i] = v_outs[k];
      if (copy != nullptr) copy[i] = from_float<bfloat16>(p_outs[k]);
    });
  });
}

__global__ void sgd_apart_kernel(int64_t n, float lr, const float* p, const float* g, float* p_out, bfloat16* copy) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p_out[i] = p[i] - lr * g[i];
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p_out[i]);
  }
}

__global__ void sgd_rescale_kernel(int64_t n, float scale, const float* p, float* p_out, bfloat16* copy) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p_out[i] = sgd_rescaled(p[i], p_out[i], scale);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p_out[i]);
  }
}

__global__ void sgd_kernel(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy) {
  const float factor = clip.factor();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float p_next = p[i] - lr * g[i];
    p[i] = factor == 1.0f ? p_next : sgd_rescaled(p[i], p_next, factor);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p[i]);
  }
}

// None writes when it does not clip.
__global__ void clip_kernel(int64_t n, float max_norm, const float* norm, float* x) {
  float value = *norm;
  if (!clips(value, max_norm)) return;
  float factor = max_norm / value;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= factor;
}

}  // namespace

template <>
void adamw<Device::Cuda>(int64_t n, const AdamwStep& step, GradClip clip, float* p, const float* g, float* m,
                         float* v, bfloat16* copy) {
  adamw_kernel<<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(n, step, clip, p, g, m, v, copy);
  cuda::check_launch("adamw");
}

template <>
void adamw_apart<Device::Cuda>(int64_t n, const AdamwStep& step, const float* p, const float* g, const float* m,
                               const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  adamw_apart_kernel<<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
      n, step, p, g, m, v, p_out, m_out, v_out, copy);
  cuda::check_launch("adamw_apart");
}

template <>
void adamw_rescale<Device::Cuda>(int64_t n, const AdamwStep& step, float scale, const float* p, const float* m,
                                 const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  adamw_rescale_kernel<<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
      n, step, scale, p, m, v, p_out, m_out, v_out, copy);
  cuda::check_launch("adamw_rescale");
}

template <>
void sgd_apart<Device::Cuda>(int64_t n, float lr, const float* p, const float* g, float* p_out, bfloat16* copy) {
  sgd_apart_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, lr, p, g, p_out, copy);
  cuda::check_launch("sgd_apart");
}

template <>
void sgd_rescale<Device::Cuda>(int64_t n, float scale, const float* p, float* p_out, bfloat16* copy) {
  sgd_rescale_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, scale, p, p_out, copy);
  cuda::check_launch("sgd_rescale");
}

template <>
void sgd<Device::Cuda>(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy) {
  sgd_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, lr, clip, p, g, copy);
  cuda::check_launch("sgd");
}

template <>
void clip_by_norm<Device::Cuda>(int64_t n, float max_norm, const float* norm, float* x) {
  clip_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, max_norm, norm, x);
  cuda::check_launch("clip_by_norm");
}

}  // namespace jnntile
