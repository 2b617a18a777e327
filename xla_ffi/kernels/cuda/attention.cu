#include <cuda_bf16.h>
#include <mma.h>

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
// its products, of 1024 rows at least; one the mask leaves whole in one. Each chunk costs launches of its own
// (in bfloat16 five in the forward and eight in the backward, each over all heads of the batch row), and at
// 1024 keys they cost more than the masked products: on an H200, GPT-2 124M at 8 x 1024 in chunks of 256
// rows took 46 ms of attention steps per training step, 7.3 us per launch in the forward and 10 in the
// backward (14 and 32 ms over 24 tasks of 80 and 128 launches), while a whole 1024 x 1024 pair's 12 heads of
// float32 scores are 50 MB, about 20 us of memory traffic per pass.
int64_t chunk_rows(const AttentionPair& p) {
  constexpr int64_t kMinChunkRows = 1024;
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


// ---- Fused steps (bfloat16, head_dim 64; the runtime's fused_attention setting) ---------------------------
//
// The steps above multiply with cuBLAS through float32 score blocks in the task's scratch: per pair and batch
// row, 5 launches in the forward and 8 in the backward, and every score written and read several times (on an
// H200, GPT-2 124M 8 x 1024 in bfloat16: 46 ms of attention per step against JAX's whole step of 34 ms). The
// fused steps keep a block's scores in shared memory and multiply on tensor cores (WMMA, bfloat16 operands,
// float32 sums), FlashAttention-2's way, in one launch per step (three in the backward), with no atomics:
//
//   forward   a block per 64 query rows of a (batch row, head): S = scale q k^T for 64 keys at a time, the
//             online softmax on the rows (the row bodies' arithmetic: m, l, alpha), o = alpha o + P v.
//   dk, dv    a block per 64 keys: for every query block that sees them, S^T and dP^T = v do^T, P = exp(S - lse),
//             dS = P (dP - delta), dv += P^T do, dk += scale dS^T q.
//   dq        a block per 64 query rows: for every key block it sees, S, dP, dS again, dq += scale dS k.
//
// Each of a block's 4 warps owns 16 rows (queries, or keys for dk/dv); a warp's lanes take a row each in pairs
// (lane / 2 is the row, lane % 2 its half of the 64 columns) for the elementwise steps. P and dS are rounded to
// bfloat16 for the products, as the cuBLAS steps round them. The runtime's default (fused_attention); with it
// off, the cuBLAS steps (tests/test_attention.py runs both on a GPU). On an H200, GPT-2 124M 8 x 1024: 6.4 ms
// forward and 20 ms backward per step (each kernel's own time), against 10.7 and 25.9 ms of cuBLAS steps.
namespace fused {

namespace wmma = nvcuda::wmma;
constexpr int kD = int(attention::kFusedHeadDim);  // head_dim the fused steps take
constexpr int kRows = 64;              // query or key rows of a block
constexpr int kWarps = 4;              // 16 rows each
constexpr int kFrag = 16;              // WMMA tile edge
constexpr int kLd = kD + 8;            // shared bfloat16 rows, padded (multiple of 8, 32-byte fragment starts)
constexpr int kLdf = kRows + 4;        // shared float rows (multiple of 4), kRows >= kD columns
using bf16 = __nv_bfloat16;
using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;

// Shared memory of a block: four (64, 64) bfloat16 operand blocks, then per warp two (16, 64) float32 stages
// and a (16, 64) bfloat16 block (P or dS).
struct Shared {
  bf16 a[kRows * kLd], b[kRows * kLd], c[kRows * kLd], d[kRows * kLd];
  float stage[kWarps][2][kFrag * kLdf];
  bf16 p[kWarps][kFrag * kLd];
};
constexpr size_t kSharedBytes = sizeof(Shared);

__device__ inline bf16 to_bf16(float x) { return __ushort_as_bfloat16(from_float<bfloat16>(x).bits); }

// Rows [row0, row0 + 64) of a tile's head (rows `ld` elements apart, `rows` of them) into a shared block,
// zeros past the last row. Eight bfloat16 (16 bytes) per load where the head's rows start 16 bytes apart,
// as a tile's do (heads and rows start at multiples of 64 elements): one load for eight, and no division
// per element. The shared rows (kLd * 2 = 144 bytes) start 16 bytes apart too.
__device__ void load_rows(const bfloat16* head, int64_t ld, int64_t row0, int64_t rows, bf16* block) {
  constexpr int kVector = 8, kVectors = kD / kVector;  // per row
  if (ld % kVector == 0 && reinterpret_cast<uintptr_t>(head) % 16 == 0) {
    for (int i = threadIdx.x; i < kRows * kVectors; i += blockDim.x) {
      const int r = i / kVectors, c = (i % kVectors) * kVector;
      const uint4 eight = row0 + r < rows ? *reinterpret_cast<const uint4*>(head + (row0 + r) * ld + c)
                                          : make_uint4(0, 0, 0, 0);  // bfloat16 zeros
      *reinterpret_cast<uint4*>(block + r * kLd + c) = eight;
    }
    return;
  }
  for (int i = threadIdx.x; i < kRows * kD; i += blockDim.x) {
    const int r = i / kD, c = i % kD;
    block[r * kLd + c] = row0 + r < rows ? __ushort_as_bfloat16(head[(row0 + r) * ld + c].bits) : to_bf16(0.0f);
  }
}

// acc (16 x 16 n-tiles, 4 of them: 16 x 64) = x (16 rows of a block) y^T (the 64 rows of a block): scores.
__device__ void rows_times_rows_t(const bf16* x, const bf16* y, FragC* acc) {
  for (int j = 0; j < kRows / kFrag; ++j) {
    wmma::fill_fragment(acc[j], 0.0f);
    for (int k = 0; k < kD / kFrag; ++k) {
      FragA a;
      FragBCol b;  // y^T read column-major: element (k, n) at y[n * kLd + k]
      wmma::load_matrix_sync(a, x + k * kFrag, kLd);
      wmma::load_matrix_sync(b, y + j * kFrag * kLd + k * kFrag, kLd);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
  }
}

// acc (16 x 64, kD / 16 tiles) += s (16 x 64 bfloat16, row-major, kLd) times y (the 64 rows of a block).
__device__ void scores_times_rows(const bf16* s, const bf16* y, FragC* acc) {
  for (int j = 0; j < kD / kFrag; ++j)
    for (int k = 0; k < kRows / kFrag; ++k) {
      FragA a;
      FragBRow b;
      wmma::load_matrix_sync(a, s + k * kFrag, kLd);
      wmma::load_matrix_sync(b, y + k * kFrag * kLd + j * kFrag, kLd);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
}

__device__ void store(const FragC* acc, int tiles, float* stage) {
  for (int j = 0; j < tiles; ++j) wmma::store_matrix_sync(stage + j * kFrag, acc[j], kLdf, wmma::mem_row_major);
}

// The row (lane / 2) and first column (lane % 2 halves) a lane takes in a warp's 16 x 64 stage.
__device__ inline int lane_row() { return cuda::lane() / 2; }
__device__ inline int lane_col0() { return (cuda::lane() % 2) * (kRows / 2); }
__device__ inline float pair_max(float x) { return fmaxf(x, cuda::shuffle_xor(x, 1)); }
__device__ inline float pair_sum(float x) { return x + cuda::shuffle_xor(x, 1); }
// The last of the 64 rows from row0 that exist.
__device__ inline int64_t last_row(int64_t row0, int64_t rows) {
  return (row0 + kRows < rows ? row0 + kRows : rows) - 1;
}

// grid (query blocks, nh, nb)
__global__ void __launch_bounds__(kWarps * cuda::kWarp)
    forward_kernel(bool first, AttentionPair p, const bfloat16* q, const bfloat16* k, const bfloat16* v, float* o,
                   float* stats) {
  extern __shared__ __align__(128) unsigned char raw[];
  Shared& sh = *reinterpret_cast<Shared*>(raw);
  const int warp = threadIdx.x / cuda::kWarp, lr = lane_row(), c0 = lane_col0();
  const int64_t b = blockIdx.z, h = blockIdx.y, q_row0 = int64_t(blockIdx.x) * kRows, ld = p.nh * kD;
  const int64_t qoff = (b * p.nq * p.nh + h) * kD, koff = (b * p.nk * p.nh + h) * kD;  // head h of batch row b
  const bfloat16 *qh = q + qoff, *kh = k + koff, *vh = v + koff;
  const int64_t r = q_row0 + warp * kFrag + lr;  // the lane's query row
  const bool live = r < p.nq;
  const int64_t i = live ? row_index(p, b, r, h) : 0;
  float m = first || !live ? -INFINITY : stats[2 * i], l = first || !live ? 0.0f : stats[2 * i + 1];
  float* stage = sh.stage[warp][0];
  FragC acc[kD / kFrag];
  if (first) {
    for (FragC& f : acc) wmma::fill_fragment(f, 0.0f);
  } else {  // o's rows through the stage into the accumulators, a row at a time over the lanes (coalesced)
    for (int rr = 0; rr < kFrag; ++rr) {
      const int64_t row = q_row0 + warp * kFrag + rr;
      const float* o_row = row < p.nq ? o + row_index(p, b, row, h) * kD : nullptr;
      for (int c = cuda::lane(); c < kD; c += cuda::kWarp) stage[rr * kLdf + c] = o_row ? o_row[c] : 0.0f;
    }
    __syncwarp();
    for (int j = 0; j < kD / kFrag; ++j)
      wmma::load_matrix_sync(acc[j], stage + j * kFrag, kLdf, wmma::mem_row_major);
  }
  load_rows(qh, ld, q_row0, p.nq, sh.a);
  const int64_t keys = visible_keys(p, last_row(q_row0, p.nq));  // what the block's last row sees
  const int64_t n_row = live ? visible_keys(p, r) : 0;
  for (int64_t k0 = 0; k0 < keys; k0 += kRows) {
    __syncthreads();  // the last key block's products are done
    load_rows(kh, ld, k0, p.nk, sh.b);
    load_rows(vh, ld, k0, p.nk, sh.c);
    __syncthreads();
    FragC s[kRows / kFrag];
    rows_times_rows_t(sh.a + warp * kFrag * kLd, sh.b, s);
    store(s, kRows / kFrag, stage);
    __syncwarp();
    float* row = stage + lr * kLdf;
    float row_max = -INFINITY;
    for (int c = c0; c < c0 + kRows / 2; ++c)
      if (k0 + c < n_row) row_max = fmaxf(row_max, p.scale * row[c]);
    const float m_new = fmaxf(m, pair_max(row_max));
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
    for (int c = c0; c < c0 + kRows / 2; ++c) {
      const float prob = k0 + c < n_row ? expf(p.scale * row[c] - m_new) : 0.0f;
      sh.p[warp][lr * kLd + c] = to_bf16(prob);
      sum += prob;
    }
    l = l * alpha + pair_sum(sum);
    m = m_new;
    __syncwarp();  // the scores are read: the stage takes o, rescaled by its row's alpha
    store(acc, kD / kFrag, stage);
    __syncwarp();
    for (int c = c0; c < c0 + kRows / 2; ++c)
      if (c < kD) row[c] *= alpha;
    __syncwarp();
    for (int j = 0; j < kD / kFrag; ++j)
      wmma::load_matrix_sync(acc[j], stage + j * kFrag, kLdf, wmma::mem_row_major);
    scores_times_rows(sh.p[warp], sh.c, acc);
  }
  __syncwarp();
  store(acc, kD / kFrag, stage);
  __syncwarp();
  for (int rr = 0; rr < kFrag; ++rr) {  // a row at a time over the lanes
    const int64_t row = q_row0 + warp * kFrag + rr;
    if (row < p.nq)
      for (int c = cuda::lane(); c < kD; c += cuda::kWarp) o[row_index(p, b, row, h) * kD + c] = stage[rr * kLdf + c];
  }
  if (live && c0 == 0) {
    stats[2 * i] = m;
    stats[2 * i + 1] = l;
  }
}

// Adds a warp's 16 x 64 float32 result (scaled) to rows [row0, row0 + 16) of a float32 tile's head, a row at
// a time over the lanes (consecutive lanes, consecutive floats: coalesced).
__device__ void add_rows(const FragC* acc, float scale, float* stage, float* head, int64_t ld, int64_t row0,
                         int64_t rows) {
  store(acc, kD / kFrag, stage);
  __syncwarp();
  for (int rr = 0; rr < kFrag; ++rr)
    if (row0 + rr < rows)
      for (int c = cuda::lane(); c < kD; c += cuda::kWarp) head[(row0 + rr) * ld + c] += scale * stage[rr * kLdf + c];
  __syncwarp();
}

// grid (key blocks, nh, nb): dk and dv of 64 keys, over the query blocks that see them.
__global__ void __launch_bounds__(kWarps * cuda::kWarp)
    backward_kv_kernel(AttentionPair p, const bfloat16* q, const bfloat16* k, const bfloat16* v,
                       const bfloat16* d_o, const float* lse, const float* delta, float* dk, float* dv) {
  extern __shared__ __align__(128) unsigned char raw[];
  Shared& sh = *reinterpret_cast<Shared*>(raw);
  __shared__ float row_lse[kRows], row_delta[kRows];
  const int warp = threadIdx.x / cuda::kWarp, lr = lane_row(), c0 = lane_col0();
  const int64_t b = blockIdx.z, h = blockIdx.y, k_row0 = int64_t(blockIdx.x) * kRows, ld = p.nh * kD;
  const int64_t qoff = (b * p.nq * p.nh + h) * kD, koff = (b * p.nk * p.nh + h) * kD;
  load_rows(k + koff, ld, k_row0, p.nk, sh.a);
  load_rows(v + koff, ld, k_row0, p.nk, sh.b);
  const int64_t key = k_row0 + warp * kFrag + lr;  // the lane's key
  float *s_stage = sh.stage[warp][0], *dp_stage = sh.stage[warp][1];
  FragC dk_acc[kD / kFrag], dv_acc[kD / kFrag];
  for (int j = 0; j < kD / kFrag; ++j) {
    wmma::fill_fragment(dk_acc[j], 0.0f);
    wmma::fill_fragment(dv_acc[j], 0.0f);
  }
  for (int64_t q_row0 = 0; q_row0 < p.nq; q_row0 += kRows) {
    if (visible_keys(p, last_row(q_row0, p.nq)) <= k_row0) continue;  // the block's last query sees none of these keys
    __syncthreads();  // the last query block's products are done
    load_rows(q + qoff, ld, q_row0, p.nq, sh.c);
    load_rows(d_o + qoff, ld, q_row0, p.nq, sh.d);
    for (int t = threadIdx.x; t < kRows; t += blockDim.x) {
      const bool live = q_row0 + t < p.nq;
      row_lse[t] = live ? lse[row_index(p, b, q_row0 + t, h)] : 0.0f;
      row_delta[t] = live ? delta[row_index(p, b, q_row0 + t, h)] : 0.0f;
    }
    __syncthreads();
    FragC acc[kRows / kFrag];
    rows_times_rows_t(sh.a + warp * kFrag * kLd, sh.c, acc);  // S^T: keys x queries
    store(acc, kRows / kFrag, s_stage);
    rows_times_rows_t(sh.b + warp * kFrag * kLd, sh.d, acc);  // dP^T = v do^T
    store(acc, kRows / kFrag, dp_stage);
    __syncwarp();
    for (int c = c0; c < c0 + kRows / 2; ++c) {
      const int64_t query = q_row0 + c;
      const bool seen = query < p.nq && key < visible_keys(p, query);
      const float prob = seen ? expf(p.scale * s_stage[lr * kLdf + c] - row_lse[c]) : 0.0f;
      sh.p[warp][lr * kLd + c] = to_bf16(prob);
      dp_stage[lr * kLdf + c] = softmax_grad(prob, dp_stage[lr * kLdf + c], row_delta[c]);
    }
    __syncwarp();
    scores_times_rows(sh.p[warp], sh.d, dv_acc);  // dv += P^T do
    __syncwarp();  // P^T is read: the block takes dS^T
    for (int c = c0; c < c0 + kRows / 2; ++c) sh.p[warp][lr * kLd + c] = to_bf16(dp_stage[lr * kLdf + c]);
    __syncwarp();
    scores_times_rows(sh.p[warp], sh.c, dk_acc);  // dk += dS^T q (scaled when added)
  }
  add_rows(dv_acc, 1.0f, s_stage, dv + koff, ld, k_row0 + warp * kFrag, p.nk);
  add_rows(dk_acc, p.scale, s_stage, dk + koff, ld, k_row0 + warp * kFrag, p.nk);
}

// grid (query blocks, nh, nb): dq of 64 query rows, over the key blocks they see.
__global__ void __launch_bounds__(kWarps * cuda::kWarp)
    backward_q_kernel(AttentionPair p, const bfloat16* q, const bfloat16* k, const bfloat16* v,
                      const bfloat16* d_o, const float* lse, const float* delta, float* dq) {
  extern __shared__ __align__(128) unsigned char raw[];
  Shared& sh = *reinterpret_cast<Shared*>(raw);
  const int warp = threadIdx.x / cuda::kWarp, lr = lane_row(), c0 = lane_col0();
  const int64_t b = blockIdx.z, h = blockIdx.y, q_row0 = int64_t(blockIdx.x) * kRows, ld = p.nh * kD;
  const int64_t qoff = (b * p.nq * p.nh + h) * kD, koff = (b * p.nk * p.nh + h) * kD;
  load_rows(q + qoff, ld, q_row0, p.nq, sh.a);
  load_rows(d_o + qoff, ld, q_row0, p.nq, sh.b);
  const int64_t r = q_row0 + warp * kFrag + lr;
  const bool live = r < p.nq;
  const float r_lse = live ? lse[row_index(p, b, r, h)] : 0.0f, r_delta = live ? delta[row_index(p, b, r, h)] : 0.0f;
  const int64_t n_row = live ? visible_keys(p, r) : 0;
  const int64_t keys = visible_keys(p, last_row(q_row0, p.nq));
  float *s_stage = sh.stage[warp][0], *dp_stage = sh.stage[warp][1];
  FragC dq_acc[kD / kFrag];
  for (FragC& f : dq_acc) wmma::fill_fragment(f, 0.0f);
  for (int64_t k0 = 0; k0 < keys; k0 += kRows) {
    __syncthreads();
    load_rows(k + koff, ld, k0, p.nk, sh.c);
    load_rows(v + koff, ld, k0, p.nk, sh.d);
    __syncthreads();
    FragC acc[kRows / kFrag];
    rows_times_rows_t(sh.a + warp * kFrag * kLd, sh.c, acc);  // S
    store(acc, kRows / kFrag, s_stage);
    rows_times_rows_t(sh.b + warp * kFrag * kLd, sh.d, acc);  // dP = do v^T
    store(acc, kRows / kFrag, dp_stage);
    __syncwarp();
    for (int c = c0; c < c0 + kRows / 2; ++c) {
      const float prob = k0 + c < n_row ? expf(p.scale * s_stage[lr * kLdf + c] - r_lse) : 0.0f;
      sh.p[warp][lr * kLd + c] = to_bf16(softmax_grad(prob, dp_stage[lr * kLdf + c], r_delta));
    }
    __syncwarp();
    scores_times_rows(sh.p[warp], sh.c, dq_acc);  // dq += dS k (scaled when added)
  }
  add_rows(dq_acc, p.scale, s_stage, dq + qoff, ld, q_row0 + warp * kFrag, p.nq);
}

bool takes(const AttentionPair& p) { return cuda::fused_attention() && p.d == kD; }

// Launches `kernel` with the shared memory it needs (over the 48 KB default, so it is asked for).
template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, const char* what, Args... args) {
  cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes)), what);
  kernel<<<grid, kWarps * cuda::kWarp, kSharedBytes, cuda::stream()>>>(args...);
  cuda::check_launch(what);
}

dim3 grid(int64_t rows, const AttentionPair& p) {
  return dim3(unsigned((rows + kRows - 1) / kRows), unsigned(p.nh), unsigned(p.nb));
}

}  // namespace fused
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
  if (!fused::takes(p)) return forward_step(first, p, q, k, v, o, stats, scratch);
  fused::launch(fused::forward_kernel, fused::grid(p.nq, p), "attention_forward_step (fused)", first, p, q, k, v, o,
                stats);
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
  if (!fused::takes(p)) return backward_step(p, q, k, v, d_o, lse, delta, dq, dk, dv, scratch);
  fused::launch(fused::backward_kv_kernel, fused::grid(p.nk, p), "attention_backward_step (fused dk, dv)", p, q, k,
                v, d_o, lse, delta, dk, dv);
  fused::launch(fused::backward_q_kernel, fused::grid(p.nq, p), "attention_backward_step (fused dq)", p, q, k, v,
                d_o, lse, delta, dq);
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
