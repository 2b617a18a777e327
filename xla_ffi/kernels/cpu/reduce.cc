#include "kernels/reduce.h"

namespace jnntile {

// Eight running sums, in a fixed order: one sum waited on each addition's latency (0.8 G floats/s, 2.3% of a
// GPT-2 124M step on 2 cores); eight vectorise and keep the result the same on every run.
template <>
void sumsq<Device::Cpu>(int64_t n, const float* x, double* out, double*) {
  constexpr int64_t kLanes = 8;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += double(x[i + j]) * double(x[i + j]);
  for (; i < n; ++i) lanes[0] += double(x[i]) * double(x[i]);
  double acc = 0.0;
  for (double lane : lanes) acc += lane;
  *out = acc;
}

template <>
void sumsq_combine<Device::Cpu>(int64_t count, const double* const* partials, bool take_sqrt, float* out, void*) {
  CompensatedSum total;
  for (int64_t i = 0; i < count; ++i) total.add(*partials[i]);
  *out = float(take_sqrt ? sqrt(total.sum) : total.sum);
}

template <>
void sumsq_backward<Device::Cpu>(int64_t n, bool take_sqrt, const float* x, const float* out, const float* dout,
                                 float* dx) {
  float c = sumsq_backward_scale(take_sqrt, *out, *dout);
  for (int64_t i = 0; i < n; ++i) dx[i] += c * x[i];
}

}  // namespace jnntile
