#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/cuda/warp.h"
#include "kernels/values.h"

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
    for_visible_chunks(p, b, chunk_rows(p), [&](const AttentionPair& c, int64_t r0) {
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
// row, 5 launches in the forward and 8 in the backward, and every score written and read several times. The
// fused steps keep a block's scores in registers and multiply on tensor cores (mma.sync m16n8k16, bfloat16
// operands, float32 sums), FlashAttention-2's way, in one launch per step (two in the backward), with no
// atomics:
//
//   forward   a block per 64 query rows of a (batch row, head): S = scale q k^T for 64 keys at a time, the
//             online softmax on the rows (m, l, alpha as the row bodies above), o = alpha o + P v.
//   dk, dv    a block per 64 keys: for every query block that sees them, S^T = k q^T and dP^T = v do^T,
//             P = exp(S - lse), dS = P (dP - delta), dv += P^T do, dk += scale dS^T q.
//   dq        a block per 64 query rows: for every key block it sees, S, dP, dS again, dq += scale dS k.
//
// Each of a block's 4 warps owns 16 rows (queries, or keys for dk/dv). Operand blocks of 64 rows sit in shared
// memory (ldmatrix reads them as mma's fragments); a warp's 16 x 64 results stay in registers in mma's
// accumulator layout, where the softmax works on them, and a score block becomes the A operand of the next
// product without leaving registers. P and dS are rounded to bfloat16 for the products, as the cuBLAS steps
// round them. The first version kept scores in shared memory between WMMA products (opaque fragments):
// 26.4 ms of GPT-2 124M's 8 x 1024 step on an H200 (about 30 TFLOP/s); this one 11.3 ms.
namespace fused {

constexpr int kD = int(attention::kFusedHeadDim);  // head_dim the fused steps take
constexpr int kRows = 64;                          // query or key rows of a block
constexpr int kWarps = 4;                          // 16 rows each
constexpr int kThreads = kWarps * cuda::kWarp;
constexpr int kTiles = kRows / 8;                  // 8-column tiles of a warp's 16 x 64 result
constexpr int kSteps = kRows / 16;                 // 16-deep steps of a product over 64
constexpr int kLd = kD + 8;  // shared rows of 144 bytes: the 8 rows an ldmatrix reads start in distinct banks
using bf16 = __nv_bfloat16;

// A warp's 16 x 64 float32 block in mma's accumulator layout: tile n, register i holds row g + 8 (i / 2) and
// column 8 n + 2 t + i % 2, with g = lane / 4 and t = lane % 4.
using Block = float[kTiles][4];
// The same block rounded to bfloat16 as A operands of a product over its 64 columns, 16 per step.
using Operands = uint32_t[kSteps][4];

__device__ inline int lane_group() { return cuda::lane() / 4; }  // g: the first of a lane's two rows
__device__ inline int lane_pair() { return cuda::lane() % 4; }   // t: 2 t is its first column of a tile
__device__ inline int block_row(int i) { return lane_group() + 8 * (i / 2); }
__device__ inline int block_column(int n, int i) { return 8 * n + 2 * lane_pair() + i % 2; }

// The max and the sum of a row over the 4 lanes that hold it.
__device__ inline float row_max(float x) {
  x = fmaxf(x, cuda::shuffle_xor(x, 1));
  return fmaxf(x, cuda::shuffle_xor(x, 2));
}
__device__ inline float row_sum(float x) {
  x += cuda::shuffle_xor(x, 1);
  return x + cuda::shuffle_xor(x, 2);
}

__device__ inline uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Four 8 x 8 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ inline void ldmatrix(uint32_t (&r)[4], const bf16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
__device__ inline void ldmatrix_transposed(uint32_t (&r)[4], const bf16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}

// c (16 x 8) += a (16 x 16) b (16 x 8)
__device__ inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A operand: rows [row0, row0 + 16) and columns [col0, col0 + 16) of a shared block (matrices: rows 0-7 and
// 8-15 of columns 0-7, then of columns 8-15).
__device__ inline void load_a(uint32_t (&a)[4], const bf16* block, int row0, int col0) {
  const int l = cuda::lane();
  ldmatrix(a, block + (row0 + l % 8 + (l / 8) % 2 * 8) * kLd + col0 + l / 16 * 8);
}

// B operands of two 8-column tiles, columns [n0, n0 + 16) of x y^T at depth [k0, k0 + 16), from y's shared
// rows (a column of the product is a row of y): b[0], b[1] for the first tile, b[2], b[3] for the second.
__device__ inline void load_b_of_rows(uint32_t (&b)[4], const bf16* y, int n0, int k0) {
  const int l = cuda::lane();
  ldmatrix(b, y + (n0 + l % 8 + l / 16 * 8) * kLd + k0 + (l / 8) % 2 * 8);
}

// The same for x y, from y's shared rows [k0, k0 + 16) (a column of the product is a column of y).
__device__ inline void load_b_of_columns(uint32_t (&b)[4], const bf16* y, int k0, int n0) {
  const int l = cuda::lane();
  ldmatrix_transposed(b, y + (k0 + l % 8 + (l / 8) % 2 * 8) * kLd + n0 + l / 16 * 8);
}

__device__ inline void zero(Block& acc) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
}

// acc = x y^T: rows [row0, row0 + 16) of block x times the 64 rows of block y, over the 64 columns of both.
__device__ void rows_times_rows_t(const bf16* x, int row0, const bf16* y, Block& acc) {
  zero(acc);
#pragma unroll
  for (int k0 = 0; k0 < kD; k0 += 16) {
    uint32_t a[4];
    load_a(a, x, row0, k0);
#pragma unroll
    for (int n0 = 0; n0 < kRows; n0 += 16) {
      uint32_t b[4];
      load_b_of_rows(b, y, n0, k0);
      mma(acc[n0 / 8], a, b[0], b[1]);
      mma(acc[n0 / 8 + 1], a, b[2], b[3]);
    }
  }
}

// acc += p y: a warp's 16 x 64 scores (as operands) times the 64 rows of block y.
__device__ void scores_times_rows(const Operands& p, const bf16* y, Block& acc) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int n0 = 0; n0 < kD; n0 += 16) {
      uint32_t b[4];
      load_b_of_columns(b, y, 16 * kk, n0);
      mma(acc[n0 / 8], p[kk], b[0], b[1]);
      mma(acc[n0 / 8 + 1], p[kk], b[2], b[3]);
    }
}

// Two floats as two bfloat16 (rounded to nearest even), the first in the low half.
__device__ inline uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 two = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&two);
}

