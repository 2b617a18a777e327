#include "kernels/layernorm.h"

#include <vector>

namespace jnntile {

template <>
void layernorm_partial<Device::Cpu>(int64_t rows, int64_t n, bool centered, const float* x, double* partial) {
  for (int64_t r = 0; r < rows; ++r) {
    layernorm::Moments m = layernorm::strided_moments(x + r * n, 0, n, 1, centered);
    partial[2 * r] = m.mean;
    partial[2 * r + 1] = m.m2;
  }
}

template <>
void layernorm_stats<Device::Cpu>(int64_t rows, int64_t count, const double* const* partials, int64_t tile_c,
                                  int64_t c, double eps, float* stats, void*) {
  for (int64_t r = 0; r < rows; ++r) layernorm::row_stats(r, count, partials, tile_c, c, eps, stats);
}

template <>
void layernorm_normalize<Device::Cpu>(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                                      const float* b, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    for (int64_t j = 0; j < n; ++j) y[r * n + j] = layernorm::y(x[r * n + j], mean, rstd, w[j], b, j);
  }
}

template <>
void layernorm_backward_partial<Device::Cpu>(int64_t rows, int64_t n, const float* x, const float* stats,
                                             const float* w, const float* dy, double* partial) {
  for (int64_t r = 0; r < rows; ++r) {
    layernorm::GradSums s =
        layernorm::strided_grad_sums(x + r * n, dy + r * n, w, stats[2 * r], stats[2 * r + 1], 0, n, 1);
    partial[2 * r] = s.g;
    partial[2 * r + 1] = s.gx;
  }
}

template <>
void layernorm_backward_combine<Device::Cpu>(int64_t rows, int64_t count, const double* const* partials, double* sums,
                                             void*) {
  for (int64_t i = 0; i < 2 * rows; ++i) sums[i] = layernorm::sum_partials(count, partials, i);
}

template <>
void layernorm_backward_dx<Device::Cpu>(int64_t rows, int64_t n, int64_t c, bool centered, const float* x,
                                        const float* stats, const float* w, const float* dy, const double* sums,
                                        float* dx) {
  for (int64_t r = 0; r < rows; ++r) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    float mean_g = centered ? float(sums[2 * r] / double(c)) : 0.0f, mean_gx = float(sums[2 * r + 1] / double(c));
    for (int64_t j = 0; j < n; ++j)
      dx[r * n + j] += layernorm::dx(x[r * n + j], dy[r * n + j], w[j], mean, rstd, mean_g, mean_gx);
  }
}

// Rows outer, columns inner: the tile is read once, in memory order; each
// column still sums its rows in order, as the GPU's thread per column does.
template <>
void layernorm_backward_params<Device::Cpu>(int64_t rows, int64_t n, const float* x, const float* stats,
                                            const float* dy, float* dw, float* db) {
  std::vector<double> sum_dw(n, 0.0), sum_db(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    for (int64_t j = 0; j < n; ++j)
      layernorm::add_param_terms(x[r * n + j], dy[r * n + j], mean, rstd, sum_dw[j], sum_db[j]);
  }
  for (int64_t j = 0; j < n; ++j) {
    if (dw) dw[j] += float(sum_dw[j]);
    if (db) db[j] += float(sum_db[j]);
  }
}

}  // namespace jnntile
