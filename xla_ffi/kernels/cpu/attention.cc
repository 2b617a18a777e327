#include "kernels/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

namespace jnntile {

using namespace attention;

namespace {

// One thread takes a whole row: nothing to combine.
struct SerialLanes {
  static constexpr int64_t lane = 0, count = 1;
  static float max(float x) { return x; }
  static double sum(double x) { return x; }
};

template <class Row, class... Args>
void for_rows(int64_t rows, Args... args) {
  for (int64_t row = 0; row < rows; ++row) Row::apply(SerialLanes{}, row, args...);
}

// The products of a step over the nh heads of one batch row (see the table in
// cuda/attention.cu); x is query-side (nq, d), y key-side (nk, d) per head, both
// with leading dimension nh * d, s holds the (nq, nk) score blocks.

// s = alpha x y^T
void score_gemm(const AttentionPair& p, float alpha, const float* x, const float* y, float* s) {
  const int64_t ld = p.nh * p.d;
  for (int64_t h = 0; h < p.nh; ++h)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.nq, p.nk, p.d, alpha, x + h * p.d, ld, y + h * p.d, ld,
                0.0f, s + h * p.nq * p.nk, p.nk);
}

// out (nq, d) = alpha s y + beta out
void query_gemm(const AttentionPair& p, float alpha, const float* s, const float* y, float beta, float* out) {
  const int64_t ld = p.nh * p.d;
  for (int64_t h = 0; h < p.nh; ++h)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, p.nq, p.d, p.nk, alpha, s + h * p.nq * p.nk, p.nk,
                y + h * p.d, ld, beta, out + h * p.d, ld);
}

// out (nk, d) += alpha s^T x
void key_gemm(const AttentionPair& p, float alpha, const float* s, const float* x, float* out) {
  const int64_t ld = p.nh * p.d;
  for (int64_t h = 0; h < p.nh; ++h)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, p.nk, p.d, p.nq, alpha, s + h * p.nq * p.nk, p.nk,
                x + h * p.d, ld, 1.0f, out + h * p.d, ld);
}

}  // namespace

template <>
void attention_forward_step<Device::Cpu>(bool first, const AttentionPair& p, const float* q, const float* k,
                                         const float* v, float* o, float* stats, float* scratch) {
  for (int64_t b = 0; b < p.nb; ++b) {
    const int64_t qb = query_offset(p, b), kb = key_offset(p, b);
    score_gemm(p, p.scale, q + qb, k + kb, scratch);
    for_rows<ForwardRow>(p.nh * p.nq, first, p, b, scratch, o, stats);
    // o = alpha o + P v; the first step overwrites o, whose tile was never written.
    query_gemm(p, 1.0f, scratch, v + kb, first ? 0.0f : 1.0f, o + qb);
  }
}

template <>
void attention_forward_finish<Device::Cpu>(int64_t rows, int64_t d, const float* stats, float* o, float* lse) {
  for_rows<FinishRow>(rows, d, stats, o, lse);
}

template <>
void attention_backward_delta<Device::Cpu>(int64_t rows, int64_t d, const float* o, const float* d_o, float* delta) {
  for_rows<DeltaRow>(rows, d, o, d_o, delta);
}

template <>
void attention_backward_step<Device::Cpu>(const AttentionPair& p, const float* q, const float* k, const float* v,
                                          const float* d_o, const float* lse, const float* delta, float* dq,
                                          float* dk, float* dv, float* scratch) {
  float *s = scratch, *dp = scratch + score_blocks_size(p);  // P and dP, then dS in place of dP
  for (int64_t b = 0; b < p.nb; ++b) {
    const int64_t qb = query_offset(p, b), kb = key_offset(p, b);
    score_gemm(p, p.scale, q + qb, k + kb, s);
    score_gemm(p, 1.0f, d_o + qb, v + kb, dp);
    for_rows<BackwardRow>(p.nh * p.nq, p, b, lse, delta, s, dp);
    key_gemm(p, 1.0f, s, d_o + qb, dv + kb);
    query_gemm(p, p.scale, dp, k + kb, 1.0f, dq + qb);
    key_gemm(p, p.scale, dp, q + qb, dk + kb);
  }
}

template <>
void attention_cache_copy<Device::Cpu>(bool first, const CacheCopy& c, const float* src, float* dst) {
  for (int64_t b = 0; b < c.nb; ++b) {
    float* out = dst + (b * c.dst_rows + c.dst_row) * c.width;
    std::memcpy(out, src + (b * c.src_rows + c.src_row) * c.width, size_t(c.n * c.width) * sizeof(float));
    if (first) std::fill(out + c.n * c.width, dst + (b + 1) * c.dst_rows * c.width, 0.0f);
  }
}

}  // namespace jnntile