// A operand step kk is tiles 2 kk and 2 kk + 1: the accumulator layout of one product is the operand layout of
// the next.
__device__ void to_operands(const Block& s, Operands& p) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    p[kk][0] = pack(s[2 * kk][0], s[2 * kk][1]);
    p[kk][1] = pack(s[2 * kk][2], s[2 * kk][3]);
    p[kk][2] = pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    p[kk][3] = pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// Rows [row0, row0 + 64) of a tile's head (rows `ld` elements apart, `rows` of them) into a shared block, zeros
// past the last row. Eight bfloat16 (16 bytes) per load where the head's rows start 16 bytes apart, as a
// tile's do (heads and rows start at multiples of 64 elements), each thread's loads all in flight before it
// stores them.
__device__ void load_rows(const bfloat16* head, int64_t ld, int64_t row0, int64_t rows, bf16* block) {
  constexpr int kVector = 8, kVectors = kD / kVector, kPerThread = kRows * kVectors / kThreads;
  if (ld % kVector == 0 && reinterpret_cast<uintptr_t>(head) % 16 == 0) {
    uint4 eight[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = threadIdx.x + j * kThreads, r = i / kVectors, c = i % kVectors * kVector;
      eight[j] = row0 + r < rows ? *reinterpret_cast<const uint4*>(head + (row0 + r) * ld + c)
                                 : make_uint4(0, 0, 0, 0);  // bfloat16 zeros
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = threadIdx.x + j * kThreads, r = i / kVectors, c = i % kVectors * kVector;
      *reinterpret_cast<uint4*>(block + r * kLd + c) = eight[j];
    }
    return;
  }
  for (int i = threadIdx.x; i < kRows * kD; i += kThreads) {
    const int r = i / kD, c = i % kD;
    block[r * kLd + c] = row0 + r < rows ? __ushort_as_bfloat16(head[(row0 + r) * ld + c].bits)
                                         : __ushort_as_bfloat16(0);
  }
}

// Adds scale times a warp's 16 x 64 block to rows [row0, row0 + 16) of a float32 tile's head, two floats at a
// time.
__device__ void add_block(const Block& acc, float scale, float* head, int64_t ld, int64_t row0, int64_t rows) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      const int64_t row = row0 + block_row(i);
      if (row >= rows) continue;
      float2* out = reinterpret_cast<float2*>(head + row * ld + block_column(n, i));
      float2 sum = *out;
      sum.x += scale * acc[n][i];
      sum.y += scale * acc[n][i + 1];
      *out = sum;
    }
}

// The last of the 64 rows from row0 that exist.
__device__ inline int64_t last_row(int64_t row0, int64_t rows) {
  return (row0 + kRows < rows ? row0 + kRows : rows) - 1;
}

