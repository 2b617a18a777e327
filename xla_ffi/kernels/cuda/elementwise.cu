#include "kernels/cuda/groups.h"
#include "kernels/elementwise.h"

namespace jnntile {
namespace {

using cuda::for_each_element;
using cuda::for_groups;
using cuda::kPerThread;
using cuda::load;
using cuda::store;

// Each kernel runs apply() on register copies of a thread's elements (kernels/cuda/groups.h).
template <class Kernel, class T>
__global__ void forward_kernel(int64_t n, const T* x, T* y) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T xs[kPerThread], ys[kPerThread];
    load(n, i0, stride, x, xs);
    for_each_element(n, i0, stride, [&](int k, int64_t) { Kernel::apply(k, xs, ys); });
    store(n, i0, stride, ys, y);
  });
}

template <class Kernel, class T>
__global__ void backward_kernel(int64_t n, bool overwrite, const T* x, const T* dy, T* dx) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T xs[kPerThread], dys[kPerThread], dxs[kPerThread];
    load(n, i0, stride, x, xs);
    load(n, i0, stride, dy, dys);
    if (!overwrite) load(n, i0, stride, static_cast<const T*>(dx), dxs);
    for_each_element(n, i0, stride, [&](int k, int64_t) { Kernel::apply(k, overwrite, xs, dys, dxs); });
    store(n, i0, stride, dxs, dx);
  });
}

template <class T>
__global__ void axpby_kernel(int64_t n, float a, const T* x, float b, const T* y, T* out) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T xs[kPerThread], ys[kPerThread], outs[kPerThread];
    load(n, i0, stride, x, xs);
    if (y) load(n, i0, stride, y, ys);
    for_each_element(n, i0, stride, [&](int k, int64_t) { Axpby::apply(k, a, xs, b, y ? ys : nullptr, outs); });
    store(n, i0, stride, outs, out);
  });
}

template <class S, class T>
__global__ void accumulate_kernel(int64_t n, float a, bool overwrite, const S* x, T* out) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    S xs[kPerThread];
    T outs[kPerThread];
    load(n, i0, stride, x, xs);
    if (!overwrite) load(n, i0, stride, static_cast<const T*>(out), outs);
    for_each_element(n, i0, stride, [&](int k, int64_t) { Accumulate::apply(k, a, overwrite, xs, outs); });
    store(n, i0, stride, outs, out);
  });
}

template <class Kernel>
struct LaunchForward {
  template <class T>
  static void run(int64_t n, const T* x, T* y) {
    forward_kernel<Kernel><<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(n, x, y);
    cuda::check_launch("unary_forward");
  }
};

template <class Kernel>
struct LaunchBackward {
  template <class T>
  static void run(int64_t n, bool overwrite, const T* x, const T* dy, T* dx) {
    backward_kernel<Kernel><<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(n, overwrite, x, dy,
                                                                                               dx);
    cuda::check_launch("unary_backward");
  }
};

}  // namespace

template <>
void unary_forward<Device::Cuda>(Unary op, FloatType type, int64_t n, const void* x, void* y) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    unary::dispatch<LaunchForward, unary::Forward>(op, n, static_cast<const T*>(x), static_cast<T*>(y));
  });
}

template <>
void unary_backward<Device::Cuda>(Unary op, FloatType type, int64_t n, bool overwrite, const void* x,
                                  const void* dy, void* dx) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    unary::dispatch<LaunchBackward, unary::Backward>(op, n, overwrite, static_cast<const T*>(x),
                                                     static_cast<const T*>(dy), static_cast<T*>(dx));
  });
}

template <>
void axpby<Device::Cuda>(FloatType type, int64_t n, float a, const void* x, float b, const void* y, void* out) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    axpby_kernel<<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
        n, a, static_cast<const T*>(x), b, static_cast<const T*>(y), static_cast<T*>(out));
  });
  cuda::check_launch("axpby");
}

template <>
void accumulate<Device::Cuda>(FloatType x_type, FloatType out_type, int64_t n, float a, bool overwrite, const void* x,
                               void* out) {
  visit_float(x_type, [&](auto xt) {
    visit_float(out_type, [&](auto ot) {
      accumulate_kernel<<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
          n, a, overwrite, static_cast<const decltype(xt)*>(x), static_cast<decltype(ot)*>(out));
    });
  });
  cuda::check_launch("accumulate");
}

}  // namespace jnntile
