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

}  // namespace

template <>
void unary_forward<Device::Cuda>(Unary op, FloatType type, int64_t n, const void* x, void* y) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    unary::dispatch<Launch, unary::Forward>(op, n, static_cast<const T*>(x), static_cast<T*>(y));
  });
}

template <>
void unary_backward<Device::Cuda>(Unary op, FloatType type, int64_t n, bool overwrite, const void* x,
                                  const void* dy, void* dx) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    unary::dispatch<Launch, unary::Backward>(op, n, overwrite, static_cast<const T*>(x), static_cast<const T*>(dy),
                                             static_cast<T*>(dx));
  });
}

template <>
void axpby<Device::Cuda>(FloatType type, int64_t n, float a, const void* x, float b, const void* y, void* out) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    Launch<Axpby>::run(n, a, static_cast<const T*>(x), b, static_cast<const T*>(y), static_cast<T*>(out));
  });
}

template <>
void accumulate<Device::Cuda>(FloatType x_type, FloatType out_type, int64_t n, float a, bool overwrite, const void* x,
                               void* out) {
  visit_float(x_type, [&](auto xt) {
    visit_float(out_type, [&](auto ot) {
      Launch<Accumulate>::run(n, a, overwrite, static_cast<const decltype(xt)*>(x), static_cast<decltype(ot)*>(out));
    });
  });
}

}  // namespace jnntile
