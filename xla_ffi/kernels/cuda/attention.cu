#include <algorithm>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/cuda/warp.h"
#include "kernels/data.h"

namespace jnntile {

using namespace attention;

namespace {

// The lanes of a warp share one row (kernels/cuda/warp.h).
struct WarpLanes {
  int64_t lane;
  static constexpr int64_t count = cuda::kWarp;
  template <class Term>
  __device__ float max_of(int64_t n, Term term) const {
    float m = -INFINITY;
    for (int64_t c = lane; c < n; c += count) m = fmaxf(m, term(c));
    return cuda::warp_reduce(m, [](float a, float b) { return fmaxf(a, b); });
  }
  template <class Term>
  __device__ double sum_of(int64_t n, Term term) const {
    double acc = 0.0;
    for (int64_t c = lane; c < n; c += count) acc += term(c);
    return cuda::warp_reduce(acc, [](double a, double b) { return a + b; });
  }
};

// One warp per row, grid-stride over the rows: `row` is the same on all lanes
// of a warp, so every lane reaches the shuffles of the row body.
template <class Row, class... Args>
__global__ void rows_kernel(int64_t rows, Args... args) {
  const WarpLanes lanes{cuda::lane()};
  for (int64_t row = cuda::warp_index(); row < rows; row += cuda::warp_count()) Row::apply(lanes, row, args...);
}

template <class Row, class... Args>
void for_rows(const char* what, int64_t rows, Args... args) {
  rows_kernel<Row><<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(rows, args...);
  cuda::check_launch(what);
}

// The products of a step over the nh heads of one batch row, as in
// cpu/attention.cc: x is query-side (nq, d), y key-side (nk, d) per head, both
// row-major with leading dimension ld = nh * d and heads d elements apart; s
// holds the row-major (nq, nk) score blocks, nq * nk floats apart. cuBLAS is
// column-major: a row-major (R, C) matrix with leading dimension ld is the
// column-major (C, R) matrix of its transpose, so a row-major C = A B is
// computed as C^T = B^T A^T with the operands swapped. One strided batch over
// the nh heads per product:
//
//   product              call                          transa transb  m   n   k  A    lda  B    ldb  C    ldc
//   S  = scale q k^T     score_gemm(scale, q, k, S)    T      N       nk  nq  d  k    ld   q    ld   S    nk
//   dP = do v^T          score_gemm(1, do, v, dP)      T      N       nk  nq  d  v    ld   do   ld   dP   nk
//   o  = P v + o         query_gemm(1, P, v, 0|1, o)   N      N       d   nq  nk v    ld   P    nk   o    ld
//   dq += scale dS k     query_gemm(scale, dS, k,1,dq) N      N       d   nq  nk k    ld   dS   nk   dq   ld
//   dv += P^T do         key_gemm(1, P, do, dv)        N      T       d   nk  nq do   ld   P    nk   dv   ld
//   dk += scale dS^T q   key_gemm(scale, dS, q, dk)    N      T       d   nk  nq q    ld   dS   nk   dk   ld
//
// Batch strides: d for every tile operand (head h starts h * d floats in),
// nq * nk for the score blocks. E.g. S: column-major S^T (nk, nq) = k q^T,
// where the k pointer read column-major is k^T (d, nk) with ld, hence
// transa = T, and the q pointer is q^T (d, nq), transb = N. o's beta is 0 on
// the first key tile: cuBLAS then does not read o, whose tile was never written.

// One strided batch of products over the heads, on float32 operands (cublasSgemmStridedBatched: its math mode,
// TF32 or not, is the handle's, kernels/cuda/context.cc) or bfloat16 ones (summed in float32); C is float32.
template <class T>
void strided_gemm(cublasOperation_t trans_a, cublasOperation_t trans_b, int m, int n, int k, float alpha,
                  const T* a, int lda, int64_t stride_a, const T* b, int ldb, int64_t stride_b, float beta, float* c,
                  int ldc, int64_t stride_c, int batch, const char* what) {
  if constexpr (std::is_same_v<T, float>) {
    cuda::check(cublasSgemmStridedBatched(cuda::cublas(), trans_a, trans_b, m, n, k, &alpha, a, lda, stride_a, b,
                                          ldb, stride_b, &beta, c, ldc, stride_c, batch),
                what);
  } else {
    cuda::check(cublasGemmStridedBatchedEx(cuda::cublas(), trans_a, trans_b, m, n, k, &alpha, a, CUDA_R_16BF, lda,
                                           stride_a, b, CUDA_R_16BF, ldb, stride_b, &beta, c, CUDA_R_32F, ldc,
                                           stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                what);
  }
}

// s = alpha x y^T
template <class T>
void score_gemm(const AttentionPair& p, float alpha, const T* x, const T* y, float* s) {
  const int ld = int(p.nh * p.d);
  strided_gemm(CUBLAS_OP_T, CUBLAS_OP_N, int(p.nk), int(p.nq), int(p.d), alpha, y, ld, p.d, x, ld, p.d, 0.0f, s,
               int(p.nk), p.nq * p.nk, int(p.nh), "attention scores");
}

// out (nq, d) = alpha s y + beta out
template <class T>
void query_gemm(const AttentionPair& p, float alpha, const T* s, const T* y, float beta, float* out) {
  const int ld = int(p.nh * p.d);
  strided_gemm(CUBLAS_OP_N, CUBLAS_OP_N, int(p.d), int(p.nq), int(p.nk), alpha, y, ld, p.d, s, int(p.nk),
               p.nq * p.nk, beta, out, ld, p.d, int(p.nh), "attention query product");
}

// out (nk, d) += alpha s^T x
template <class T>
void key_gemm(const AttentionPair& p, float alpha, const T* s, const T* x, float* out) {
  const int ld = int(p.nh * p.d);
  strided_gemm(CUBLAS_OP_N, CUBLAS_OP_T, int(p.d), int(p.nk), int(p.nq), alpha, x, ld, p.d, s, int(p.nk),
               p.nq * p.nk, 1.0f, out, ld, p.d, int(p.nh), "attention key product");
}

// The float32 score blocks of a chunk as a product's operand of type T: the blocks themselves, or rounded to
// bfloat16 into `space` (P and dS in bfloat16, as FlashAttention multiplies them).
template <class T>
const T* as_operand(const AttentionPair& c, const float* blocks, T* space) {
  if constexpr (std::is_same_v<T, float>) {
    return blocks;
  } else {
    convert<Device::Cuda>(score_blocks_size(c), FloatType::F32, blocks, FloatType::BF16, space);
    return space;
  }
}

// Query rows per chunk: a pair the causal mask cuts (a diagonal one) in four chunks, which multiply 5/8 of
// its products, of 128 rows at least; one the mask leaves whole in one. Each chunk costs launches of its own
// (in bfloat16 five in the forward and eight in the backward, each over all heads of the batch row), which
// smaller chunks would not repay.
int64_t chunk_rows(const AttentionPair& p) {
  constexpr int64_t kMinChunkRows = 128;
  if (visible_keys(p, 0) >= p.nk) return p.nq;
  return std::max((p.nq + 3) / 4, kMinChunkRows);
}

// Calls fn(chunk, qb, kb, row0) for every visible chunk of every batch row of p: qb is the offset of the
// chunk's queries, kb that of its batch row's keys and values, row0 the index of its first query row
// (head 0) among the per-row values.
template <class Fn>
void for_chunks(const AttentionPair& p, Fn fn) {
  for (int64_t b = 0; b < p.nb; ++b) {
    const int64_t kb = key_offset(p, b);
    for_visible_chunks(p, chunk_rows(p), [&](const AttentionPair& c, int64_t r0) {
      fn(c, query_offset(p, b) + r0 * p.nh * p.d, kb, row_index(p, b, r0, 0));
    });
  }
}

// The forward step on operands of type T. scratch: the float32 score blocks of the batch row's heads, then
// (bfloat16) their bfloat16 copy.
template <class T>
void forward_step(bool first, const AttentionPair& p, const T* q, const T* k, const T* v, float* o, float* stats,
                  float* scratch) {
  T* rounded = reinterpret_cast<T*>(scratch + score_blocks_size(p));
  for_chunks(p, [&](const AttentionPair& c, int64_t qb, int64_t kb, int64_t row0) {
    score_gemm(c, p.scale, q + qb, k + kb, scratch);
    for_rows<ForwardRow>("attention_forward_step", c.nh * c.nq, first, c, int64_t{0}, int64_t{0}, scratch, o + qb,
                         stats + 2 * row0);
    // o = alpha o + P v; the first step overwrites o (beta 0: cuBLAS does not read it), never written before.
    query_gemm(c, 1.0f, as_operand(c, scratch, rounded), v + kb, first ? 0.0f : 1.0f, o + qb);
  });
}

// The backward step on operands of type T. scratch: two sets of float32 score blocks (P and dP, then dS in
// place of dP), then (bfloat16) one in bfloat16 (P, then dS).
template <class T>
void backward_step(const AttentionPair& p, const T* q, const T* k, const T* v, const T* d_o, const float* lse,
                   const float* delta, float* dq, float* dk, float* dv, float* scratch) {
  float *s = scratch, *dp = scratch + score_blocks_size(p);
  T* rounded = reinterpret_cast<T*>(scratch + 2 * score_blocks_size(p));
  for_chunks(p, [&](const AttentionPair& c, int64_t qb, int64_t kb, int64_t row0) {
    score_gemm(c, p.scale, q + qb, k + kb, s);
    score_gemm(c, 1.0f, d_o + qb, v + kb, dp);
    for_rows<BackwardRow>("attention_backward_step", c.nh * c.nq, c, int64_t{0}, int64_t{0}, lse + row0,
                          delta + row0, s, dp);
    key_gemm(c, 1.0f, as_operand(c, s, rounded), d_o + qb, dv + kb);
    // In stream order: dS overwrites the rounded P after the product that reads it.
    const T* ds = as_operand(c, dp, rounded);
    query_gemm(c, p.scale, ds, k + kb, 1.0f, dq + qb);
    key_gemm(c, p.scale, ds, q + qb, dk + kb);
  });
}

}  // namespace

template <>
void attention_forward_step<Device::Cuda>(bool first, const AttentionPair& p, const float* q, const float* k,
                                          const float* v, float* o, float* stats, float* scratch) {
  forward_step(first, p, q, k, v, o, stats, scratch);
}

template <>
void attention_forward_step_bf16<Device::Cuda>(bool first, const AttentionPair& p, const bfloat16* q,
                                               const bfloat16* k, const bfloat16* v, float* o, float* stats,
                                               float* scratch) {
  forward_step(first, p, q, k, v, o, stats, scratch);
}

template <>
void attention_forward_finish<Device::Cuda>(int64_t rows, int64_t d, const float* stats, float* o, float* lse) {
  for_rows<FinishRow>("attention_forward_finish", rows, d, stats, o, lse);
}

template <>
void attention_backward_delta<Device::Cuda>(int64_t rows, int64_t d, const float* o, const float* d_o, float* delta) {
  for_rows<DeltaRow>("attention_backward_delta", rows, d, o, d_o, delta);
}

template <>
void attention_backward_step<Device::Cuda>(const AttentionPair& p, const float* q, const float* k, const float* v,
                                           const float* d_o, const float* lse, const float* delta, float* dq,
                                           float* dk, float* dv, float* scratch) {
  backward_step(p, q, k, v, d_o, lse, delta, dq, dk, dv, scratch);
}

template <>
void attention_backward_step_bf16<Device::Cuda>(const AttentionPair& p, const bfloat16* q, const bfloat16* k,
                                                const bfloat16* v, const bfloat16* d_o, const float* lse,
                                                const float* delta, float* dq, float* dk, float* dv,
                                                float* scratch) {
  backward_step(p, q, k, v, d_o, lse, delta, dq, dk, dv, scratch);
}

// The nb batch rows of the tiles as the rows of pitched 2D copies.
template <>
void attention_cache_copy<Device::Cuda>(bool first, const CacheCopy& c, const float* src, float* dst) {
  const size_t row = size_t(c.width) * sizeof(float);
  cuda::check(cudaMemcpy2DAsync(dst + c.dst_row * c.width, c.dst_rows * row, src + c.src_row * c.width,
                                c.src_rows * row, c.n * row, c.nb, cudaMemcpyDeviceToDevice, cuda::stream()),
              "attention cache copy");
  if (first && c.n < c.dst_rows)
    cuda::check(cudaMemset2DAsync(dst + c.n * c.width, c.dst_rows * row, 0, (c.dst_rows - c.n) * row, c.nb,
                                  cuda::stream()),
                "attention cache zeroing");
}

}  // namespace jnntile
