// Causal softmax attention on one (query tile, key tile) pair, FlashAttention-2
// style: scores exist only for the pair (nq x nk), never for the sequence.
//
// Tiles keep the (batch, seq, head, head_dim) layout of the model, so head h of
// batch b in a q/k/v/o tile is a (rows, d) matrix with leading dimension nh * d:
//   q, o, do: (nb, nq, nh, d)   k, v: (nb, nk, nh, d)
// and per-row values (stats, lse, delta) are (nb, nq, nh). q0 and k0 are the
// sequence positions of the first query and key: key k0 + c is visible to
// query q0 + r when k0 + c <= q0 + r.
#pragma once
#include <cstdint>

namespace jnntile::cpu {

struct AttentionPair {
  int64_t nb, nh, nq, nk, d;  // tile extents
  int64_t q0, k0;             // sequence positions of the first query and key
  float scale;                // softmax scale, 1 / sqrt(d)
};

// Online softmax step: stats (nb, nq, nh, 2) hold the running max m and sum l
// per query row, o the unnormalised output. `first` initialises both (their
// first access is write-only).
void attention_forward_step(bool first, const AttentionPair& p, const float* q, const float* k, const float* v,
                            float* o, float* stats);
// o /= l and lse = m + log(l) for `rows` query rows of width d.
void attention_forward_finish(int64_t rows, int64_t d, const float* stats, float* o, float* lse);
// delta = rowsum(do * o) for `rows` rows of width d.
void attention_backward_delta(int64_t rows, int64_t d, const float* o, const float* d_o, float* delta);
// Recomputes P = exp(S - lse) for the pair and accumulates
// dv += P^T do, dq += scale dS k, dk += scale dS^T q with dS = P * (do v^T - delta).
void attention_backward_step(const AttentionPair& p, const float* q, const float* k, const float* v,
                             const float* d_o, const float* lse, const float* delta, float* dq, float* dk, float* dv);

}  // namespace jnntile::cpu
