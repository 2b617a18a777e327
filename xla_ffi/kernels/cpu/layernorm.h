// Layer normalization over the last axis, one tile at a time; no StarPU here.
//
// The normalized axis C may be split into several tiles, so per-row statistics
// are built from per-tile partials (in double) and combined. In every kernel a
// tile is (rows, n): `rows` rows of x, each with the `n` columns of this C tile.
// stats: (rows, 2) float, per row (mean, rstd) with rstd = 1 / sqrt(var + eps).
#pragma once
#include <cstdint>

namespace jnntile::cpu {

// partial: (rows, 2) per row the tile's mean and M2 (sum of squared deviations
// from that mean), so combining tiles does not cancel (Chan et al.).
void layernorm_partial(int64_t rows, int64_t n, const float* x, double* partial);

// Combines the partials of `count` tiles of widths `widths` into stats.
void layernorm_stats(int64_t rows, int64_t count, const double* const* partials, const int64_t* widths, double eps,
                     float* stats);

// y = (x - mean) * rstd * w + b;  w, b: (n,)
void layernorm_normalize(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                         const float* b, float* y);

// Backward, with xhat = (x - mean) * rstd and g = dy * w:
// partial: (rows, 2) per row the tile's sums of g and g * xhat.
void layernorm_backward_partial(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                                const float* dy, double* partial);

// sums: (rows, 2) the sums of the `count` partials.
void layernorm_backward_combine(int64_t rows, int64_t count, const double* const* partials, double* sums);

// dx += rstd * (g - sum(g) / c - xhat * sum(g * xhat) / c), `c` the whole normalized axis.
void layernorm_backward_dx(int64_t rows, int64_t n, int64_t c, const float* x, const float* stats, const float* w,
                           const float* dy, const double* sums, float* dx);

// dw += sum over rows of dy * xhat, db += sum over rows of dy (either may be null).
void layernorm_backward_params(int64_t rows, int64_t n, const float* x, const float* stats, const float* dy,
                               float* dw, float* db);

}  // namespace jnntile::cpu
