// Bias broadcast over leading rows, and the bias gradient.
#pragma once
#include "kernels/device.h"

namespace jnntile {

// x: (rows, n)  b: (n,)  out: (rows, n);  out = x + b
template <Device D>
void add_bias(int64_t rows, int64_t n, const float* x, const float* b, float* out);

// dy: (rows, n)  db: (n,);  db += sum over rows of dy, accumulated in double
// in a fixed order (rows in order on the CPU, interleaved row lanes on the GPU).
template <Device D>
void bias_grad(int64_t rows, int64_t n, const float* dy, float* db);

}  // namespace jnntile
