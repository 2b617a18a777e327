// Cross-entropy fused with softmax over a vocabulary axis that may be tiled:
// the arithmetic of one row and one element, and the family's entry points.
//
// A logits tile is (rows, nv): rows = tb * tt tokens, nv vocabulary entries
// starting at v0. Per row the forward keeps stats (m, s, z): the running max,
// the sum of exp(x - m) and the logit of the target (0 until the vocabulary
// tile that holds the target is seen). A tile updates them in two passes: its
// max gives the new m, then its terms exp(x - m) are added. Row sums take the
// elements begin, begin + stride, ... below nv of a row: the CPU a whole row
// (0, nv, 1), a GPU lane every 32nd element. Logits and their gradient are tiles
// of `type` (float32 or bfloat16), loaded into float; stats, lse and the loss are
// float32 or double.
#pragma once
#include <math.h>

#include "kernels/device.h"
#include "kernels/math.h"
#include "kernels/reduce.h"

namespace jnntile {

constexpr int kCrossEntropyStats = 3;  // m, s, z per row

namespace cross_entropy {

struct Row {
  double max, sum, target;
};

// A row's stats; `first`: the stats tile was never written (first vocabulary tile).
JNNTILE_HD Row load(bool first, const double* stats) {
  return first ? Row{-INFINITY, 0.0, 0.0} : Row{stats[0], stats[1], stats[2]};
}

JNNTILE_HD void store(const Row& row, double* stats) {
  stats[0] = row.max;
  stats[1] = row.sum;
  stats[2] = row.target;
}

template <class T>
JNNTILE_HD float strided_max(const T* x, int64_t begin, int64_t n, int64_t stride) {
  float m = -INFINITY;
  for (int64_t j = begin; j < n; j += stride) m = fmaxf(m, to_float(x[j]));
  return m;
}

// The sum in double of the float terms exp(x - max).
template <class T>
JNNTILE_HD double strided_sum_exp(const T* x, int64_t begin, int64_t n, int64_t stride, float max) {
  double s = 0.0;
  for (int64_t j = begin; j < n; j += stride) s += double(exp_approx(to_float(x[j]) - max));
  return s;
}

// The row's running max after a tile whose largest logit is tile_max.
JNNTILE_HD double new_max(const Row& row, float tile_max) { return fmax(row.max, double(tile_max)); }

// Adds a tile's sum of exp(x - m), m = new_max(row, ...), rescaling the row's sum to m.
JNNTILE_HD void add_tile(Row& row, double m, double tile_sum) {
  row.sum = row.sum * exp(row.max - m) + tile_sum;
  row.max = m;
}

// The column of `target` in the vocabulary tile [v0, v0 + nv), or -1.
JNNTILE_HD int64_t target_column(int32_t target, int64_t v0, int64_t nv) {
  int64_t t = int64_t(target) - v0;
  return t >= 0 && t < nv ? t : -1;
}

// Row r of the finish: writes its logsumexp and, unless its target is
// ignore_index, adds its loss (logsumexp - z) to sum and 1 to count.
JNNTILE_HD void finish_row(int64_t r, const double* stats, const int32_t* targets, int32_t ignore_index, float* lse,
                           double& sum, double& count) {
  Row row = load(false, stats + r * kCrossEntropyStats);
  double row_lse = row.max + log(row.sum);
  lse[r] = float(row_lse);
  if (targets[r] == ignore_index) return;
  sum += row_lse - row.target;
  count += 1.0;
}

// loss = sum / count and inv_count = 1 / count from the (sum, count) partials of
// the token tiles, each summed compensated in partial order.
JNNTILE_HD void mean(int64_t count, const double* const* partials, float* loss, float* inv_count) {
  CompensatedSum sum_of_sums, sum_of_counts;
  for (int64_t i = 0; i < count; ++i) {
    sum_of_sums.add(partials[i][0]);
    sum_of_counts.add(partials[i][1]);
  }
  double sum = sum_of_sums.sum, n = sum_of_counts.sum;
  // Every target ignored: the loss is 0 and so is its gradient.
  *loss = n > 0 ? float(sum / n) : 0.0f;
  *inv_count = n > 0 ? float(1.0 / n) : 0.0f;
}

// The backward's factor dloss / count; both are scalars in the device's memory.
JNNTILE_HD float grad_scale(const float* inv_count, const float* dloss) { return *inv_count * *dloss; }

// The backward of a row: dx += scale * (softmax - onehot(t)), t the target's
// column in this tile or -1; dx = ... with Overwrite (dx holds nothing yet; a
// template argument, as a bool tested per element would keep the loop from vectorising).
// The target's element is redone after the loop from the dx it held before: a test of each column against
// t in the loop compared 64-bit indices, 0.9 against 0.7 ns per logit on one core of an AMD EPYC.
// One logit's term added to what dx held (0 where it holds nothing yet): dx + scale * softmax; the target's is
// this less scale.
JNNTILE_HD float grad_term(float dx, float x, float lse, float scale) { return dx + scale * exp_approx(x - lse); }

template <bool Overwrite, class T>
JNNTILE_HD void strided_grad(const T* x, float lse, float scale, int64_t t, int64_t begin, int64_t n, int64_t stride,
                             T* dx) {
  const bool has_target = t >= begin && t < n && (t - begin) % stride == 0;
  const float dx_target = has_target && !Overwrite ? to_float(dx[t]) : 0.0f;
  for (int64_t j = begin; j < n; j += stride)
    dx[j] = from_float<T>(grad_term(Overwrite ? 0.0f : to_float(dx[j]), to_float(x[j]), lse, scale));
  if (has_target) dx[t] = from_float<T>(grad_term(dx_target, to_float(x[t]), lse, scale) - scale);
}

// The backward of a row, its elements begin, begin + stride, ... < n: strided_grad, or for an ignored row
// nothing to add (zeros where dx holds nothing yet).
template <class T>
JNNTILE_HD void strided_row_grad(bool overwrite, bool ignored, const T* x, float lse, float scale, int64_t t,
                                 int64_t begin, int64_t n, int64_t stride, T* dx) {
  if (ignored) {
    if (overwrite)
      for (int64_t j = begin; j < n; j += stride) dx[j] = from_float<T>(0.0f);
  } else if (overwrite) {
    strided_grad<true>(x, lse, scale, t, begin, n, stride, dx);
  } else {
    strided_grad<false>(x, lse, scale, t, begin, n, stride, dx);
  }
}

}  // namespace cross_entropy

// Online max-sum-exp over one vocabulary tile. stats: (rows, 3) double;
// `first` initialises them (the tile's first access is write-only).
template <Device D>
void cross_entropy_stats(FloatType type, bool first, int64_t rows, int64_t nv, int64_t v0, const void* logits,
                         const int32_t* targets, double* stats);
// lse[r] = m + log(s); partial = {sum of lse - z, count} over rows whose
// target != ignore_index.
template <Device D>
void cross_entropy_finish(int64_t rows, const double* stats, const int32_t* targets, int32_t ignore_index,
                          float* lse, double* partial);
// cross_entropy::mean of `count` partials. scratch: `count` pointers (GPU, see cuda::device_pointers).
template <Device D>
void cross_entropy_combine(int64_t count, const double* const* partials, float* loss, float* inv_count,
                           void* scratch);
// dlogits[r, c] += scale * (softmax - onehot(target)) for rows whose target
// != ignore_index (scale = cross_entropy::grad_scale(inv_count, dloss)); ignored rows get nothing. With
// `overwrite` (dlogits holds nothing yet) = instead of +=, and ignored rows get zeros.
template <Device D>
void cross_entropy_backward(FloatType type, int64_t rows, int64_t nv, int64_t v0, bool overwrite,
                            const void* logits, const int32_t* targets, const float* lse, int32_t ignore_index,
                            const float* inv_count, const float* dloss, void* dlogits);

}  // namespace jnntile
