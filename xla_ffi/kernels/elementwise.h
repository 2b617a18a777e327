// Elementwise kernels: unary functions (value and derivative), axpby, accumulate.
// Unary functions are declared once here; the Python list in
// jnntile/ops/elementwise.py uses the same codes.
#pragma once
#include "kernels/device.h"
#include "kernels/math.h"

namespace jnntile {

enum class Unary : int { GeluTanh = 0, Relu = 1, Tanh = 2, Exp = 3, Silu = 4, Sigmoid = 5 };

namespace unary {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// Each function: value f(x) and derivative f'(x).
struct GeluTanh {
  static JNNTILE_HD float f(float x) {
    float t = tanh_approx(kSqrt2OverPi * (x + kGeluCoeff * x * x * x));
    return 0.5f * x * (1.0f + t);
  }
  static JNNTILE_HD float df(float x) {
    float t = tanh_approx(kSqrt2OverPi * (x + kGeluCoeff * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x * x);
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

// y = f(x) and dx += dy * f'(x) on one element.
template <class F>
struct Forward {
  static JNNTILE_HD void apply(int64_t i, const float* x, float* y) { y[i] = F::f(x[i]); }
};
template <class F>
struct Backward {
  static JNNTILE_HD void apply(int64_t i, const float* x, const float* dy, float* dx) { dx[i] += dy[i] * F::df(x[i]); }
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

JNNTILE_HD float axpby_element(float a, float x, float b, float y) { return a * x + b * y; }

template <Device D> void unary_forward(Unary op, int64_t n, const float* x, float* y);
// dx += dy * f'(x)
template <Device D> void unary_backward(Unary op, int64_t n, const float* x, const float* dy, float* dx);
// out = a * x + b * y   (y may be null: out = a * x)
template <Device D> void axpby(int64_t n, float a, const float* x, float b, const float* y, float* out);
// out += a * x
template <Device D> void accumulate(int64_t n, float a, const float* x, float* out);

}  // namespace jnntile
