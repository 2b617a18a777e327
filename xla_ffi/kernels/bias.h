// Bias broadcast over leading rows, and the bias gradient.
#pragma once
#include "kernels/device.h"

namespace jnntile {

// x, out and dy are tiles of `type` (float32 or bfloat16), b and db float32 (a bias stays a float32 master).

// x: (rows, n)  b: (n,)  out: (rows, n);  out = x + b
template <Device D>
void add_bias(FloatType type, int64_t rows, int64_t n, const void* x, const float* b, void* out);

// dy: (rows, n)  db: (n,);  db += sum over rows of dy (db = ... with `overwrite`: db holds nothing yet),
// accumulated in double in a fixed order (rows in order on the CPU, interleaved row lanes on the GPU).
template <Device D>
void bias_grad(FloatType type, int64_t rows, int64_t n, bool overwrite, const void* dy, float* db);

}  // namespace jnntile