// grid (query blocks, nh, nb)
__global__ void __launch_bounds__(kThreads)
    forward_kernel(bool first, AttentionPair p, const bfloat16* q, const bfloat16* k, const bfloat16* v, float* o,
                   float* stats) {
  __shared__ __align__(16) bf16 q_s[kRows * kLd], k_s[kRows * kLd], v_s[kRows * kLd];
  const int warp = threadIdx.x / cuda::kWarp;
  const int64_t b = blockIdx.z, h = blockIdx.y, q_row0 = int64_t(blockIdx.x) * kRows, ld = p.nh * kD;
  const int64_t qoff = (b * p.nq * p.nh + h) * kD, koff = (b * p.nk * p.nh + h) * kD;  // head h of batch row b
  // The lane's two query rows (r = 0, 1: rows g and g + 8 of its warp's 16), which see keys [lower, visible).
  bool live[2];
  int64_t index[2], lower[2], visible[2];
  float m[2], l[2];
  for (int r = 0; r < 2; ++r) {
    const int64_t row = q_row0 + warp * 16 + block_row(2 * r);
    live[r] = row < p.nq;
    index[r] = live[r] ? row_index(p, b, row, h) : 0;
    lower[r] = live[r] ? first_visible_key(p, b, row) : 0;
    visible[r] = live[r] ? visible_keys(p, row) : 0;
    m[r] = first || !live[r] ? -INFINITY : stats[2 * index[r]];
    l[r] = first || !live[r] ? 0.0f : stats[2 * index[r] + 1];
  }
  Block acc;
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      acc[n][i] = first || !live[i / 2] ? 0.0f : o[index[i / 2] * kD + block_column(n, i)];
  load_rows(q + qoff, ld, q_row0, p.nq, q_s);
  const int64_t keys = visible_keys(p, last_row(q_row0, p.nq));  // what the block's last row sees
  for (int64_t k0 = 0; k0 < keys; k0 += kRows) {
    __syncthreads();  // the last key block's products are done
    load_rows(k + koff, ld, k0, p.nk, k_s);
    load_rows(v + koff, ld, k0, p.nk, v_s);
    __syncthreads();
    Block s;
    rows_times_rows_t(q_s, warp * 16, k_s, s);
    float tile_max[2] = {-INFINITY, -INFINITY};
    auto seen = [&](int n, int i) {
      const int64_t key = k0 + block_column(n, i);
      return key >= lower[i / 2] && key < visible[i / 2];
    };
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (seen(n, i)) tile_max[i / 2] = fmaxf(tile_max[i / 2], p.scale * s[n][i]);
    float alpha[2], sum[2] = {0.0f, 0.0f};
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], row_max(tile_max[r]));
      alpha[r] = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);
      m[r] = m_new;
    }
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float prob = seen(n, i) ? expf(p.scale * s[n][i] - m[i / 2]) : 0.0f;
        s[n][i] = prob;
        sum[i / 2] += prob;
        acc[n][i] *= alpha[i / 2];
      }
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + row_sum(sum[r]);
    Operands probs;
    to_operands(s, probs);
    scores_times_rows(probs, v_s, acc);
  }
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (live[i / 2]) o[index[i / 2] * kD + block_column(n, i)] = acc[n][i];
  for (int r = 0; r < 2; ++r)
    if (live[r] && lane_pair() == 0) {
      stats[2 * index[r]] = m[r];
      stats[2 * index[r] + 1] = l[r];
    }
}

