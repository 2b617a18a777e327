// Elementwise kernels. Unary functions are declared once in UNARY_FUNCTIONS;
// the Python list in jnntile/ops/elementwise.py uses the same codes.
#pragma once
#include <cstdint>

namespace jnntile::cpu {

enum class Unary : int { GeluTanh = 0, Relu = 1, Tanh = 2, Exp = 3, Silu = 4, Sigmoid = 5 };

void unary_forward(Unary op, int64_t n, const float* x, float* y);
// dx += dy * f'(x)
void unary_backward(Unary op, int64_t n, const float* x, const float* dy, float* dx);
// out = a * x + b * y   (y may be null when b == 0)
void axpby(int64_t n, float a, const float* x, float b, const float* y, float* out);
// out += a * x
void accumulate(int64_t n, float a, const float* x, float* out);

}  // namespace jnntile::cpu
