#include "kernels/bias.h"

#include <vector>

namespace jnntile {

template <>
void add_bias<Device::Cpu>(int64_t rows, int64_t n, const float* x, const float* b, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) out[r * n + j] = x[r * n + j] + b[j];
}

// Rows in the outer loop: the CPU reads dy in memory order.
template <>
void bias_grad<Device::Cpu>(int64_t rows, int64_t n, const float* dy, float* db) {
  std::vector<double> sum(n, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) sum[j] += dy[r * n + j];
  for (int64_t j = 0; j < n; ++j) db[j] += float(sum[j]);
}

}  // namespace jnntile
