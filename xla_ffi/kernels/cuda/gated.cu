#include "kernels/cuda/context.h"
#include "kernels/gated.h"

namespace jnntile {
namespace {

// One thread per element (grid-stride).
__global__ void forward_kernel(int64_t n, const float* gate, const float* up, float* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = gated::forward(gate[i], up[i]);
}

__global__ void backward_kernel(int64_t n, const float* gate, const float* up, const float* dy, float* dgate,
                                float* dup) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    gated::backward(gate[i], up[i], dy[i], dgate[i], dup[i]);
}

}  // namespace

template <>
void swiglu_forward<Device::Cuda>(int64_t n, const float* gate, const float* up, float* y) {
  forward_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, gate, up, y);
  cuda::check_launch("swiglu_forward");
}

template <>
void swiglu_backward<Device::Cuda>(int64_t n, const float* gate, const float* up, const float* dy, float* dgate,
                                   float* dup) {
  backward_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, gate, up, dy, dgate, dup);
  cuda::check_launch("swiglu_backward");
}

}  // namespace jnntile
