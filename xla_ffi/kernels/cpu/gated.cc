#include "kernels/gated.h"

namespace jnntile {

template <>
void swiglu_forward<Device::Cpu>(int64_t n, const float* gate, const float* up, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = gated::forward(gate[i], up[i]);
}

template <>
void swiglu_backward<Device::Cpu>(int64_t n, const float* gate, const float* up, const float* dy, float* dgate,
                                  float* dup) {
  for (int64_t i = 0; i < n; ++i) gated::backward(gate[i], up[i], dy[i], dgate[i], dup[i]);
}

}  // namespace jnntile
