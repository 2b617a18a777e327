#include "kernels/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace jnntile::cpu {
namespace {

// Keys of the pair visible to query row r (a prefix of the key tile).
int64_t visible_keys(const AttentionPair& p, int64_t r) {
  return std::clamp<int64_t>(p.q0 + r - p.k0 + 1, 0, p.nk);
}

// s = scale * q k^T for head h of batch b: (nq, nk).
void scores(const AttentionPair& p, const float* q, const float* k, float* s) {
  const int64_t ld = p.nh * p.d;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.nq, p.nk, p.d, p.scale, q, ld, k, ld, 0.0f, s, p.nk);
}

}  // namespace

void attention_forward_step(bool first, const AttentionPair& p, const float* q, const float* k, const float* v,
                            float* o, float* stats) {
  const int64_t ld = p.nh * p.d;
  std::vector<float> s(p.nq * p.nk);  // scores, then probabilities: (nq, nk)
  for (int64_t b = 0; b < p.nb; ++b)
    for (int64_t h = 0; h < p.nh; ++h) {
      const int64_t q_off = b * p.nq * ld + h * p.d, kv_off = b * p.nk * ld + h * p.d;
      scores(p, q + q_off, k + kv_off, s.data());
      for (int64_t r = 0; r < p.nq; ++r) {
        float* row = s.data() + r * p.nk;
        float* st = stats + ((b * p.nq + r) * p.nh + h) * 2;  // (m, l)
        if (first) {
          st[0] = -std::numeric_limits<float>::infinity();
          st[1] = 0.0f;
        }
        int64_t n = visible_keys(p, r);
        std::fill(row + n, row + p.nk, 0.0f);  // masked keys: probability 0
        if (n == 0) continue;
        float m = std::max(st[0], *std::max_element(row, row + n));
        double sum = 0.0;
        for (int64_t c = 0; c < n; ++c) {
          row[c] = std::exp(row[c] - m);
          sum += row[c];
        }
        // Rescale what earlier key tiles accumulated to the new max.
        float alpha = std::exp(st[0] - m);
        st[0] = m;
        st[1] = st[1] * alpha + float(sum);
        if (!first) {
          float* o_row = o + q_off + r * ld;
          for (int64_t c = 0; c < p.d; ++c) o_row[c] *= alpha;
        }
      }
      // o += P v (the first step overwrites o, whose tile was never written)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, p.nq, p.d, p.nk, 1.0f, s.data(), p.nk, v + kv_off, ld,
                  first ? 0.0f : 1.0f, o + q_off, ld);
    }
}

void attention_forward_finish(int64_t rows, int64_t d, const float* stats, float* o, float* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    float m = stats[2 * r], l = stats[2 * r + 1];
    float inv = 1.0f / l;
    for (int64_t c = 0; c < d; ++c) o[r * d + c] *= inv;
    lse[r] = m + std::log(l);
  }
}

void attention_backward_delta(int64_t rows, int64_t d, const float* o, const float* d_o, float* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    double acc = 0.0;
    for (int64_t c = 0; c < d; ++c) acc += double(o[r * d + c]) * double(d_o[r * d + c]);
    delta[r] = float(acc);
  }
}

void attention_backward_step(const AttentionPair& p, const float* q, const float* k, const float* v,
                             const float* d_o, const float* lse, const float* delta, float* dq, float* dk, float* dv) {
  const int64_t ld = p.nh * p.d;
  std::vector<float> s(p.nq * p.nk), dp(p.nq * p.nk);  // P, then dS; dP: (nq, nk)
  for (int64_t b = 0; b < p.nb; ++b)
    for (int64_t h = 0; h < p.nh; ++h) {
      const int64_t q_off = b * p.nq * ld + h * p.d, kv_off = b * p.nk * ld + h * p.d;
      scores(p, q + q_off, k + kv_off, s.data());
      for (int64_t r = 0; r < p.nq; ++r) {
        float* row = s.data() + r * p.nk;
        float row_lse = lse[(b * p.nq + r) * p.nh + h];
        int64_t n = visible_keys(p, r);
        for (int64_t c = 0; c < n; ++c) row[c] = std::exp(row[c] - row_lse);
        std::fill(row + n, row + p.nk, 0.0f);
      }
      // dv += P^T do: (nk, d)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, p.nk, p.d, p.nq, 1.0f, s.data(), p.nk, d_o + q_off, ld,
                  1.0f, dv + kv_off, ld);
      // dP = do v^T: (nq, nk)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.nq, p.nk, p.d, 1.0f, d_o + q_off, ld, v + kv_off, ld,
                  0.0f, dp.data(), p.nk);
      // dS = P * (dP - delta), in place of P (masked entries stay 0)
      for (int64_t r = 0; r < p.nq; ++r) {
        float row_delta = delta[(b * p.nq + r) * p.nh + h];
        for (int64_t c = 0; c < p.nk; ++c) s[r * p.nk + c] *= dp[r * p.nk + c] - row_delta;
      }
      // dq += scale dS k: (nq, d);  dk += scale dS^T q: (nk, d)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, p.nq, p.d, p.nk, p.scale, s.data(), p.nk, k + kv_off, ld,
                  1.0f, dq + q_off, ld);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, p.nk, p.d, p.nq, p.scale, s.data(), p.nk, q + q_off, ld,
                  1.0f, dk + kv_off, ld);
    }
}

}  // namespace jnntile::cpu
