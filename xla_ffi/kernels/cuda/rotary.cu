#include "kernels/cuda/context.h"
#include "kernels/rotary.h"

namespace jnntile {
namespace {

// One thread per pair of the tile (grid-stride): element i < numel / 2 names pair c = i % (d/2) of head
// i / (d/2); it computes its own cosine and sine.
__global__ void forward_kernel(RotaryTile t, const float* x, float* y) {
  const int64_t half = t.d / 2, pairs = rotary::numel(t) / 2;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p / half * t.d + p % half, j = i + half;
    if (!t.rotate) {
      y[i] = x[i];
      y[j] = x[j];
      continue;
    }
    float sin_a, cos_a;
    sincosf(rotary::angle(t, i), &sin_a, &cos_a);
    rotary::turn(x[i], x[j], cos_a, sin_a, y[i], y[j]);
  }
}

__global__ void backward_kernel(RotaryTile t, const float* dy, float* dx) {
  const int64_t half = t.d / 2, pairs = rotary::numel(t) / 2;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p / half * t.d + p % half, j = i + half;
    if (!t.rotate) {
      dx[i] += dy[i];
      dx[j] += dy[j];
      continue;
    }
    float sin_a, cos_a, a, b;
    sincosf(rotary::angle(t, i), &sin_a, &cos_a);
    rotary::turn(dy[i], dy[j], cos_a, -sin_a, a, b);
    dx[i] += a;
    dx[j] += b;
  }
}

}  // namespace

template <>
void rotary_forward<Device::Cuda>(const RotaryTile& t, const float* x, float* y) {
  forward_kernel<<<cuda::blocks_for(rotary::numel(t) / 2), cuda::kThreads, 0, cuda::stream()>>>(t, x, y);
  cuda::check_launch("rotary_forward");
}

template <>
void rotary_backward<Device::Cuda>(const RotaryTile& t, const float* dy, float* dx) {
  backward_kernel<<<cuda::blocks_for(rotary::numel(t) / 2), cuda::kThreads, 0, cuda::stream()>>>(t, dy, dx);
  cuda::check_launch("rotary_backward");
}

}  // namespace jnntile
