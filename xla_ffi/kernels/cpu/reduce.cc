#include "kernels/reduce.h"

namespace jnntile {

template <>
void sumsq<Device::Cpu>(int64_t n, const float* x, double* out, double*) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += double(x[i]) * double(x[i]);
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
