#include "kernels/cuda/context.h"
#include "kernels/elementwise.h"

namespace jnntile {
namespace {

// Elements per thread. A thread loads all of its elements' operands before it computes and stores any (its
// operands wait in registers, and apply() runs on those copies), so its loads are all in flight at once: with
// one bfloat16 element per thread (4 KB per SM in flight) GPT-2 124M's GELU forward took 117 us per task of
// 25M elements on an H200, 0.85 TB/s against the 4.3 TB/s a copy reaches.
constexpr int kPerThread = 8;

// The grid-stride loop over groups of kPerThread elements, a block's threads on adjacent elements (coalesced):
// body(i0, stride) with the group's first element i0 and the distance between its elements.
template <class Body>
__device__ void for_groups(int64_t n, Body body) {
  const int64_t group = int64_t(blockDim.x) * kPerThread;
  for (int64_t i0 = blockIdx.x * group + threadIdx.x; i0 < n; i0 += int64_t(gridDim.x) * group)
    body(i0, int64_t(blockDim.x));
}

// Copies element i0 + k * stride of `from` (where it exists) into to[k], for every k.
template <class T>
__device__ void load(int64_t n, int64_t i0, int64_t stride, const T* from, T (&to)[kPerThread]) {
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (i0 + k * stride < n) to[k] = from[i0 + k * stride];
}

// Runs apply(k, ...) on the loaded copies for every element that exists, then stores out[k].
template <class T, class Apply>
__device__ void apply_and_store(int64_t n, int64_t i0, int64_t stride, Apply apply, const T (&out)[kPerThread],
                                T* to) {
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (i0 + k * stride < n) {
      apply(k);
      to[i0 + k * stride] = out[k];
    }
}

template <class Kernel, class T>
__global__ void forward_kernel(int64_t n, const T* x, T* y) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T xs[kPerThread], ys[kPerThread];
    load(n, i0, stride, x, xs);
    apply_and_store(n, i0, stride, [&](int k) { Kernel::apply(k, xs, ys); }, ys, y);
  });
}

template <class Kernel, class T>
__global__ void backward_kernel(int64_t n, bool overwrite, const T* x, const T* dy, T* dx) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T xs[kPerThread], dys[kPerThread], dxs[kPerThread];
    load(n, i0, stride, x, xs);
    load(n, i0, stride, dy, dys);
    if (!overwrite) load(n, i0, stride, static_cast<const T*>(dx), dxs);
    apply_and_store(n, i0, stride, [&](int k) { Kernel::apply(k, overwrite, xs, dys, dxs); }, dxs, dx);
  });
}

template <class T>
__global__ void axpby_kernel(int64_t n, float a, const T* x, float b, const T* y, T* out) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T xs[kPerThread], ys[kPerThread], outs[kPerThread];
    load(n, i0, stride, x, xs);
    if (y) load(n, i0, stride, y, ys);
    apply_and_store(n, i0, stride, [&](int k) { Axpby::apply(k, a, xs, b, y ? ys : nullptr, outs); }, outs, out);
  });
}

template <class S, class T>
__global__ void accumulate_kernel(int64_t n, float a, bool overwrite, const S* x, T* out) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    S xs[kPerThread];
    T outs[kPerThread];
    load(n, i0, stride, x, xs);
    if (!overwrite) load(n, i0, stride, static_cast<const T*>(out), outs);
    apply_and_store(n, i0, stride, [&](int k) { Accumulate::apply(k, a, overwrite, xs, outs); }, outs, out);
  });
}

inline unsigned blocks_for_groups(int64_t n) { return cuda::blocks_for(n, cuda::kThreads * kPerThread); }

template <class Kernel>
struct LaunchForward {
  template <class T>
  static void run(int64_t n, const T* x, T* y) {
    forward_kernel<Kernel><<<blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(n, x, y);
    cuda::check_launch("unary_forward");
  }
};

template <class Kernel>
struct LaunchBackward {
  template <class T>
  static void run(int64_t n, bool overwrite, const T* x, const T* dy, T* dx) {
    backward_kernel<Kernel><<<blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(n, overwrite, x, dy, dx);
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
    axpby_kernel<<<blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
        n, a, static_cast<const T*>(x), b, static_cast<const T*>(y), static_cast<T*>(out));
  });
  cuda::check_launch("axpby");
}

template <>
void accumulate<Device::Cuda>(FloatType x_type, FloatType out_type, int64_t n, float a, bool overwrite, const void* x,
                               void* out) {
  visit_float(x_type, [&](auto xt) {
    visit_float(out_type, [&](auto ot) {
      accumulate_kernel<<<blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
          n, a, overwrite, static_cast<const decltype(xt)*>(x), static_cast<decltype(ot)*>(out));
    });
  });
  cuda::check_launch("accumulate");
}

}  // namespace jnntile
