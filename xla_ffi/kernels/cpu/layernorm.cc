#include "kernels/cpu/layernorm.h"

#include <cmath>
#include <vector>

namespace jnntile::cpu {

void layernorm_partial(int64_t rows, int64_t n, const float* x, double* partial) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += row[j];
    double mean = sum / double(n), m2 = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      double d = row[j] - mean;
      m2 += d * d;
    }
    partial[2 * r] = mean;
    partial[2 * r + 1] = m2;
  }
}

void layernorm_stats(int64_t rows, int64_t count, const double* const* partials, const int64_t* widths, double eps,
                     float* stats) {
  int64_t c = 0;
  for (int64_t k = 0; k < count; ++k) c += widths[k];
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0.0;
    for (int64_t k = 0; k < count; ++k) mean += double(widths[k]) * partials[k][2 * r];
    mean /= double(c);
    double m2 = 0.0;
    for (int64_t k = 0; k < count; ++k) {
      double d = partials[k][2 * r] - mean;
      m2 += partials[k][2 * r + 1] + double(widths[k]) * d * d;
    }
    stats[2 * r] = float(mean);
    stats[2 * r + 1] = float(1.0 / std::sqrt(m2 / double(c) + eps));
  }
}

void layernorm_normalize(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                         const float* b, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    for (int64_t j = 0; j < n; ++j) y[r * n + j] = (x[r * n + j] - mean) * rstd * w[j] + b[j];
  }
}

void layernorm_backward_partial(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                                const float* dy, double* partial) {
  for (int64_t r = 0; r < rows; ++r) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      float g = dy[r * n + j] * w[j];
      float xhat = (x[r * n + j] - mean) * rstd;
      sum_g += g;
      sum_gx += double(g) * xhat;
    }
    partial[2 * r] = sum_g;
    partial[2 * r + 1] = sum_gx;
  }
}

void layernorm_backward_combine(int64_t rows, int64_t count, const double* const* partials, double* sums) {
  for (int64_t i = 0; i < 2 * rows; ++i) {
    double sum = 0.0;
    for (int64_t k = 0; k < count; ++k) sum += partials[k][i];
    sums[i] = sum;
  }
}

void layernorm_backward_dx(int64_t rows, int64_t n, int64_t c, const float* x, const float* stats, const float* w,
                           const float* dy, const double* sums, float* dx) {
  for (int64_t r = 0; r < rows; ++r) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    float mean_g = float(sums[2 * r] / double(c)), mean_gx = float(sums[2 * r + 1] / double(c));
    for (int64_t j = 0; j < n; ++j) {
      float g = dy[r * n + j] * w[j];
      float xhat = (x[r * n + j] - mean) * rstd;
      dx[r * n + j] += rstd * (g - mean_g - xhat * mean_gx);
    }
  }
}

void layernorm_backward_params(int64_t rows, int64_t n, const float* x, const float* stats, const float* dy,
                               float* dw, float* db) {
  std::vector<double> sum_dw(n, 0.0), sum_db(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    for (int64_t j = 0; j < n; ++j) {
      float d = dy[r * n + j];
      sum_dw[j] += double(d) * ((x[r * n + j] - mean) * rstd);
      sum_db[j] += d;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    if (dw) dw[j] += float(sum_dw[j]);
    if (db) db[j] += float(sum_db[j]);
  }
}

}  // namespace jnntile::cpu
