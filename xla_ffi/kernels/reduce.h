// Sums of squares of tiles, and the compensated sums that combine partial results.
#pragma once
#include <math.h>

#include "kernels/device.h"

namespace jnntile {

// A compensated (Kahan) sum fed one term at a time in a fixed order: combining
// partials gives the same result whichever worker computed them.
struct CompensatedSum {
  double sum = 0.0, compensation = 0.0;
  JNNTILE_HD void add(double value) {
    double y = value - compensation;
    double t = sum + y;
    compensation = (t - sum) - y;
    sum = t;
  }
};

// The gradient of sum(x^2) (take_sqrt: of its square root, the norm) is c * x.
JNNTILE_HD float sumsq_backward_scale(bool take_sqrt, float out, float dout) {
  return take_sqrt ? (out > 0.0f ? dout / out : 0.0f) : 2.0f * dout;
}

// The GPU sums the squares of a tile in up to this many blocks, each writing
// its partial to a scratch of as many doubles, then adds those in a fixed
// order. 1024 blocks of 256 threads fill an H100/H200 (8 blocks on each of
// 132 SMs): with 128 the loop had too few loads in flight to stream a tile.
constexpr int kSumsqBlocks = 1024;

// *out = sum of x[0..n)^2, accumulated in double. scratch: kSumsqBlocks doubles (GPU).
template <Device D>
void sumsq(int64_t n, const float* x, double* out, double* scratch);
// *out = the compensated sum of the first double of each of `count` partials,
// or its square root. scratch: `count` pointers (GPU, see cuda::device_pointers).
template <Device D>
void sumsq_combine(int64_t count, const double* const* partials, bool take_sqrt, float* out, void* scratch);
// dx += sumsq_backward_scale(take_sqrt, *out, *dout) * x; out and dout are scalars in the device's memory.
template <Device D>
void sumsq_backward(int64_t n, bool take_sqrt, const float* x, const float* out, const float* dout, float* dx);

}  // namespace jnntile
