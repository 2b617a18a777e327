#include "kernels/cuda/context.h"
#include "kernels/rotary.h"

namespace jnntile {
namespace {

// One thread per pair of the tile (grid-stride): element i < numel / 2 names pair c = i % (d/2) of head
// i / (d/2); it computes its own cosine and sine.
template <class T>
__global__ void forward_kernel(RotaryTile t, const T* x, T* y) {
  const int64_t half = t.d / 2, pairs = rotary::numel(t) / 2;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p / half * t.d + p % half, j = i + half;
    if (!t.rotate) {
      y[i] = x[i];
      y[j] = x[j];
      continue;
    }
    float sin_a, cos_a, a, b;
    sincosf(rotary::angle(t, i), &sin_a, &cos_a);
    rotary::turn(to_float(x[i]), to_float(x[j]), cos_a, sin_a, a, b);
    y[i] = from_float<T>(a);
    y[j] = from_float<T>(b);
  }
}

template <class T>
__global__ void backward_kernel(RotaryTile t, const T* dy, T* dx) {
  const int64_t half = t.d / 2, pairs = rotary::numel(t) / 2;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p / half * t.d + p % half, j = i + half;
    float a = to_float(dy[i]), b = to_float(dy[j]);
    if (t.rotate) {
      float sin_a, cos_a;
      sincosf(rotary::angle(t, i), &sin_a, &cos_a);
      rotary::turn(to_float(dy[i]), to_float(dy[j]), cos_a, -sin_a, a, b);
    }
    dx[i] = from_float<T>(rotary::backward_base(t, dx, i) + a);
    dx[j] = from_float<T>(rotary::backward_base(t, dx, j) + b);
  }
}

}  // namespace

template <>
void rotary_forward<Device::Cuda>(FloatType type, const RotaryTile& t, const void* x, void* y) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    forward_kernel<<<cuda::blocks_for(rotary::numel(t) / 2), cuda::kThreads, 0, cuda::stream()>>>(
        t, static_cast<const T*>(x), static_cast<T*>(y));
  });
  cuda::check_launch("rotary_forward");
}

template <>
void rotary_backward<Device::Cuda>(FloatType type, const RotaryTile& t, const void* dy, void* dx) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    backward_kernel<<<cuda::blocks_for(rotary::numel(t) / 2), cuda::kThreads, 0, cuda::stream()>>>(
        t, static_cast<const T*>(dy), static_cast<T*>(dx));
  });
  cuda::check_launch("rotary_backward");
}

}  // namespace jnntile
