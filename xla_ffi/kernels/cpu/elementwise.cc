#include "kernels/cpu/elementwise.h"

#include <cmath>

namespace jnntile::cpu {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// Each function: value f(x) and derivative f'(x).
struct GeluTanh {
  static float f(float x) {
    float t = std::tanh(kSqrt2OverPi * (x + kGeluCoeff * x * x * x));
    return 0.5f * x * (1.0f + t);
  }
  static float df(float x) {
    float t = std::tanh(kSqrt2OverPi * (x + kGeluCoeff * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x * x);
  }
};
struct Relu {
  static float f(float x) { return x > 0.0f ? x : 0.0f; }
  static float df(float x) { return x > 0.0f ? 1.0f : 0.0f; }
};
struct Tanh {
  static float f(float x) { return std::tanh(x); }
  static float df(float x) { float t = std::tanh(x); return 1.0f - t * t; }
};
struct Exp {
  static float f(float x) { return std::exp(x); }
  static float df(float x) { return std::exp(x); }
};
struct Sigmoid {
  static float f(float x) { return 1.0f / (1.0f + std::exp(-x)); }
  static float df(float x) { float s = f(x); return s * (1.0f - s); }
};
struct Silu {
  static float f(float x) { return x * Sigmoid::f(x); }
  static float df(float x) { float s = Sigmoid::f(x); return s * (1.0f + x * (1.0f - s)); }
};

template <class F>
struct Forward {
  static void run(int64_t n, const float* x, float* y) {
    for (int64_t i = 0; i < n; ++i) y[i] = F::f(x[i]);
  }
};

template <class F>
struct Backward {
  static void run(int64_t n, const float* x, const float* dy, float* dx) {
    for (int64_t i = 0; i < n; ++i) dx[i] += dy[i] * F::df(x[i]);
  }
};

// Runs Kernel<Function>::run(args...) for the function named by `op`.
template <template <class> class Kernel, class... Args>
void dispatch(Unary op, Args... args) {
  switch (op) {
    case Unary::GeluTanh: Kernel<GeluTanh>::run(args...); break;
    case Unary::Relu: Kernel<Relu>::run(args...); break;
    case Unary::Tanh: Kernel<Tanh>::run(args...); break;
    case Unary::Exp: Kernel<Exp>::run(args...); break;
    case Unary::Silu: Kernel<Silu>::run(args...); break;
    case Unary::Sigmoid: Kernel<Sigmoid>::run(args...); break;
  }
}

}  // namespace

void unary_forward(Unary op, int64_t n, const float* x, float* y) { dispatch<Forward>(op, n, x, y); }

void unary_backward(Unary op, int64_t n, const float* x, const float* dy, float* dx) {
  dispatch<Backward>(op, n, x, dy, dx);
}

void axpby(int64_t n, float a, const float* x, float b, const float* y, float* out) {
  if (y == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = a * x[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = a * x[i] + b * y[i];
  }
}

void accumulate(int64_t n, float a, const float* x, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] += a * x[i];
}

}  // namespace jnntile::cpu
