#include "kernels/bias.h"

#include <vector>

namespace jnntile {

template <>
void add_bias<Device::Cpu>(FloatType type, int64_t rows, int64_t n, const void* x, const float* b, void* out) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T* xt = static_cast<const T*>(x);
    T* ot = static_cast<T*>(out);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) ot[r * n + j] = from_float<T>(to_float(xt[r * n + j]) + b[j]);
  });
}

// Rows in the outer loop: the CPU reads dy in memory order.
template <>
void bias_grad<Device::Cpu>(FloatType type, int64_t rows, int64_t n, bool overwrite, const void* dy, float* db) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T* d = static_cast<const T*>(dy);
    std::vector<double> sum(n, 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) sum[j] += to_float(d[r * n + j]);
    for (int64_t j = 0; j < n; ++j) db[j] = (overwrite ? 0.0f : db[j]) + float(sum[j]);
  });
}

}  // namespace jnntile
