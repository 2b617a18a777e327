#include "kernels/loss.h"

namespace jnntile {

template <>
void cross_entropy_stats<Device::Cpu>(bool first, int64_t rows, int64_t nv, int64_t v0, const float* logits,
                                      const int32_t* targets, double* stats) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * nv;
    cross_entropy::Row row = cross_entropy::load(first, stats + r * kCrossEntropyStats);
    double m = cross_entropy::new_max(row, cross_entropy::strided_max(x, 0, nv, 1));
    cross_entropy::add_tile(row, m, cross_entropy::strided_sum_exp(x, 0, nv, 1, float(m)));
    int64_t t = cross_entropy::target_column(targets[r], v0, nv);
    if (t >= 0) row.target = x[t];
    cross_entropy::store(row, stats + r * kCrossEntropyStats);
  }
}

template <>
void cross_entropy_finish<Device::Cpu>(int64_t rows, const double* stats, const int32_t* targets,
                                       int32_t ignore_index, float* lse, double* partial) {
  double sum = 0.0, count = 0.0;
  for (int64_t r = 0; r < rows; ++r) cross_entropy::finish_row(r, stats, targets, ignore_index, lse, sum, count);
  partial[0] = sum;
  partial[1] = count;
}

template <>
void cross_entropy_combine<Device::Cpu>(int64_t count, const double* const* partials, float* loss, float* inv_count,
                                        void*) {
  cross_entropy::mean(count, partials, loss, inv_count);
}

template <>
void cross_entropy_backward<Device::Cpu>(int64_t rows, int64_t nv, int64_t v0, const float* logits,
                                         const int32_t* targets, const float* lse, int32_t ignore_index,
                                         const float* inv_count, const float* dloss, float* dlogits) {
  float scale = cross_entropy::grad_scale(inv_count, dloss);
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    int64_t t = cross_entropy::target_column(targets[r], v0, nv);
    cross_entropy::strided_grad(logits + r * nv, lse[r], scale, t, 0, nv, 1, dlogits + r * nv);
  }
}

}  // namespace jnntile
