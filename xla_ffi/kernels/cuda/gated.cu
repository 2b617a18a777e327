#include "kernels/cuda/context.h"
#include "kernels/gated.h"

namespace jnntile {
namespace {

// One thread per element (grid-stride).
template <class T>
__global__ void forward_kernel(int64_t n, const T* gate, const T* up, T* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = from_float<T>(gated::forward(to_float(gate[i]), to_float(up[i])));
}

template <class T>
__global__ void backward_kernel(int64_t n, bool overwrite, const T* gate, const T* up, const T* dy, T* dgate,
                                T* dup) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float dg = overwrite ? 0.0f : to_float(dgate[i]), du = overwrite ? 0.0f : to_float(dup[i]);
    gated::backward(to_float(gate[i]), to_float(up[i]), to_float(dy[i]), dg, du);
    dgate[i] = from_float<T>(dg);
    dup[i] = from_float<T>(du);
  }
}

}  // namespace

template <>
void swiglu_forward<Device::Cuda>(FloatType type, int64_t n, const void* gate, const void* up, void* y) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    forward_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(
        n, static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(y));
  });
  cuda::check_launch("swiglu_forward");
}

template <>
void swiglu_backward<Device::Cuda>(FloatType type, int64_t n, bool overwrite, const void* gate, const void* up,
                                   const void* dy, void* dgate, void* dup) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    backward_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(
        n, overwrite, static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dy), static_cast<T*>(dgate),
        static_cast<T*>(dup));
  });
  cuda::check_launch("swiglu_backward");
}

}  // namespace jnntile
