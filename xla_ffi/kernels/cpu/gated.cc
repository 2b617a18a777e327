#include "kernels/gated.h"

namespace jnntile {

template <>
void swiglu_forward<Device::Cpu>(FloatType type, int64_t n, const void* gate, const void* up, void* y) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    const T *g = static_cast<const T*>(gate), *u = static_cast<const T*>(up);
    T* out = static_cast<T*>(y);
    for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(gated::forward(to_float(g[i]), to_float(u[i])));
  });
}

template <>
void swiglu_backward<Device::Cpu>(FloatType type, int64_t n, bool overwrite, const void* gate, const void* up,
                                  const void* dy, void* dgate, void* dup) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    const T *g = static_cast<const T*>(gate), *u = static_cast<const T*>(up), *d = static_cast<const T*>(dy);
    T *dg = static_cast<T*>(dgate), *du = static_cast<T*>(dup);
    visit_flag(overwrite, [&](auto flag) {
      for (int64_t i = 0; i < n; ++i) {
        float dg_i = flag ? 0.0f : to_float(dg[i]), du_i = flag ? 0.0f : to_float(du[i]);
        gated::backward(to_float(g[i]), to_float(u[i]), to_float(d[i]), dg_i, du_i);
        dg[i] = from_float<T>(dg_i);
        du[i] = from_float<T>(du_i);
      }
    });
  });
}

}  // namespace jnntile
