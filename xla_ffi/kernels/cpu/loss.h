// Cross-entropy fused with softmax over a vocabulary axis that may be tiled.
//
// A logits tile is (rows, nv): rows = tb * tt tokens, nv vocabulary entries
// starting at v0. Per row the forward keeps stats (m, s, z): the running max,
// the sum of exp(x - m) and the logit of the target (0 until the vocabulary
// tile that holds the target is seen).
#pragma once
#include <cstdint>

namespace jnntile::cpu {

constexpr int kCrossEntropyStats = 3;  // m, s, z per row

// Online max-sum-exp over one vocabulary tile. stats: (rows, 3) double;
// `first` initialises them (the tile's first access is write-only).
void cross_entropy_stats(bool first, int64_t rows, int64_t nv, int64_t v0, const float* logits,
                         const int32_t* targets, double* stats);
// lse[r] = m + log(s); partial = {sum of lse - z, count} over rows whose
// target != ignore_index.
void cross_entropy_finish(int64_t rows, const double* stats, const int32_t* targets, int32_t ignore_index,
                          float* lse, double* partial);
// dlogits[r, c] += scale * (softmax - onehot(target)) for rows whose target
// != ignore_index (scale = dloss / count); ignored rows get nothing.
void cross_entropy_backward(int64_t rows, int64_t nv, int64_t v0, const float* logits, const int32_t* targets,
                            const float* lse, int32_t ignore_index, float scale, float* dlogits);

}  // namespace jnntile::cpu
