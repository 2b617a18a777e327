#include "kernels/attention.h"
#include "kernels/cuda/warp.h"

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
// row-major with leading dimension ld = nh * d and heads d floats apart; s
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

// s = alpha x y^T
void score_gemm(const AttentionPair& p, float alpha, const float* x, const float* y, float* s) {
  const int ld = int(p.nh * p.d);
  const float beta = 0.0f;
  cuda::check(cublasSgemmStridedBatched(cuda::cublas(), CUBLAS_OP_T, CUBLAS_OP_N, int(p.nk), int(p.nq), int(p.d),
                                        &alpha, y, ld, p.d, x, ld, p.d, &beta, s, int(p.nk), p.nq * p.nk, int(p.nh)),
              "attention scores");
}

// out (nq, d) = alpha s y + beta out
void query_gemm(const AttentionPair& p, float alpha, const float* s, const float* y, float beta, float* out) {
  const int ld = int(p.nh * p.d);
  cuda::check(cublasSgemmStridedBatched(cuda::cublas(), CUBLAS_OP_N, CUBLAS_OP_N, int(p.d), int(p.nq), int(p.nk),
                                        &alpha, y, ld, p.d, s, int(p.nk), p.nq * p.nk, &beta, out, ld, p.d, int(p.nh)),
              "attention query product");
}

// out (nk, d) += alpha s^T x
void key_gemm(const AttentionPair& p, float alpha, const float* s, const float* x, float* out) {
  const int ld = int(p.nh * p.d);
  const float beta = 1.0f;
  cuda::check(cublasSgemmStridedBatched(cuda::cublas(), CUBLAS_OP_N, CUBLAS_OP_T, int(p.d), int(p.nk), int(p.nq),
                                        &alpha, x, ld, p.d, s, int(p.nk), p.nq * p.nk, &beta, out, ld, p.d, int(p.nh)),
              "attention key product");
}

}  // namespace

template <>
void attention_forward_step<Device::Cuda>(bool first, const AttentionPair& p, const float* q, const float* k,
                                          const float* v, float* o, float* stats, float* scratch) {
  for (int64_t b = 0; b < p.nb; ++b) {
    const int64_t qb = query_offset(p, b), kb = key_offset(p, b);
    score_gemm(p, p.scale, q + qb, k + kb, scratch);
    for_rows<ForwardRow>("attention_forward_step", p.nh * p.nq, first, p, b, int64_t{0}, scratch, o, stats);
    query_gemm(p, 1.0f, scratch, v + kb, first ? 0.0f : 1.0f, o + qb);
  }
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
  float *s = scratch, *dp = scratch + score_blocks_size(p);  // P and dP, then dS in place of dP
  for (int64_t b = 0; b < p.nb; ++b) {
    const int64_t qb = query_offset(p, b), kb = key_offset(p, b);
    score_gemm(p, p.scale, q + qb, k + kb, s);
    score_gemm(p, 1.0f, d_o + qb, v + kb, dp);
    for_rows<BackwardRow>("attention_backward_step", p.nh * p.nq, p, b, int64_t{0}, lse, delta, s, dp);
    key_gemm(p, 1.0f, s, d_o + qb, dv + kb);
    query_gemm(p, p.scale, dp, k + kb, 1.0f, dq + qb);
    key_gemm(p, p.scale, dp, q + qb, dk + kb);
  }
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
