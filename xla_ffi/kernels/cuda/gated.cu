#include "kernels/cuda/groups.h"
#include "kernels/gated.h"

namespace jnntile {
namespace {

using cuda::for_each_element;
using cuda::for_groups;
using cuda::kPerThread;
using cuda::load;
using cuda::store;

// A thread's kPerThread elements, every operand loaded before any is computed (kernels/cuda/groups.h).
template <class T>
__global__ void forward_kernel(int64_t n, const T* gate, const T* up, T* y) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T gates[kPerThread], ups[kPerThread], ys[kPerThread];
    load(n, i0, stride, gate, gates);
    load(n, i0, stride, up, ups);
    for_each_element(n, i0, stride, [&](int k, int64_t) {
      ys[k] = from_float<T>(gated::forward(to_float(gates[k]), to_float(ups[k])));
    });
    store(n, i0, stride, ys, y);
  });
}

// Two blocks per SM: the compiler took 168 registers for the 8 elements' interleaved sums (one block of 256
// threads per SM, no more loads in flight than one element per thread had); within 128 it does not spill.
template <class T>
__global__ void __launch_bounds__(cuda::kThreads, 2)
    backward_kernel(int64_t n, bool overwrite, const T* gate, const T* up, const T* dy, T* dgate, T* dup) {
  for_groups(n, [&](int64_t i0, int64_t stride) {
    T gates[kPerThread], ups[kPerThread], dys[kPerThread], dgates[kPerThread], dups[kPerThread];
    load(n, i0, stride, gate, gates);
    load(n, i0, stride, up, ups);
    load(n, i0, stride, dy, dys);
    if (!overwrite) {
      load(n, i0, stride, static_cast<const T*>(dgate), dgates);
      load(n, i0, stride, static_cast<const T*>(dup), dups);
    }
    for_each_element(n, i0, stride, [&](int k, int64_t) {
      float dg = overwrite ? 0.0f : to_float(dgates[k]), du = overwrite ? 0.0f : to_float(dups[k]);
      gated::backward(to_float(gates[k]), to_float(ups[k]), to_float(dys[k]), dg, du);
      dgates[k] = from_float<T>(dg);
      dups[k] = from_float<T>(du);
    });
    store(n, i0, stride, dgates, dgate);
    store(n, i0, stride, dups, dup);
  });
}

}  // namespace

template <>
void swiglu_forward<Device::Cuda>(FloatType type, int64_t n, const void* gate, const void* up, void* y) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    forward_kernel<<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
        n, static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(y));
  });
  cuda::check_launch("swiglu_forward");
}

template <>
void swiglu_backward<Device::Cuda>(FloatType type, int64_t n, bool overwrite, const void* gate, const void* up,
                                   const void* dy, void* dgate, void* dup) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    backward_kernel<<<cuda::blocks_for_groups(n), cuda::kThreads, 0, cuda::stream()>>>(
        n, overwrite, static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dy),
        static_cast<T*>(dgate), static_cast<T*>(dup));
  });
  cuda::check_launch("swiglu_backward");
}

}  // namespace jnntile
