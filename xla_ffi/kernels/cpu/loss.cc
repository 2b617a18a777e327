#include "kernels/cpu/loss.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace jnntile::cpu {

void cross_entropy_stats(bool first, int64_t rows, int64_t nv, int64_t v0, const float* logits,
                         const int32_t* targets, double* stats) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * nv;
    double* st = stats + r * kCrossEntropyStats;
    if (first) {
      st[0] = -std::numeric_limits<double>::infinity();
      st[1] = 0.0;
      st[2] = 0.0;
    }
    float tile_max = x[0];
    for (int64_t c = 1; c < nv; ++c) tile_max = std::max(tile_max, x[c]);
    double m = std::max(st[0], double(tile_max));
    // Rescale the running sum to the new max, then add this tile's terms.
    double s = st[1] * std::exp(st[0] - m);
    float mf = float(m);
    for (int64_t c = 0; c < nv; ++c) s += double(std::exp(x[c] - mf));
    st[0] = m;
    st[1] = s;
    int64_t t = int64_t(targets[r]) - v0;
    if (t >= 0 && t < nv) st[2] = x[t];
  }
}

void cross_entropy_finish(int64_t rows, const double* stats, const int32_t* targets, int32_t ignore_index,
                          float* lse, double* partial) {
  double sum = 0.0, count = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* st = stats + r * kCrossEntropyStats;
    double row_lse = st[0] + std::log(st[1]);
    lse[r] = float(row_lse);
    if (targets[r] == ignore_index) continue;
    sum += row_lse - st[2];
    count += 1.0;
  }
  partial[0] = sum;
  partial[1] = count;
}

void cross_entropy_backward(int64_t rows, int64_t nv, int64_t v0, const float* logits, const int32_t* targets,
                            const float* lse, int32_t ignore_index, float scale, float* dlogits) {
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    const float* x = logits + r * nv;
    float* dx = dlogits + r * nv;
    for (int64_t c = 0; c < nv; ++c) dx[c] += scale * std::exp(x[c] - lse[r]);
    int64_t t = int64_t(targets[r]) - v0;
    if (t >= 0 && t < nv) dx[t] -= scale;
  }
}

}  // namespace jnntile::cpu
