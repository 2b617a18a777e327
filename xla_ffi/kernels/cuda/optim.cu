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
    step.apply(p[i], g[i] * factor, m[i], v[i]);
    if (copy != nullptr) copy[i] = from_float<bfloat16>(p[i]);
  }
}

__global__ void sgd_kernel(int64_t n, float lr, GradClip clip, float* p, const float* g, bfloat16* copy) {
  const float factor = clip.factor();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] -= lr * (g[i] * factor);
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
