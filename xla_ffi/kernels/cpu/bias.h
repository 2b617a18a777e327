// Bias broadcast over leading axes and the bias gradient; no StarPU here.
#pragma once
#include <cstdint>

namespace jnntile::cpu {

// x: (rows, n)  b: (n,)  out: (rows, n);  out = x + b
void add_bias(int64_t rows, int64_t n, const float* x, const float* b, float* out);

// dy: (rows, n)  db: (n,);  db += sum over rows of dy (accumulated in double)
void bias_grad(int64_t rows, int64_t n, const float* dy, float* db);

}  // namespace jnntile::cpu
