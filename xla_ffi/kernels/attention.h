// Causal softmax attention on one (query tile, key tile) pair, FlashAttention-2
// style: scores exist only for the pair (nq x nk), never for the sequence.
//
// Tiles keep the (batch, seq, head, head_dim) layout of the model, so head h of
// batch row b in a q/k/v/o tile is a (rows, d) matrix with leading dimension
// nh * d, and the heads of a batch row are nh such matrices d floats apart:
//   q, o, do: (nb, nq, nh, d)   k, v: (nb, nk, nh, d)
// Per-row values (stats, lse, delta) are (nb, nq, nh). q0 and k0 are the
// sequence positions of the first query and key: key k0 + c is visible to
// query q0 + r when k0 + c <= q0 + r and, in a packed batch (document masking,
// `starts`), when k0 + c is not before the first position of the query's example.
//
// A step works one batch row at a time in a scratch of score blocks, one
// (nq, nk) block per head: matrix products (BLAS / cuBLAS), then a pass over
// the rows of the blocks (row `row` is query r = row % nq of head
// h = row / nq) with the row bodies below. Both cut the query rows into chunks,
// each a pair of its own with the keys it sees (for_visible_chunks). The GPU
// takes all nh heads of the batch row at once (the scratch holds nh blocks,
// h0 = 0) and cuts only a pair the causal mask cuts, in four chunks of 1024
// rows at least (cuda/attention.cu); the CPU takes one head at a time in a scratch of one
// block (h0 = h), which its cache keeps, in chunks of 128 rows
// (cpu/attention.cc). The
// CPU runs a row body on one thread, the GPU on a warp; `Lanes` says which
// share of the row a thread takes: columns lane, lane + count, ..., and
// lanes.max_of(n, term) / lanes.sum_of(n, term) reduce term(c) over the
// columns c < n of the row (every lane gets the result): the GPU's lanes each
// take their columns, then shuffle; the CPU's thread keeps independent running
// values (cpu/lanes.h), as one running max or sum would wait on each step's
// latency (GPT-2 124M at 1 x 1024: the forward steps took 391 ms per step,
// 307 in independent running values).
#pragma once
#include <math.h>

#include "kernels/device.h"
#include "kernels/math.h"

