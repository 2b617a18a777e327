#include "kernels/cpu/reduce.h"

namespace jnntile::cpu {

double sumsq(int64_t n, const float* x) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += double(x[i]) * double(x[i]);
  return acc;
}

double sum_partials(int64_t count, const double* const* partials) {
  double sum = 0.0, compensation = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    double y = *partials[i] - compensation;
    double t = sum + y;
    compensation = (t - sum) - y;
    sum = t;
  }
  return sum;
}

}  // namespace jnntile::cpu
