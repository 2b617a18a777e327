#include "kernels/elementwise.h"

namespace jnntile {
namespace {

// Applies Kernel::apply to every element index.
template <class Kernel>
struct Loop {
  template <class... Args>
  static void run(int64_t n, Args... args) {
    for (int64_t i = 0; i < n; ++i) Kernel::apply(i, args...);
  }
};

}  // namespace

template <>
void unary_forward<Device::Cpu>(Unary op, int64_t n, const float* x, float* y) {
  unary::dispatch<Loop, unary::Forward>(op, n, x, y);
}

template <>
void unary_backward<Device::Cpu>(Unary op, int64_t n, const float* x, const float* dy, float* dx) {
  unary::dispatch<Loop, unary::Backward>(op, n, x, dy, dx);
}

template <>
void axpby<Device::Cpu>(int64_t n, float a, const float* x, float b, const float* y, float* out) {
  if (y == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = a * x[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = axpby_element(a, x[i], b, y[i]);
  }
}

template <>
void accumulate<Device::Cpu>(int64_t n, float a, const float* x, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] += a * x[i];
}

}  // namespace jnntile
