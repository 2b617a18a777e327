#include "kernels/layernorm.h"

#include <vector>

#include "kernels/cpu/chunks.h"
#include "kernels/cpu/lanes.h"

namespace jnntile {
namespace {

// A whole row's moments and gradient sums (layernorm.h's strided_* for the row), each sum in lanes: one
// running sum per row waited on every addition (layer norm's partials were 2 ns per element).
template <class T>
layernorm::Moments row_moments(const T* x, int64_t n, bool centered) {
  layernorm::Moments m;
  if (n == 0) return m;
  m.count = double(n);
  m.mean = centered ? lane_sum(n, [&](int64_t j) { return double(to_float(x[j])); }) / m.count : 0.0;
  m.m2 = lane_sum(n, [&](int64_t j) {
    double d = to_float(x[j]) - m.mean;
    return d * d;
  });
  return m;
}

template <class T>
layernorm::GradSums row_grad_sums(const T* x, const T* dy, const float* w, float mean, float rstd, int64_t n) {
  auto g = [&](int64_t j) { return to_float(dy[j]) * w[j]; };
  return layernorm::GradSums{
      lane_sum(n, [&](int64_t j) { return double(g(j)); }),
      lane_sum(n, [&](int64_t j) { return double(g(j)) * layernorm::xhat(to_float(x[j]), mean, rstd); })};
}

}  // namespace

template <>
void layernorm_partial<Device::Cpu>(FloatType type, int64_t rows, int64_t n, bool centered, const void* x,
                                    double* partial) {
  visit_float(type, [&](auto t) {
    const auto* xt = static_cast<const decltype(t)*>(x);
    for (int64_t r = 0; r < rows; ++r) {
      layernorm::Moments m = row_moments(xt + r * n, n, centered);
      partial[2 * r] = m.mean;
      partial[2 * r + 1] = m.m2;
    }
  });
}

template <>
void layernorm_stats<Device::Cpu>(int64_t rows, int64_t count, const double* const* partials, int64_t tile_c,
                                  int64_t c, double eps, float* stats, void*) {
  for (int64_t r = 0; r < rows; ++r) layernorm::row_stats(r, count, partials, tile_c, c, eps, stats);
}

template <>
void layernorm_normalize<Device::Cpu>(FloatType type, int64_t rows, int64_t n, const void* x, const float* stats,
                                      const float* w, const float* b, void* y) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T* xt = static_cast<const T*>(x);
    T* yt = static_cast<T*>(y);
    for (int64_t r = 0; r < rows; ++r) {
      float mean = stats[2 * r], rstd = stats[2 * r + 1];
      for_float_chunks(
          n,
          [&](int64_t begin, int64_t len, auto x_row, auto y_row) {
            for (int64_t j = begin; j < begin + len; ++j)
              y_row[j - begin] = layernorm::y(x_row[j - begin], mean, rstd, w[j], b, j);
          },
          xt + r * n, yt + r * n);
    }
  });
}

template <>
void layernorm_backward_partial<Device::Cpu>(FloatType type, int64_t rows, int64_t n, const void* x,
                                             const float* stats, const float* w, const void* dy, double* partial) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T *xt = static_cast<const T*>(x), *dyt = static_cast<const T*>(dy);
    for (int64_t r = 0; r < rows; ++r) {
      layernorm::GradSums s = row_grad_sums(xt + r * n, dyt + r * n, w, stats[2 * r], stats[2 * r + 1], n);
      partial[2 * r] = s.g;
      partial[2 * r + 1] = s.gx;
    }
  });
}

template <>
void layernorm_backward_combine<Device::Cpu>(int64_t rows, int64_t count, const double* const* partials, double* sums,
                                             void*) {
  for (int64_t i = 0; i < 2 * rows; ++i) sums[i] = layernorm::sum_partials(count, partials, i);
}

template <>
void layernorm_backward_dx<Device::Cpu>(FloatType type, int64_t rows, int64_t n, int64_t c, bool centered,
                                        const void* x, const float* stats, const float* w, const void* dy,
                                        const double* sums, void* dx) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T *xt = static_cast<const T*>(x), *dyt = static_cast<const T*>(dy);
    T* dxt = static_cast<T*>(dx);
    for (int64_t r = 0; r < rows; ++r) {
      float mean = stats[2 * r], rstd = stats[2 * r + 1];
      float mean_g = centered ? float(sums[2 * r] / double(c)) : 0.0f, mean_gx = float(sums[2 * r + 1] / double(c));
      for_float_chunks(
          n,
          [&](int64_t begin, int64_t len, auto x_row, auto dy_row, auto dx_row) {
            for (int64_t j = begin; j < begin + len; ++j) {
              const int64_t k = j - begin;
              dx_row[k] += layernorm::dx(x_row[k], dy_row[k], w[j], mean, rstd, mean_g, mean_gx);
            }
          },
          xt + r * n, dyt + r * n, dxt + r * n);
    }
  });
}

template <>
void layernorm_backward_rows<Device::Cpu>(FloatType type, int64_t rows, int64_t n, bool centered, const void* x,
                                          const float* stats, const float* w, const void* dy, double* partial,
                                          void* dx) {
  layernorm_backward_partial<Device::Cpu>(type, rows, n, x, stats, w, dy, partial);
  layernorm_backward_dx<Device::Cpu>(type, rows, n, n, centered, x, stats, w, dy, partial, dx);
}

// Rows outer, columns inner: the tile is read once, in memory order; each
// column still sums its rows in order, as the GPU's thread per column does.
template <>
void layernorm_backward_params<Device::Cpu>(FloatType type, int64_t rows, int64_t n, bool overwrite, const void* x,
                                            const float* stats, const void* dy, float* dw, float* db) {
  std::vector<double> sum_dw(n, 0.0), sum_db(n, 0.0);
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T *xt = static_cast<const T*>(x), *dyt = static_cast<const T*>(dy);
    for (int64_t r = 0; r < rows; ++r) {
      float mean = stats[2 * r], rstd = stats[2 * r + 1];
      for (int64_t j = 0; j < n; ++j)
        layernorm::add_param_terms(to_float(xt[r * n + j]), to_float(dyt[r * n + j]), mean, rstd, sum_dw[j],
                                   sum_db[j]);
    }
  });
  for (int64_t j = 0; j < n; ++j) {
    if (dw) dw[j] = (overwrite ? 0.0f : dw[j]) + float(sum_dw[j]);
    if (db) db[j] = (overwrite ? 0.0f : db[j]) + float(sum_db[j]);
  }
}

}  // namespace jnntile
