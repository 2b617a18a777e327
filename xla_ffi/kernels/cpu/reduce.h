#pragma once
#include <cstdint>

namespace jnntile::cpu {
// Sum of squares of x[0..n), accumulated in double.
double sumsq(int64_t n, const float* x);
// Sum of `count` partial values (Kahan-compensated), each in its own buffer.
double sum_partials(int64_t count, const double* const* partials);
}  // namespace jnntile::cpu
