#include "kernels/attention.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/lanes.h"
#include "kernels/values.h"
#include "kernels/gemm.h"

namespace jnntile {

using namespace attention;

namespace {

// One thread takes a whole row, reducing it in independent running values.
struct SerialLanes {
  static constexpr int64_t lane = 0, count = 1;
  template <class Term>
  static float max_of(int64_t n, Term term) { return lane_max(n, term); }
  template <class Term>
  static double sum_of(int64_t n, Term term) { return lane_sum(n, term); }
};

template <class Row, class... Args>
void for_rows(int64_t begin, int64_t end, Args... args) {
  for (int64_t row = begin; row < end; ++row) Row::apply(SerialLanes{}, row, args...);
}

// The products of a step for head h of one batch row (see the table in cuda/attention.cu), on the tile
// products' BLAS (oneMKL where loaded), with float32 or bfloat16 operands T (bfloat16: cpu_bf16_gemm,
// summing in float32); x is query-side (nq, d), y key-side (nk, d) per head, both with leading dimension
// nh * d, s is the head's (nq, nk) score block, in float32 (scores) or T (P or dS as an operand).

template <class T>
void product(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a, int64_t lda,
             const T* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) cpu_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else cpu_bf16_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// s = alpha x y^T
template <class T>
void score_gemm(const AttentionPair& p, int64_t h, float alpha, const T* x, const T* y, float* s) {
  const int64_t ld = p.nh * p.d;
  product(false, true, p.nq, p.nk, p.d, alpha, x + h * p.d, ld, y + h * p.d, ld, 0.0f, s, p.nk);
}

// out (nq, d) = alpha s y + beta out
template <class T>
void query_gemm(const AttentionPair& p, int64_t h, float alpha, const T* s, const T* y, float beta, float* out) {
  const int64_t ld = p.nh * p.d;
  product(false, false, p.nq, p.d, p.nk, alpha, s, p.nk, y + h * p.d, ld, beta, out + h * p.d, ld);
}

// out (nk, d) += alpha s^T x
template <class T>
void key_gemm(const AttentionPair& p, int64_t h, float alpha, const T* s, const T* x, float* out) {
  const int64_t ld = p.nh * p.d;
  product(true, false, p.nk, p.d, p.nq, alpha, s, p.nk, x + h * p.d, ld, 1.0f, out + h * p.d, ld);
}

// A float32 score block as a product's operand of type T: the block itself, or rounded to bfloat16 into
// `space` (P and dS in bfloat16, as FlashAttention multiplies them; the row pass ran in float32).
template <class T>
const T* as_operand(const AttentionPair& c, const float* block, T* space) {
  if constexpr (std::is_same_v<T, float>) {
    return block;
  } else {
    convert<Device::Cpu>(c.nq * c.nk, FloatType::F32, block, FloatType::BF16, space);
    return space;
  }
}

// Query rows per chunk. A chunk's score blocks (one head's, 128 x 512 floats in the forward, twice that in the
// backward) stay in a core's cache between its products and its pass over the rows: with all heads' blocks
// of a 512 x 512 pair at once (24 MB in the backward), GPT-2 124M at 1 x 1024 spent 958 ms per step in
// attention's steps, 753 with chunks of one head. Where the causal mask cuts the pair, the rows of a chunk see a
// prefix of its keys, and each chunk multiplies only the keys its last row sees: 5/8 of a 512 x 512 pair's
// products (attention 1210 -> 986 ms per step, 2 workers; 64-row chunks 1026 ms, the smaller products being
// slower).
constexpr int64_t kChunkRows = 128;

// Calls fn(chunk, h, qb, kb, row0) for head h of every visible chunk of every batch row of p (one head's
// score block at a time): qb is the offset of the chunk's queries, kb that of its batch row's keys and values,
// row0 the index of its first query row among the per-row values.
template <class Fn>
void for_head_chunks(const AttentionPair& p, Fn fn) {
  for (int64_t b = 0; b < p.nb; ++b) {
    const int64_t kb = key_offset(p, b);
    for_visible_chunks(p, b, kChunkRows, [&](const AttentionPair& c, int64_t r0) {
      const int64_t qb = query_offset(p, b) + r0 * p.nh * p.d, row0 = row_index(p, b, r0, 0);
      for (int64_t h = 0; h < c.nh; ++h) fn(c, h, qb, kb, row0);
    });
  }
}

// The forward step on operands of type T. scratch: a float32 score block of the pair's size, then (for
// bfloat16) its bfloat16 copy.
template <class T>
void forward_step(bool first, const AttentionPair& p, const T* q, const T* k, const T* v, float* o, float* stats,
                  float* scratch) {
  T* rounded = reinterpret_cast<T*>(scratch + p.nq * p.nk);
  for_head_chunks(p, [&](const AttentionPair& c, int64_t h, int64_t qb, int64_t kb, int64_t row0) {
    score_gemm(c, h, p.scale, q + qb, k + kb, scratch);
    for_rows<ForwardRow>(h * c.nq, (h + 1) * c.nq, first, c, int64_t{0}, h, scratch, o + qb, stats + 2 * row0);
    // o = alpha o + P v; the first step overwrites o, whose tile was never written.
    query_gemm(c, h, 1.0f, as_operand(c, scratch, rounded), v + kb, first ? 0.0f : 1.0f, o + qb);
  });
}

// The backward step on operands of type T. scratch: two float32 score blocks of the pair's size (P and dP,
// then dS in place of dP), then (for bfloat16) a bfloat16 one (P, then dS).
template <class T>
void backward_step(const AttentionPair& p, const T* q, const T* k, const T* v, const T* d_o, const float* lse,
                   const float* delta, float* dq, float* dk, float* dv, float* scratch) {
  float *s = scratch, *dp = scratch + p.nq * p.nk;
  T* rounded = reinterpret_cast<T*>(scratch + 2 * p.nq * p.nk);
  for_head_chunks(p, [&](const AttentionPair& c, int64_t h, int64_t qb, int64_t kb, int64_t row0) {
    score_gemm(c, h, p.scale, q + qb, k + kb, s);
    score_gemm(c, h, 1.0f, d_o + qb, v + kb, dp);
    for_rows<BackwardRow>(h * c.nq, (h + 1) * c.nq, c, int64_t{0}, h, lse + row0, delta + row0, s, dp);
    key_gemm(c, h, 1.0f, as_operand(c, s, rounded), d_o + qb, dv + kb);
    const T* ds = as_operand(c, dp, rounded);
    query_gemm(c, h, p.scale, ds, k + kb, 1.0f, dq + qb);
    key_gemm(c, h, p.scale, ds, q + qb, dk + kb);
  });
}

}  // namespace

template <>
void attention_forward_step<Device::Cpu>(bool first, const AttentionPair& p, const float* q, const float* k,
                                         const float* v, float* o, float* stats, float* scratch) {
  forward_step(first, p, q, k, v, o, stats, scratch);
}

template <>
void attention_forward_step_bf16<Device::Cpu>(bool first, const AttentionPair& p, const bfloat16* q,
                                              const bfloat16* k, const bfloat16* v, float* o, float* stats,
                                              float* scratch) {
  forward_step(first, p, q, k, v, o, stats, scratch);
}

template <>
void attention_forward_finish<Device::Cpu>(int64_t rows, int64_t d, const float* stats, float* o, float* lse) {
  for_rows<FinishRow>(0, rows, d, stats, o, lse);
}

template <>
void attention_backward_delta<Device::Cpu>(int64_t rows, int64_t d, const float* o, const float* d_o, float* delta) {
  for_rows<DeltaRow>(0, rows, d, o, d_o, delta);
}

template <>
void attention_backward_step<Device::Cpu>(const AttentionPair& p, const float* q, const float* k, const float* v,
                                          const float* d_o, const float* lse, const float* delta, float* dq,
                                          float* dk, float* dv, float* scratch) {
  backward_step(p, q, k, v, d_o, lse, delta, dq, dk, dv, scratch);
}

template <>
void attention_backward_step_bf16<Device::Cpu>(const AttentionPair& p, const bfloat16* q, const bfloat16* k,
                                               const bfloat16* v, const bfloat16* d_o, const float* lse,
                                               const float* delta, float* dq, float* dk, float* dv,
                                               float* scratch) {
  backward_step(p, q, k, v, d_o, lse, delta, dq, dk, dv, scratch);
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
