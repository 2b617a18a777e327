#include "kernels/cuda/context.h"
#include "kernels/optim.h"

namespace jnntile {
namespace {

// All three: one thread per element (grid-stride); every thread reads the norm (one cached load).
// With a copy, each thread also stores its updated p rounded to bfloat16.
__global__ void adamw_kernel(int64_t n, AdamwStep step, GradClip clip, float* p, const float* g, float* m, float* v,
                             bfloat16* copy) {
  const float factor = clip.factor();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (factor == 1.0f) step.apply(p[i], g[i], m[i], v[i]);
    else step.apply_scaled(p[i], g[i], m[i], v[i], factor);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p[i]);
  }
}

__global__ void adamw_apart_kernel(int64_t n, AdamwStep step, const float* p, const float* g, const float* m,
                                   const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    adamw_apart_at(i, step, p, g, m, v, p_out, m_out, v_out, copy);
}

__global__ void adamw_rescale_kernel(int64_t n, AdamwStep step, float scale, const float* p, const float* m,
                                     const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    step.rescale(p[i], m[i], v[i], scale, p_out[i], m_out[i], v_out[i]);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p_out[i]);
  }
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
  adamw_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, step, clip, p, g, m, v, copy);
  cuda::check_launch("adamw");
}

template <>
void adamw_apart<Device::Cuda>(int64_t n, const AdamwStep& step, const float* p, const float* g, const float* m,
                               const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  adamw_apart_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, step, p, g, m, v, p_out, m_out,
                                                                                  v_out, copy);
  cuda::check_launch("adamw_apart");
}

template <>
void adamw_rescale<Device::Cuda>(int64_t n, const AdamwStep& step, float scale, const float* p, const float* m,
                                 const float* v, float* p_out, float* m_out, float* v_out, bfloat16* copy) {
  adamw_rescale_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, step, scale, p, m, v, p_out,
                                                                                    m_out, v_out, copy);
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
