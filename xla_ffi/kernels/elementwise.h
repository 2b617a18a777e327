// Elementwise kernels: unary functions (value and derivative), axpby, accumulate.
// Unary functions are declared once here; module.cc binds their enum as
// jnntile._xla_ffi.Unary, which jnntile/ops/elementwise.py reads.
#pragma once
#include "kernels/device.h"
#include "kernels/math.h"

namespace jnntile {

enum class Unary : int { GeluTanh = 0, Relu = 1, Tanh = 2, Exp = 3, Silu = 4, Sigmoid = 5 };

namespace unary {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// Each function: value f(x) and derivative f'(x).
//
// GELU's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), is computed as x sigmoid(2u)
// (the same function: 1 + tanh(u) = 2 sigmoid(2u)): one exponential and one division, with no cancellation
// to guard against, where tanh_approx also needs a sign, a series and a select (0.95 -> 0.66 ns per element
// forward on one core in 256-bit vectors, 1.17 -> 0.87 backward).
struct GeluTanh {
  static JNNTILE_HD float u(float x) { return kSqrt2OverPi * (x + kGeluCoeff * x * x * x); }
  static JNNTILE_HD float f(float x) { return x / (1.0f + exp_approx(-2.0f * u(x))); }
  static JNNTILE_HD float df(float x) {
    const float s = 1.0f / (1.0f + exp_approx(-2.0f * u(x)));  // sigmoid(2u) = 0.5 (1 + tanh(u))
    return s + 2.0f * x * s * (1.0f - s) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x * x);
  }
};
struct Relu {
  static JNNTILE_HD float f(float x) { return x > 0.0f ? x : 0.0f; }
  static JNNTILE_HD float df(float x) { return x > 0.0f ? 1.0f : 0.0f; }
};
struct Tanh {
  static JNNTILE_HD float f(float x) { return tanh_approx(x); }
  static JNNTILE_HD float df(float x) {
    float t = tanh_approx(x);
    return 1.0f - t * t;
  }
};
struct Exp {
  static JNNTILE_HD float f(float x) { return exp_approx(x); }
  static JNNTILE_HD float df(float x) { return exp_approx(x); }
};
struct Sigmoid {
  static JNNTILE_HD float f(float x) { return 1.0f / (1.0f + exp_approx(-x)); }
  static JNNTILE_HD float df(float x) {
    float s = f(x);
    return s * (1.0f - s);
  }
};
struct Silu {
  static JNNTILE_HD float f(float x) { return x * Sigmoid::f(x); }
  static JNNTILE_HD float df(float x) {
    float s = Sigmoid::f(x);
    return s * (1.0f + x * (1.0f - s));
  }
};

// y = f(x) and dx += dy * f'(x) (dx = ... with `overwrite`: dx holds nothing yet) on one element of float32
// or bfloat16 tiles, computed in float. The CPU passes `overwrite` as a std::bool_constant (visit_flag): a flag
// tested per element kept its bfloat16 loop from vectorising (5.5 ms per GELU backward task of GPT-2 124M, not
// 1.1).
template <class F>
struct Forward {
  template <class T>
  static JNNTILE_HD void apply(int64_t i, const T* x, T* y) {
    y[i] = from_float<T>(F::f(to_float(x[i])));
  }
};
template <class F>
struct Backward {
  template <class T, class Flag>
  static JNNTILE_HD void apply(int64_t i, Flag overwrite, const T* x, const T* dy, T* dx) {
    dx[i] = from_float<T>((overwrite ? 0.0f : to_float(dx[i])) + to_float(dy[i]) * F::df(to_float(x[i])));
  }
};

// Runs Run<Kernel<Function>>(args...) for the function named by `op`, so the
// loop (or the CUDA kernel) is compiled once per function, not branching per element.
template <template <class> class Run, template <class> class Kernel, class... Args>
void dispatch(Unary op, Args... args) {
  switch (op) {
    case Unary::GeluTanh: Run<Kernel<GeluTanh>>::run(args...); break;
    case Unary::Relu: Run<Kernel<Relu>>::run(args...); break;
    case Unary::Tanh: Run<Kernel<Tanh>>::run(args...); break;
    case Unary::Exp: Run<Kernel<Exp>>::run(args...); break;
    case Unary::Silu: Run<Kernel<Silu>>::run(args...); break;
    case Unary::Sigmoid: Run<Kernel<Sigmoid>>::run(args...); break;
  }
}

}  // namespace unary

// out = a * x + b * y (y may be null: out = a * x) and out += a * x on one element; x and out may differ in type.
struct Axpby {
  template <class T>
  static JNNTILE_HD void apply(int64_t i, float a, const T* x, float b, const T* y, T* out) {
    out[i] = from_float<T>(y == nullptr ? a * to_float(x[i]) : a * to_float(x[i]) + b * to_float(y[i]));
  }
};
// With `overwrite`, out = a * x: out holds nothing yet (a gradient whose zero-fill this replaces).
struct Accumulate {
  template <class S, class T>
  static JNNTILE_HD void apply(int64_t i, float a, bool overwrite, const S* x, T* out) {
    out[i] = from_float<T>((overwrite ? 0.0f : to_float(out[i])) + a * to_float(x[i]));
  }
};

// Tiles of `type` (x, y, dy, dx and out alike, but for accumulate's source).
template <Device D> void unary_forward(Unary op, FloatType type, int64_t n, const void* x, void* y);
// dx += dy * f'(x)  (dx = dy * f'(x) with `overwrite`)
template <Device D>
void unary_backward(Unary op, FloatType type, int64_t n, bool overwrite, const void* x, const void* dy, void* dx);
// out = a * x + b * y   (y may be null: out = a * x)
template <Device D> void axpby(FloatType type, int64_t n, float a, const void* x, float b, const void* y, void* out);
// out += a * x (out = a * x with `overwrite`), x of x_type, out of out_type
template <Device D>
void accumulate(FloatType x_type, FloatType out_type, int64_t n, float a, bool overwrite, const void* x, void* out);

}  // namespace jnntile
