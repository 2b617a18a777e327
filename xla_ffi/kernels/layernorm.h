// Layer normalization and RMS normalization over the last axis: the arithmetic
// of one row and one element, and the family's entry points.
//
// RMS normalization (Llama's RMSNorm) is the uncentered case: the mean is taken
// as 0, so M2 is the sum of squares, rstd = 1 / sqrt(mean(x^2) + eps), there is
// no bias, and the dx term loses its mean(g). Every entry point takes
// `centered` (true: layer norm).
//
// The normalized axis C may be split into several tiles, so per-row statistics
// are built from per-tile partials (in double) and combined. In every kernel a
// tile is (rows, n): `rows` rows of x, each with the `n` columns of this C tile.
// stats: (rows, 2) float, per row (mean, rstd) with rstd = 1 / sqrt(var + eps).
// x, y, dy and dx are tiles of `type` (float32 or bfloat16), loaded into float; w, b, their gradients and
// stats are float32.
// Row sums take the elements begin, begin + stride, ... below n of a row: a GPU
// lane every 32nd element, and the lanes' results merge like those of C tiles.
// The CPU sums a whole row in running sums of its own (cpu/layernorm.cc, lanes.h).
#pragma once
#include <math.h>

#include "kernels/device.h"

namespace jnntile {
namespace layernorm {

// Count, mean and M2 (sum of squared deviations from the mean) of some values:
// they merge without cancellation (Chan et al.), unlike sums of squares.
struct Moments {
  double count = 0.0, mean = 0.0, m2 = 0.0;
};

// Two passes in double: the mean, then the squared deviations from it.
// Uncentered: the mean is 0 and one pass sums the squares.
template <class T>
JNNTILE_HD Moments strided_moments(const T* x, int64_t begin, int64_t n, int64_t stride, bool centered) {
  Moments m;
  double sum = 0.0;
  for (int64_t j = begin; j < n; j += stride) {
    sum += to_float(x[j]);
    m.count += 1.0;
  }
  if (m.count == 0.0) return m;
  m.mean = centered ? sum / m.count : 0.0;
  for (int64_t j = begin; j < n; j += stride) {
    double d = to_float(x[j]) - m.mean;
    m.m2 += d * d;
  }
  return m;
}

// The moments of the union of two sets of values; an empty set changes nothing.
JNNTILE_HD Moments merge(Moments a, Moments b) {
  double count = a.count + b.count;
  if (count == 0.0) return a;
  double delta = b.mean - a.mean, f = b.count / count;
  return Moments{count, a.mean + delta * f, a.m2 + b.m2 + delta * delta * a.count * f};
}

// Row r of stats from the partials (mean, M2) of `count` C tiles of width
// tile_c (the last one what is left of c), merged in tile order.
JNNTILE_HD void row_stats(int64_t r, int64_t count, const double* const* partials, int64_t tile_c, int64_t c,
                          double eps, float* stats) {
  Moments total;
  for (int64_t k = 0; k < count; ++k) {
    int64_t width = c - k * tile_c < tile_c ? c - k * tile_c : tile_c;
    total = merge(total, Moments{double(width), partials[k][2 * r], partials[k][2 * r + 1]});
  }
  stats[2 * r] = float(total.mean);
  stats[2 * r + 1] = float(1.0 / sqrt(total.m2 / total.count + eps));
}

JNNTILE_HD float xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

// b is null for RMS normalization (no bias).
JNNTILE_HD float y(float x, float mean, float rstd, float w, const float* b, int64_t j) {
  return b ? xhat(x, mean, rstd) * w + b[j] : xhat(x, mean, rstd) * w;
}

// Per row of the backward, with g = dy * w: the sums of g and of g * xhat.
struct GradSums {
  double g = 0.0, gx = 0.0;
  // One element's terms.
  JNNTILE_HD void add_element(float x, float dy, float w, float mean, float rstd) {
    const float gj = dy * w;
    g += gj;
    gx += double(gj) * xhat(x, mean, rstd);
  }
};

template <class T>
JNNTILE_HD GradSums strided_grad_sums(const T* x, const T* dy, const float* w, float mean, float rstd, int64_t begin,
                                      int64_t n, int64_t stride) {
  GradSums s;
  for (int64_t j = begin; j < n; j += stride) s.add_element(to_float(x[j]), to_float(dy[j]), w[j], mean, rstd);
  return s;
}

JNNTILE_HD GradSums add(GradSums a, GradSums b) { return GradSums{a.g + b.g, a.gx + b.gx}; }

// Element i of the sum of `count` partials, in partial order.
JNNTILE_HD double sum_partials(int64_t count, const double* const* partials, int64_t i) {
  double sum = 0.0;
  for (int64_t k = 0; k < count; ++k) sum += partials[k][i];
  return sum;
}

// The dx term of one element: rstd * (g - mean(g) - xhat * mean(g * xhat)); mean_g is 0 for RMS
// normalization, whose output does not depend on a mean.
JNNTILE_HD float dx(float x, float dy, float w, float mean, float rstd, float mean_g, float mean_gx) {
  return rstd * (dy * w - mean_g - xhat(x, mean, rstd) * mean_gx);
}

// One element's terms of the parameter gradients: dw gets dy * xhat, db gets dy.
JNNTILE_HD void add_param_terms(float x, float dy, float mean, float rstd, double& sum_dw, double& sum_db) {
  sum_dw += double(dy) * xhat(x, mean, rstd);
  sum_db += dy;
}

}  // namespace layernorm

// partial: (rows, 2) per row the tile's (mean, M2).
template <Device D>
void layernorm_partial(FloatType type, int64_t rows, int64_t n, bool centered, const void* x, double* partial);

// stats from the partials of `count` C tiles of width tile_c (the last one
// what is left of c). scratch: `count` pointers (GPU, see cuda::device_pointers).
template <Device D>
void layernorm_stats(int64_t rows, int64_t count, const double* const* partials, int64_t tile_c, int64_t c,
                     double eps, float* stats, void* scratch);

// y = (x - mean) * rstd * w + b;  w, b: (n,), b null for RMS normalization
template <Device D>
void layernorm_normalize(FloatType type, int64_t rows, int64_t n, const void* x, const float* stats, const float* w,
                         const float* b, void* y);

// partial: (rows, 2) per row the tile's layernorm::GradSums (g, gx).
template <Device D>
void layernorm_backward_partial(FloatType type, int64_t rows, int64_t n, const void* x, const float* stats,
                                const float* w, const void* dy, double* partial);

// sums: (rows, 2) the sums of the `count` partials. scratch: `count` pointers (GPU).
template <Device D>
void layernorm_backward_combine(int64_t rows, int64_t count, const double* const* partials, double* sums,
                                void* scratch);

// dx += layernorm::dx(...) with the means of sums over `c`, the whole normalized axis (mean(g) only where
// centered).
template <Device D>
void layernorm_backward_dx(FloatType type, int64_t rows, int64_t n, int64_t c, bool centered, const void* x,
                           const float* stats, const float* w, const void* dy, const double* sums, void* dx);

// The dx of rows whose whole normalized axis is this tile (n = C): the partial sums into `partial` ((rows, 2),
// scratch), then dx as layernorm_backward_dx. A GPU does both in one pass over rows of up to 1024 elements.
template <Device D>
void layernorm_backward_rows(FloatType type, int64_t rows, int64_t n, bool centered, const void* x,
                             const float* stats, const float* w, const void* dy, double* partial, void* dx);

// dw += sum over rows of dy * xhat, db += sum over rows of dy (either may be
// null; = instead of += with `overwrite`: they hold nothing yet), each column
// summed in double over the rows in order.
template <Device D>
void layernorm_backward_params(FloatType type, int64_t rows, int64_t n, bool overwrite, const void* x,
                               const float* stats, const void* dy, float* dw, float* db);

}  // namespace jnntile
