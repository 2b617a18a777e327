#include "kernels/cuda/groups.h"
#include "kernels/rotary.h"

namespace jnntile {
namespace {

using cuda::for_each_element;
using cuda::for_groups;
using cuda::kPerThread;

// The elements (i, i + d/2) of pair p of the tile: pair c = p % (d/2) of head p / (d/2).
__device__ inline int64_t first_of_pair(const RotaryTile& t, int64_t p) {
  const int64_t half = t.d / 2;
  return p / half * t.d + p % half;
}

// A thread's kPerThread pairs, both values of each loaded before any is turned (kernels/cuda/groups.h); each
// pair computes its own cosine and sine.
template <class T>
__global__ void forward_kernel(RotaryTile t, const T* x, T* y) {
  const int64_t pairs = rotary::numel(t) / 2, half = t.d / 2;
  for_groups(pairs, [&](int64_t p0, int64_t stride) {
    T as[kPerThread], bs[kPerThread];
    for_each_element(pairs, p0, stride, [&](int k, int64_t p) {
      const int64_t i = first_of_pair(t, p);
      as[k] = x[i];
      bs[k] = x[i + half];
    });
    for_each_element(pairs, p0, stride, [&](int k, int64_t p) {
      const int64_t i = first_of_pair(t, p);
      if (t.rotate) {
        float sin_a, cos_a, a, b;
        sincosf(rotary::angle(t, i), &sin_a, &cos_a);
        rotary::turn(to_float(as[k]), to_float(bs[k]), cos_a, sin_a, a, b);
        as[k] = from_float<T>(a);
        bs[k] = from_float<T>(b);
      }
      y[i] = as[k];
      y[i + half] = bs[k];
    });
  });
}

template <class T>
__global__ void backward_kernel(RotaryTile t, const T* dy, T* dx) {
  const int64_t pairs = rotary::numel(t) / 2, half = t.d / 2;
  for_groups(pairs, [&](int64_t p0, int64_t stride) {
    T das[kPerThread], dbs[kPerThread], xas[kPerThread], xbs[kPerThread];
    for_each_element(pairs, p0, stride, [&](int k, int64_t p) {
      const int64_t i = first_of_pair(t, p);
      das[k] = dy[i];
      dbs[k] = dy[i + half];
      if (!t.overwrite) {
        xas[k] = dx[i];
        xbs[k] = dx[i + half];
      }
    });
    for_each_element(pairs, p0, stride, [&](int k, int64_t p) {
      const int64_t i = first_of_pair(t, p);
      float a = to_float(das[k]), b = to_float(dbs[k]);
      if (t.rotate) {
        float sin_a, cos_a;
        sincosf(rotary::angle(t, i), &sin_a, &cos_a);
        rotary::turn(to_float(das[k]), to_float(dbs[k]), cos_a, -sin_a, a, b);
      }
      dx[i] = from_float<T>(rotary::backward_base(t, xas, k) + a);
      dx[i + half] = from_float<T>(rotary::backward_base(t, xbs, k) + b);
    });
  });
}

}  // namespace

template <>
void rotary_forward<Device::Cuda>(FloatType type, const RotaryTile& t, const void* x, void* y) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    forward_kernel<<<cuda::blocks_for_groups(rotary::numel(t) / 2), cuda::kThreads, 0, cuda::stream()>>>(
        t, static_cast<const T*>(x), static_cast<T*>(y));
  });
  cuda::check_launch("rotary_forward");
}

template <>
void rotary_backward<Device::Cuda>(FloatType type, const RotaryTile& t, const void* dy, void* dx) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    backward_kernel<<<cuda::blocks_for_groups(rotary::numel(t) / 2), cuda::kThreads, 0, cuda::stream()>>>(
        t, static_cast<const T*>(dy), static_cast<T*>(dx));
  });
  cuda::check_launch("rotary_backward");
}

}  // namespace jnntile