namespace jnntile {

struct AttentionPair {
  int64_t nb, nh, nq, nk, d;  // tile extents
  // Sequence positions of the first query and key. The first key tile of a
  // query tile starts at or before its first query (k0 <= q0; with a key/value
  // cache k0 = 0), so every query row sees a key of the first step. In a later
  // step a row may see no key of the pair (a cache tile that starts inside the
  // query tile): the step then leaves its output and (m, l) as they were.
  int64_t q0, k0;
  float scale;  // softmax scale, 1 / sqrt(d)
  // Document masking: (nb, nq) int32 on the step's device, the first position of each query's example (its
  // segment of a packed row); query r of batch row b sees no key before starts[b * nq + r]. nullptr: every
  // key up to the query's own position. The steps set it from a task buffer (ops/attention.cc); a row may
  // then see no key of a pair, even in its first step (its example starts in a later key tile).
  const int32_t* starts = nullptr;
};

namespace attention {

// Floats in the score blocks of one batch row: (nq, nk) per head.
inline int64_t score_blocks_size(const AttentionPair& p) { return p.nh * p.nq * p.nk; }

// The scores of row `row` in score blocks that start with head h0's block.
JNNTILE_HD float* score_row(const AttentionPair& p, int64_t h0, int64_t row, float* s) {
  return s + (row - h0 * p.nq) * p.nk;
}

// Working memory of a step, in floats: S, which becomes P; the backward also
// dP, which becomes dS.
inline int64_t forward_scratch_size(const AttentionPair& p) { return score_blocks_size(p); }
inline int64_t backward_scratch_size(const AttentionPair& p) { return 2 * score_blocks_size(p); }
// The steps on bfloat16 operands: the float32 score blocks of `heads` heads (the CPU takes one at a time, the
// GPU all), twice in the backward, then as many in bfloat16 for P and dS as operands.
inline int64_t bf16_scratch_size(const AttentionPair& p, bool backward, int64_t heads) {
  const int64_t blocks = heads * p.nq * p.nk;
  return (backward ? 2 : 1) * blocks + (blocks + 1) / 2;
}
// The head_dim of the fused bfloat16 steps on the GPU (kernels/cuda/attention.cu, with the runtime's
// fused_attention): they keep their operand blocks in shared memory and their scores in registers, and need no
// scratch.
constexpr int64_t kFusedHeadDim = 64;

// Offsets of head 0 of batch row b in a query-side and a key-side tile.
inline int64_t query_offset(const AttentionPair& p, int64_t b) { return b * p.nq * p.nh * p.d; }
inline int64_t key_offset(const AttentionPair& p, int64_t b) { return b * p.nk * p.nh * p.d; }

// Index of query r of head h of batch row b among the per-row values; times d,
// the offset of its row in o and do.
JNNTILE_HD int64_t row_index(const AttentionPair& p, int64_t b, int64_t r, int64_t h) {
  return (b * p.nq + r) * p.nh + h;
}

// Keys of the pair visible to query r: a prefix of the key tile.
JNNTILE_HD int64_t visible_keys(const AttentionPair& p, int64_t r) {
  int64_t n = p.q0 + r - p.k0 + 1;
  return n < p.nk ? n : p.nk;
}

// The first key of the pair that query r of batch row b sees: 0 but where document masking (p.starts) hides
// the keys before the query's example, the pair's keys up to visible_keys(p, r) then beginning there.
JNNTILE_HD int64_t first_visible_key(const AttentionPair& p, int64_t b, int64_t r) {
  if (p.starts == nullptr) return 0;
  const int64_t first = p.starts[b * p.nq + r] - p.k0;
  return first > 0 ? first : 0;
}

// Cuts the query rows of batch row b of p into chunks of `chunk_rows` and calls fn(chunk, r0) for each:
// `chunk` is a pair of one batch row whose queries start at row r0 (its row_index, offsets and starts are
// relative to that row) and whose keys are the prefix its last row sees, so where the causal mask cuts the
// pair each chunk multiplies only the keys it may see. A chunk that sees no key is skipped: a step leaves
// such rows as they were.
template <class Fn>
void for_visible_chunks(const AttentionPair& p, int64_t b, int64_t chunk_rows, Fn fn) {
  for (int64_t r0 = 0; r0 < p.nq; r0 += chunk_rows) {
    const int64_t rows = p.nq - r0 < chunk_rows ? p.nq - r0 : chunk_rows, keys = visible_keys(p, r0 + rows - 1);
    const int32_t* starts = p.starts == nullptr ? nullptr : p.starts + b * p.nq + r0;
    if (keys > 0) fn(AttentionPair{1, p.nh, rows, keys, p.d, p.q0 + r0, p.k0, p.scale, starts}, r0);
  }
}

// dS = P * (dP - delta), the softmax backward of one score.
JNNTILE_HD float softmax_grad(float prob, float dprob, float delta) { return prob * (dprob - delta); }

// Forward step, one row of the scores s (from head h0) of batch row b: the online softmax.
// stats hold the running max m and sum l per query row, o the unnormalised
// output. Turns the scores into P = exp(s - m_new) (0 for masked keys), updates
// (m, l) and rescales o by alpha = exp(m_old - m_new), so that o = alpha o + P v
// (a product after this pass) stays a sum over the keys seen so far with the
// new max. `first`: stats and o were never written; they start at
// (-inf, 0) and 0 and o is not read. A row that has seen no key yet (document masking: its example starts
// in a later key tile) keeps (-inf, 0) and o = 0.
struct ForwardRow {
  template <class Lanes>
  static JNNTILE_HD void apply(const Lanes& lanes, int64_t row, bool first, const AttentionPair& p, int64_t b,
                               int64_t h0, float* s, float* o, float* stats) {
    const int64_t h = row / p.nq, r = row % p.nq, n = visible_keys(p, r), lo = first_visible_key(p, b, r);
    const int64_t i = row_index(p, b, r, h);
    float* s_row = score_row(p, h0, row, s);
    const float m_old = first ? -INFINITY : stats[2 * i], l_old = first ? 0.0f : stats[2 * i + 1];
    const float m = fmaxf(m_old, lanes.max_of(n, [&](int64_t c) { return c < lo ? -INFINITY : s_row[c]; }));
    // Exponentials first, then their sum: the first loop vectorises on the CPU.
    for (int64_t c = lanes.lane; c < p.nk; c += lanes.count)
      s_row[c] = c >= lo && c < n ? exp_approx(s_row[c] - m) : 0.0f;
    const double sum = lanes.sum_of(n, [&](int64_t c) { return double(s_row[c]); });
    const float alpha = m == -INFINITY ? 1.0f : expf(m_old - m);
    if (!first) {
      float* o_row = o + i * p.d;
      for (int64_t c = lanes.lane; c < p.d; c += lanes.count) o_row[c] *= alpha;
    }
    if (lanes.lane == 0) {
      stats[2 * i] = m;
      stats[2 * i + 1] = l_old * alpha + float(sum);
    }
  }
};

// Forward finish, one of the nb * nq * nh query rows: o /= l, lse = m + log(l).
struct FinishRow {
  template <class Lanes>
  static JNNTILE_HD void apply(const Lanes& lanes, int64_t row, int64_t d, const float* stats, float* o, float* lse) {
    const float m = stats[2 * row], l = stats[2 * row + 1];
    const float inv = 1.0f / l;
    for (int64_t c = lanes.lane; c < d; c += lanes.count) o[row * d + c] *= inv;
    if (lanes.lane == 0) lse[row] = m + logf(l);
  }
};

// Backward, one of the nb * nq * nh query rows: delta = rowsum(do * o), in double.
struct DeltaRow {
  template <class Lanes>
  static JNNTILE_HD void apply(const Lanes& lanes, int64_t row, int64_t d, const float* o, const float* d_o,
                               float* delta) {
    const double acc = lanes.sum_of(d, [&](int64_t c) { return double(o[row * d + c]) * double(d_o[row * d + c]); });
    if (lanes.lane == 0) delta[row] = float(acc);
  }
};

// Backward step, one row of batch row b: the scores s become P = exp(s - lse)
// (0 for masked keys) and dP (in dp) becomes dS; both from head h0's block.
struct BackwardRow {
  template <class Lanes>
  static JNNTILE_HD void apply(const Lanes& lanes, int64_t row, const AttentionPair& p, int64_t b, int64_t h0,
                               const float* lse, const float* delta, float* s, float* dp) {
    const int64_t h = row / p.nq, r = row % p.nq, n = visible_keys(p, r), lo = first_visible_key(p, b, r);
    const int64_t i = row_index(p, b, r, h);
    const float row_lse = lse[i], row_delta = delta[i];
    float *s_row = score_row(p, h0, row, s), *dp_row = score_row(p, h0, row, dp);
    for (int64_t c = lanes.lane; c < p.nk; c += lanes.count) {
      s_row[c] = c >= lo && c < n ? exp_approx(s_row[c] - row_lse) : 0.0f;
      dp_row[c] = softmax_grad(s_row[c], dp_row[c], row_delta);
    }
  }
};

// Incremental decoding keeps the keys and values of past positions in a cache
// (B, T_max, 2, H, D) whose tiles (nb, rows, 1, nh, d) have the layout of the key
// and value tiles of qkv, so the steps above read them as they are. A copy moves
// rows [src_row, src_row + n) of each of the nb batch rows of a qkv key or value
// tile (nb, src_rows, width) into rows [dst_row, dst_row + n) of a cache tile
// (nb, dst_rows, width), width = nh * d.
struct CacheCopy {
  int64_t nb, width, src_rows, src_row, dst_rows, dst_row, n;
};

}  // namespace attention

// Online softmax step of the pair: updates o and the (m, l) stats (nb, nq, nh, 2)
// of the query tile with key tile k, v (ForwardRow). `first`: the first key tile;
// o and stats are write-only. scratch: forward_scratch_size(p) floats.
template <Device D>
void attention_forward_step(bool first, const AttentionPair& p, const float* q, const float* k, const float* v,
                            float* o, float* stats, float* scratch);
// o /= l and lse = m + log(l) for `rows` query rows of width d.
template <Device D>
void attention_forward_finish(int64_t rows, int64_t d, const float* stats, float* o, float* lse);
// delta = rowsum(do * o) for `rows` rows of width d.
template <Device D>
void attention_backward_delta(int64_t rows, int64_t d, const float* o, const float* d_o, float* delta);
// Recomputes P = exp(S - lse) for the pair and accumulates
// dv += P^T do, dq += scale dS k, dk += scale dS^T q with dS = P * (do v^T - delta).
// scratch: backward_scratch_size(p) floats.
template <Device D>
void attention_backward_step(const AttentionPair& p, const float* q, const float* k, const float* v, const float* d_o,
                             const float* lse, const float* delta, float* dq, float* dk, float* dv, float* scratch);

// The steps on bfloat16 q, k, v and do, on the GPU (cuBLAS) and the CPU (cpu_bf16_gemm: oneMKL's product on
// AMX, else jnntile's packed one): the products take bfloat16 operands, P and dS rounded to bfloat16 as
// FlashAttention does, and sum in float32; the row passes and o, stats, dq, dk, dv are float32 as in the
// steps above. On AMX, widening the operands for the float32 steps instead left the CPU's products at
// 100-130 GFLOP/s on these thin shapes (head dimension 64) where the bfloat16 ones run 190-350: attention's steps
// took 437 ms per step of SmolLM's shape at 4 x 256, now 237-258 (GPT-2 124M: 276-296 -> 157-162).
// scratch: bf16_scratch_size(p, backward, heads) floats, heads 1 on the CPU and p.nh on the GPU.
template <Device D>
void attention_forward_step_bf16(bool first, const AttentionPair& p, const bfloat16* q, const bfloat16* k,
                                 const bfloat16* v, float* o, float* stats, float* scratch);
template <Device D>
void attention_backward_step_bf16(const AttentionPair& p, const bfloat16* q, const bfloat16* k, const bfloat16* v,
                                  const bfloat16* d_o, const float* lse, const float* delta, float* dq, float* dk,
                                  float* dv, float* scratch);

// Copies keys or values into the cache (attention::CacheCopy). `first`: the copy
// starts at the cache tile's first row (dst_row == 0) and the tile is write-only:
// its rows after the copy are zeroed, so that the rows a step reads beyond the
// current length (masked, but multiplied by P = 0) hold finite values.
template <Device D>
void attention_cache_copy(bool first, const attention::CacheCopy& c, const float* src, float* dst);

}  // namespace jnntile
