#include "kernels/loss.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/chunks.h"
#include "kernels/cpu/vectors.h"
#include "kernels/values.h"

namespace jnntile {
namespace {

// A row's max and sum of exponentials in 8-wide vectors (GCC's vector
// extensions): the scalar loops ran a chain of dependent double additions and
// scalar exps, 6 ns per logit. The GPU splits rows over a warp's lanes instead.
using namespace vectors;

Doubles4 widen4(const float* x) {
  Floats4 v;
  std::memcpy(&v, x, sizeof(v));
  return __builtin_convertvector(v, Doubles4);
}

float row_max(const float* x, int64_t n) {
  Floats8 m = Floats8{} - INFINITY;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    Floats8 v = load8(x + j);
    m = v > m ? v : m;
  }
  float out = cross_entropy::strided_max(x, j, n, 1);
  for (int k = 0; k < 8; ++k) out = fmaxf(out, m[k]);
  return out;
}

// The sum in double of the float terms exp(x - max), a chunk of exponentials at a time, in eight running
// sums (element k to sum k % 8) held as two vectors of 4 doubles: as one 8-double vector, wider than AVX2's
// registers, GCC kept the sums on the stack and each addition waited on the last one's store (2.2 ns per
// logit, 1.0 now, on one core of an AMD EPYC).
double row_sum_exp(const float* x, int64_t n, float max) {
  constexpr int64_t kChunk = 512;
  alignas(64) float terms[kChunk];
  Doubles4 low = {}, high = {};
  double tail = 0.0;
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t len = std::min(kChunk, n - begin);
    for (int64_t k = 0; k < len; ++k) terms[k] = exp_approx(x[begin + k] - max);
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) {
      low += widen4(terms + k);
      high += widen4(terms + k + 4);
    }
    for (; k < len; ++k) tail += terms[k];
  }
  for (int k = 0; k < 4; ++k) tail += low[k];
  for (int k = 0; k < 4; ++k) tail += high[k];
  return tail;
}

// Row r of a logits tile as float32: the tile's own row, or a bfloat16 row widened into `row`.
const float* float_row(FloatType type, const void* logits, int64_t r, int64_t nv, std::vector<float>& row) {
  if (type == FloatType::F32) return static_cast<const float*>(logits) + r * nv;
  row.resize(nv);
  convert<Device::Cpu>(nv, type, static_cast<const bfloat16*>(logits) + r * nv, FloatType::F32, row.data());
  return row.data();
}

}  // namespace

template <>
void cross_entropy_stats<Device::Cpu>(FloatType type, bool first, int64_t rows, int64_t nv, int64_t v0,
                                      const void* logits, const int32_t* targets, double* stats) {
  std::vector<float> widened;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = float_row(type, logits, r, nv, widened);
    cross_entropy::Row row = cross_entropy::load(first, stats + r * kCrossEntropyStats);
    double m = cross_entropy::new_max(row, row_max(x, nv));
    cross_entropy::add_tile(row, m, row_sum_exp(x, nv, float(m)));
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
void cross_entropy_backward<Device::Cpu>(FloatType type, int64_t rows, int64_t nv, int64_t v0, bool overwrite,
                                         const void* logits, const int32_t* targets, const float* lse,
                                         int32_t ignore_index, const float* inv_count, const float* dloss,
                                         void* dlogits) {
  float scale = cross_entropy::grad_scale(inv_count, dloss);
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits);
    T* dx = static_cast<T*>(dlogits);
    for (int64_t r = 0; r < rows; ++r) {
      const bool ignored = targets[r] == ignore_index;
      const int64_t t = cross_entropy::target_column(targets[r], v0, nv);
      // bfloat16 rows a chunk at a time in float (chunks.h); t is then a column of the chunk, or none
      for_float_chunks(
          nv,
          [&](int64_t begin, int64_t len, auto x_chunk, auto dx_chunk) {
            cross_entropy::strided_row_grad(overwrite, ignored, x_chunk, lse[r], scale,
                                            t >= begin && t < begin + len ? t - begin : -1, 0, len, 1, dx_chunk);
          },
          x + r * nv, dx + r * nv);
    }
  });
}

}  // namespace jnntile
