#include "kernels/elementwise.h"

#include "kernels/cpu/chunks.h"

namespace jnntile {
namespace {

// Applies Kernel::apply to every element index; with bfloat16 tiles, through float chunks (chunks.h).
template <class Kernel>
struct Loop {
  template <class... Args>
  static void run(int64_t n, Args... args) {
    for_float_chunks(
        n,
        [](int64_t, int64_t len, auto... chunk) {
          for (int64_t i = 0; i < len; ++i) Kernel::apply(i, chunk...);
        },
        args...);
  }
};

}  // namespace

template <>
void unary_forward<Device::Cpu>(Unary op, FloatType type, int64_t n, const void* x, void* y) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    unary::dispatch<Loop, unary::Forward>(op, n, static_cast<const T*>(x), static_cast<T*>(y));
  });
}

template <>
void unary_backward<Device::Cpu>(Unary op, FloatType type, int64_t n, bool overwrite, const void* x, const void* dy,
                                 void* dx) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    visit_flag(overwrite, [&](auto flag) {
      unary::dispatch<Loop, unary::Backward>(op, n, flag, static_cast<const T*>(x), static_cast<const T*>(dy),
                                             static_cast<T*>(dx));
    });
  });
}

template <>
void axpby<Device::Cpu>(FloatType type, int64_t n, float a, const void* x, float b, const void* y, void* out) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    Loop<Axpby>::run(n, a, static_cast<const T*>(x), b, static_cast<const T*>(y), static_cast<T*>(out));
  });
}

template <>
void accumulate<Device::Cpu>(FloatType x_type, FloatType out_type, int64_t n, float a, bool overwrite, const void* x,
                               void* out) {
  visit_float(x_type, [&](auto xt) {
    visit_float(out_type, [&](auto ot) {
      Loop<Accumulate>::run(n, a, overwrite, static_cast<const decltype(xt)*>(x), static_cast<decltype(ot)*>(out));
    });
  });
}

}  // namespace jnntile