// grid (key blocks, nh, nb): dk and dv of 64 keys, over the query blocks that see them.
__global__ void __launch_bounds__(kThreads)
    backward_kv_kernel(AttentionPair p, const bfloat16* q, const bfloat16* k, const bfloat16* v,
                       const bfloat16* d_o, const float* lse, const float* delta, float* dk, float* dv) {
  __shared__ __align__(16) bf16 k_s[kRows * kLd], v_s[kRows * kLd], q_s[kRows * kLd], do_s[kRows * kLd];
  __shared__ float row_lse[kRows], row_delta[kRows];
  const int warp = threadIdx.x / cuda::kWarp;
  const int64_t b = blockIdx.z, h = blockIdx.y, k_row0 = int64_t(blockIdx.x) * kRows, ld = p.nh * kD;
  const int64_t qoff = (b * p.nq * p.nh + h) * kD, koff = (b * p.nk * p.nh + h) * kD;
  load_rows(k + koff, ld, k_row0, p.nk, k_s);
  load_rows(v + koff, ld, k_row0, p.nk, v_s);
  const int64_t key[2] = {k_row0 + warp * 16 + block_row(0), k_row0 + warp * 16 + block_row(2)};  // the lane's
  Block dk_acc, dv_acc;
  zero(dk_acc);
  zero(dv_acc);
  for (int64_t q_row0 = 0; q_row0 < p.nq; q_row0 += kRows) {
    if (visible_keys(p, last_row(q_row0, p.nq)) <= k_row0) continue;  // the block's last query sees none of these keys
    __syncthreads();  // the last query block's products are done
    load_rows(q + qoff, ld, q_row0, p.nq, q_s);
    load_rows(d_o + qoff, ld, q_row0, p.nq, do_s);
    for (int t = threadIdx.x; t < kRows; t += kThreads) {
      const bool live = q_row0 + t < p.nq;
      row_lse[t] = live ? lse[row_index(p, b, q_row0 + t, h)] : 0.0f;
      row_delta[t] = live ? delta[row_index(p, b, q_row0 + t, h)] : 0.0f;
    }
    __syncthreads();
    Block s, ds;
    rows_times_rows_t(k_s, warp * 16, q_s, s);    // S^T: keys x queries
    rows_times_rows_t(v_s, warp * 16, do_s, ds);  // dP^T = v do^T
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = block_column(n, i);
        const int64_t query = q_row0 + c;
        const bool seen = query < p.nq && key[i / 2] >= first_visible_key(p, b, query) &&
                          key[i / 2] < visible_keys(p, query);
        const float prob = seen ? expf(p.scale * s[n][i] - row_lse[c]) : 0.0f;
        s[n][i] = prob;
        ds[n][i] = softmax_grad(prob, ds[n][i], row_delta[c]);
      }
    Operands operands;
    to_operands(s, operands);
    scores_times_rows(operands, do_s, dv_acc);  // dv += P^T do
    to_operands(ds, operands);
    scores_times_rows(operands, q_s, dk_acc);  // dk += dS^T q (scaled when added)
  }
  add_block(dv_acc, 1.0f, dv + koff, ld, k_row0 + warp * 16, p.nk);
  add_block(dk_acc, p.scale, dk + koff, ld, k_row0 + warp * 16, p.nk);
}

// grid (query blocks, nh, nb): dq of 64 query rows, over the key blocks they see.
__global__ void __launch_bounds__(kThreads)
    backward_q_kernel(AttentionPair p, const bfloat16* q, const bfloat16* k, const bfloat16* v,
                      const bfloat16* d_o, const float* lse, const float* delta, float* dq) {
  __shared__ __align__(16) bf16 q_s[kRows * kLd], do_s[kRows * kLd], k_s[kRows * kLd], v_s[kRows * kLd];
  const int warp = threadIdx.x / cuda::kWarp;
  const int64_t b = blockIdx.z, h = blockIdx.y, q_row0 = int64_t(blockIdx.x) * kRows, ld = p.nh * kD;
  const int64_t qoff = (b * p.nq * p.nh + h) * kD, koff = (b * p.nk * p.nh + h) * kD;
  load_rows(q + qoff, ld, q_row0, p.nq, q_s);
  load_rows(d_o + qoff, ld, q_row0, p.nq, do_s);
  float r_lse[2], r_delta[2];
  int64_t lower[2], visible[2];  // the keys [lower, visible) the lane's rows see
  for (int r = 0; r < 2; ++r) {
    const int64_t row = q_row0 + warp * 16 + block_row(2 * r);
    const bool live = row < p.nq;
    r_lse[r] = live ? lse[row_index(p, b, row, h)] : 0.0f;
    r_delta[r] = live ? delta[row_index(p, b, row, h)] : 0.0f;
    lower[r] = live ? first_visible_key(p, b, row) : 0;
    visible[r] = live ? visible_keys(p, row) : 0;
  }
  const int64_t keys = visible_keys(p, last_row(q_row0, p.nq));
  Block dq_acc;
  zero(dq_acc);
  for (int64_t k0 = 0; k0 < keys; k0 += kRows) {
    __syncthreads();
    load_rows(k + koff, ld, k0, p.nk, k_s);
    load_rows(v + koff, ld, k0, p.nk, v_s);
    __syncthreads();
    Block s, dp;
    rows_times_rows_t(q_s, warp * 16, k_s, s);    // S
    rows_times_rows_t(do_s, warp * 16, v_s, dp);  // dP = do v^T
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t key = k0 + block_column(n, i);
        const float prob =
            key >= lower[i / 2] && key < visible[i / 2] ? expf(p.scale * s[n][i] - r_lse[i / 2]) : 0.0f;
        s[n][i] = softmax_grad(prob, dp[n][i], r_delta[i / 2]);
      }
    Operands ds;
    to_operands(s, ds);
    scores_times_rows(ds, k_s, dq_acc);  // dq += dS k (scaled when added)
  }
  add_block(dq_acc, p.scale, dq + qoff, ld, q_row0 + warp * 16, p.nq);
}

bool takes(const AttentionPair& p) { return cuda::fused_attention() && p.d == kD; }

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, const char* what, Args... args) {
  kernel<<<grid, kThreads, 0, cuda::stream()>>>(args...);
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
