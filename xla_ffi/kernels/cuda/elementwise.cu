#include "kernels/cuda/context.h"
#include "kernels/elementwise.h"

namespace jnntile {
namespace {

template <class Kernel, class... Args>
__global__ void elementwise_kernel(int64_t n, Args... args) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    Kernel::apply(i, args...);
}

// Launches Kernel::apply over n elements on the worker's stream.
template <class Kernel>
struct Launch {
  template <class... Args>
  static void run(int64_t n, Args... args) {
    elementwise_kernel<Kernel><<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, args...);
    cuda::check_launch("elementwise");
  }
};

struct Axpby {
  static __device__ void apply(int64_t i, float a, const float* x, float b, const float* y, float* out) {
    out[i] = y == nullptr ? a * x[i] : axpby_element(a, x[i], b, y[i]);
  }
};

struct Accumulate {
  static __device__ void apply(int64_t i, float a, const float* x, float* out) { out[i] += a * x[i]; }
};

}  // namespace

template <>
void unary_forward<Device::Cuda>(Unary op, int64_t n, const float* x, float* y) {
  unary::dispatch<Launch, unary::Forward>(op, n, x, y);
}

template <>
void unary_backward<Device::Cuda>(Unary op, int64_t n, const float* x, const float* dy, float* dx) {
  unary::dispatch<Launch, unary::Backward>(op, n, x, dy, dx);
}

template <>
void axpby<Device::Cuda>(int64_t n, float a, const float* x, float b, const float* y, float* out) {
  Launch<Axpby>::run(n, a, x, b, y, out);
}

template <>
void accumulate<Device::Cuda>(int64_t n, float a, const float* x, float* out) {
  Launch<Accumulate>::run(n, a, x, out);
}

}  // namespace jnntile
