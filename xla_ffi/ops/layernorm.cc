// Layer normalization over the last axis: y = (x - mean) / sqrt(var + eps) * w + b,
// and RMS normalization (attribute centered = 0, no b): y = x / sqrt(mean(x^2) + eps) * w,
// with the mean taken as 0 throughout (kernels/layernorm.h).
//
// x: (..., C) tile (..., tc); w, b: (C,) tile (tc,); y like x; stats: (..., 2)
// tile (..., 2) holds per row (mean, rstd), the residual of the backward. The
// C axis may have K > 1 tiles, so each leading tile L (the tiles of x that
// share leading coordinates, linear indices L*K .. L*K+K-1) is done in steps:
//   forward:  per C tile a partial (mean, M2) into scratch; one combine task
//             writes stats; per C tile a normalize task writes y.
//   backward: per C tile partial sums of g = dy*w and g*xhat into scratch; one
//             combine task; per C tile dx += ...; and dw, db accumulate the
//             sums over leading axes in one RW chain per C tile over L.
// Leading tiles are independent and run in parallel. The combine tasks get a
// scratch of K pointers: on a GPU they read the partials through a device copy.
// Where C is one tile (K = 1: GPT-2 124M's 768 and every width up to 1024 on
// CPUs, 4096 with a GPU) a leading tile's forward is one task (partial, stats
// and normalize in turn, the partial in its scratch) and so is its dx (partial,
// then dx from it: the sums of one partial are the partial): 200 of GPT-2
// 124M's 2,049 tasks per step at 4 x 256 in bfloat16 were the steps between.
#include <algorithm>

#include "kernels/layernorm.h"
#include "task.h"

namespace jnntile {
namespace {

struct TileArgs {
  FloatType type;  // of x, y, dy and dx; w, b, their gradients and the stats are float32
  int64_t rows;   // rows in the leading tile
  int64_t n;      // width of this C tile
  int64_t c;      // the whole normalized axis
  bool centered;  // false: RMS normalization
};

struct CombineArgs {
  int64_t rows;
  int64_t count;  // C tiles
  int64_t tile_c, c;
  double eps;
};

struct ParamsArgs {
  FloatType type;
  int64_t rows, n;
  bool has_dw, has_db;
  bool overwrite;  // dw and db hold nothing yet: the first row tile's task writes them
};

// buffers: x, partial
template <Device D>
void partial_kernel(void** buffers, const TileArgs& a) {
  layernorm_partial<D>(a.type, a.rows, a.n, a.centered, tile_ptr<void>(buffers[0]), tile_ptr<double>(buffers[1]));
}

std::vector<const double*> partials(void** buffers, int64_t count) {
  std::vector<const double*> p(count);
  for (int64_t k = 0; k < count; ++k) p[k] = tile_ptr<double>(buffers[k]);
  return p;
}

// buffers: count partials, stats, scratch (count pointers)
template <Device D>
void stats_kernel(void** buffers, const CombineArgs& a) {
  layernorm_stats<D>(a.rows, a.count, partials(buffers, a.count).data(), a.tile_c, a.c, a.eps,
                     tile_ptr<float>(buffers[a.count]), tile_ptr<void>(buffers[a.count + 1]));
}

// buffers: x, stats, w, b (where centered), y
template <Device D>
void normalize_kernel(void** buffers, const TileArgs& a) {
  const float* b = a.centered ? tile_ptr<float>(buffers[3]) : nullptr;
  layernorm_normalize<D>(a.type, a.rows, a.n, tile_ptr<void>(buffers[0]), tile_ptr<float>(buffers[1]),
                         tile_ptr<float>(buffers[2]), b, tile_ptr<void>(buffers[a.centered ? 4 : 3]));
}

// buffers: x, stats, w, dy, partial
template <Device D>
void backward_partial_kernel(void** buffers, const TileArgs& a) {
  layernorm_backward_partial<D>(a.type, a.rows, a.n, tile_ptr<void>(buffers[0]), tile_ptr<float>(buffers[1]),
                                tile_ptr<float>(buffers[2]), tile_ptr<void>(buffers[3]),
                                tile_ptr<double>(buffers[4]));
}

// buffers: count partials, sums, scratch (count pointers)
template <Device D>
void backward_combine_kernel(void** buffers, const CombineArgs& a) {
  layernorm_backward_combine<D>(a.rows, a.count, partials(buffers, a.count).data(),
                                tile_ptr<double>(buffers[a.count]), tile_ptr<void>(buffers[a.count + 1]));
}

// buffers: x, stats, w, dy, sums, dx
template <Device D>
void backward_dx_kernel(void** buffers, const TileArgs& a) {
  layernorm_backward_dx<D>(a.type, a.rows, a.n, a.c, a.centered, tile_ptr<void>(buffers[0]),
                           tile_ptr<float>(buffers[1]), tile_ptr<float>(buffers[2]), tile_ptr<void>(buffers[3]),
                           tile_ptr<double>(buffers[4]), tile_ptr<void>(buffers[5]));
}

// buffers: x, stats, dy, then dw and/or db
template <Device D>
void backward_params_kernel(void** buffers, const ParamsArgs& a) {
  float* dw = a.has_dw ? tile_ptr<float>(buffers[3]) : nullptr;
  float* db = a.has_db ? tile_ptr<float>(buffers[a.has_dw ? 4 : 3]) : nullptr;
  layernorm_backward_params<D>(a.type, a.rows, a.n, a.overwrite, tile_ptr<void>(buffers[0]),
                               tile_ptr<float>(buffers[1]), tile_ptr<void>(buffers[2]), dw, db);
}

struct WholeRowsArgs {
  FloatType type;
  int64_t rows, c;
  double eps;
  bool centered;
};

// One leading tile's forward where C is one tile. buffers: x, w, b (where centered), y, stats, scratch (the
// partial, 2 * rows doubles, then the one pointer to it that layernorm_stats takes on a GPU).
template <Device D>
void whole_rows_forward_kernel(void** buffers, const WholeRowsArgs& a) {
  const int y_index = a.centered ? 3 : 2;
  const void* x = tile_ptr<void>(buffers[0]);
  float* stats = tile_ptr<float>(buffers[y_index + 1]);
  double* partial = tile_ptr<double>(buffers[y_index + 2]);
  layernorm_partial<D>(a.type, a.rows, a.c, a.centered, x, partial);
  const double* const partials[1] = {partial};
  layernorm_stats<D>(a.rows, 1, partials, a.c, a.c, a.eps, stats, partial + 2 * a.rows);
  layernorm_normalize<D>(a.type, a.rows, a.c, x, stats, tile_ptr<float>(buffers[1]),
                         a.centered ? tile_ptr<float>(buffers[2]) : nullptr, tile_ptr<void>(buffers[y_index]));
}

// One leading tile's dx where C is one tile. buffers: x, stats, w, dy, dx, scratch (the partial, 2 * rows
// doubles).
template <Device D>
void whole_rows_backward_dx_kernel(void** buffers, const TileArgs& a) {
  double* partial = tile_ptr<double>(buffers[5]);
  const void *x = tile_ptr<void>(buffers[0]), *dy = tile_ptr<void>(buffers[3]);
  const float *stats = tile_ptr<float>(buffers[1]), *w = tile_ptr<float>(buffers[2]);
  layernorm_backward_rows<D>(a.type, a.rows, a.n, a.centered, x, stats, w, dy, partial, tile_ptr<void>(buffers[4]));
}

// The tiling shared by x, a (C,) parameter and the stats tensor.
struct Layout {
  FloatType type;  // x's
  int64_t k_tiles, lead_tiles, tile_c, c;
  int64_t rows(const TiledTensor& x, int64_t lead) const { return x.tile_numel(lead * k_tiles) / tile_c; }
  int64_t width(int64_t k) const { return std::min(tile_c, c - k * tile_c); }
};

Layout check_layout(const TiledTensor& x, const TiledTensor& w, const char* op) {
  if ((x.dtype != DType::F32 && x.dtype != DType::BF16) || w.dtype != DType::F32 || x.ndim() < 1 || w.ndim() != 1 ||
      w.shape[0] != x.shape.back() || w.tile_shape[0] != x.tile_shape.back())
    throw std::invalid_argument(std::string(op) + ": needs float32 or bfloat16 x (..., C) and float32 (C,) "
                                "parameters tiled like x's last axis: " + x.describe() + ", " + w.describe());
  return Layout{float_type(x, op), x.grid.back(), x.num_tiles() / x.grid.back(), x.tile_shape.back(), x.shape.back()};
}

// y, dy or dx: tiled like x and of x's dtype.
void check_like_x(const TiledTensor& x, const TiledTensor& t, const char* op) {
  check_same_tiling(x, t, op);
  if (t.dtype != x.dtype) throw std::invalid_argument(std::string(op) + ": dtype differs from x's: " + t.describe());
}

void check_stats(const TiledTensor& x, const TiledTensor& stats, const char* op) {
  Index shape(x.shape.begin(), x.shape.end() - 1), tile_shape(x.tile_shape.begin(), x.tile_shape.end() - 1);
  shape.push_back(2);
  tile_shape.push_back(2);
  if (stats.dtype != DType::F32 || stats.shape != shape || stats.tile_shape != tile_shape)
    throw std::invalid_argument(std::string(op) + ": stats must be float32 (..., 2) tiled like x's leading axes: " +
                                stats.describe() + " for " + x.describe());
}

// ids [x, w, b or -1, y, stats or -1]; attrs eps, centered (b is -1 exactly when not centered). Without
// stats (no backward will follow) the per-row statistics live in scratch.
void layernorm_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &w = call.tensor(1), &y = call.tensor(3);
  const bool centered = attr<int64_t>(call.attrs, "centered") != 0;
  if (centered != (call.ids[2] >= 0)) throw std::invalid_argument("layer_norm: a bias exactly when centered");
  Layout l = check_layout(x, w, "layer_norm");
  if (centered) check_layout(x, call.tensor(2), "layer_norm");
  check_like_x(x, y, "layer_norm");
  bool keep_stats = call.ids[4] >= 0;
  if (keep_stats) check_stats(x, call.tensor(4), "layer_norm");
  double eps = attr<double>(call.attrs, "eps");
  static starpu_codelet* partial_cl = JNNTILE_CODELET(TileArgs, partial_kernel, "layer_norm_partial");
  static starpu_codelet* stats_cl = JNNTILE_CODELET(CombineArgs, stats_kernel, "layer_norm_stats");
  static starpu_codelet* normalize_cl = JNNTILE_CODELET(TileArgs, normalize_kernel, "layer_norm_normalize");
  static starpu_codelet* whole_cl = JNNTILE_CODELET(WholeRowsArgs, whole_rows_forward_kernel, "layer_norm");
  for (int64_t lead = 0; lead < l.lead_tiles; ++lead) {
    int64_t rows = l.rows(x, lead);
    starpu_data_handle_t stats = keep_stats ? call.tensor(4).tiles[lead] : temporary_vector(2 * rows, sizeof(float));
    if (l.k_tiles == 1) {
      std::vector<Buffer> buffers{{x.tiles[lead], STARPU_R}, {w.tiles[0], STARPU_R}};
      if (centered) buffers.push_back({call.tensor(2).tiles[0], STARPU_R});
      buffers.push_back({y.tiles[lead], STARPU_W});
      buffers.push_back({stats, STARPU_W});
      starpu_data_handle_t scratch = temporary_vector(2 * rows + 1, sizeof(double));
      buffers.push_back({scratch, STARPU_SCRATCH});
      submit_task(whole_cl, buffers, WholeRowsArgs{l.type, rows, l.c, eps, centered}, 7.0 * rows * l.c);
      starpu_data_unregister_submit(scratch);
      if (!keep_stats) starpu_data_unregister_submit(stats);
      continue;
    }
    std::vector<Buffer> combine;
    for (int64_t k = 0; k < l.k_tiles; ++k) {
      starpu_data_handle_t partial = temporary_vector(2 * rows, sizeof(double));
      submit_task(partial_cl, {{x.tiles[lead * l.k_tiles + k], STARPU_R}, {partial, STARPU_W}},
                  TileArgs{l.type, rows, l.width(k), l.c, centered}, 3.0 * rows * l.width(k));
      combine.push_back({partial, STARPU_R});
    }
    starpu_data_handle_t pointers = temporary_vector(l.k_tiles, sizeof(void*));
    combine.push_back({stats, STARPU_W});
    combine.push_back({pointers, STARPU_SCRATCH});
    submit_task(stats_cl, combine, CombineArgs{rows, l.k_tiles, l.tile_c, l.c, eps});
    for (int64_t k = 0; k < l.k_tiles; ++k) {
      int64_t t = lead * l.k_tiles + k;
      std::vector<Buffer> buffers{{x.tiles[t], STARPU_R}, {stats, STARPU_R}, {w.tiles[k], STARPU_R}};
      if (centered) buffers.push_back({call.tensor(2).tiles[k], STARPU_R});
      buffers.push_back({y.tiles[t], STARPU_W});
      submit_task(normalize_cl, buffers, TileArgs{l.type, rows, l.width(k), l.c, centered}, 4.0 * rows * l.width(k));
    }
    for (int64_t k = 0; k < l.k_tiles; ++k) starpu_data_unregister_submit(combine[k].handle);
    starpu_data_unregister_submit(pointers);
    if (!keep_stats) starpu_data_unregister_submit(stats);
  }
}
JNNTILE_OP(layer_norm, layernorm_submit);

// ids [x, w, stats, dy, dx or -1, dw or -1, db or -1]; attr centered: accumulates the gradients that are given
// (attr fresh_params: dw and db hold nothing yet, their zero-fills were pending: written instead).
void layernorm_backward_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &w = call.tensor(1), &stats = call.tensor(2), &dy = call.tensor(3);
  const bool centered = attr<int64_t>(call.attrs, "centered") != 0;
  Layout l = check_layout(x, w, "layer_norm backward");
  check_stats(x, stats, "layer_norm backward");
  check_like_x(x, dy, "layer_norm backward");
  bool has_dx = call.ids[4] >= 0, has_dw = call.ids[5] >= 0, has_db = call.ids[6] >= 0;
  bool fresh_params = attr<int64_t>(call.attrs, "fresh_params") != 0;
  if (has_dx) check_like_x(x, call.tensor(4), "layer_norm backward");
  if (has_dw) check_layout(x, call.tensor(5), "layer_norm backward");
  if (has_db) check_layout(x, call.tensor(6), "layer_norm backward");
  static starpu_codelet* partial_cl = JNNTILE_CODELET(TileArgs, backward_partial_kernel, "layer_norm_backward_partial");
  static starpu_codelet* combine_cl =
      JNNTILE_CODELET(CombineArgs, backward_combine_kernel, "layer_norm_backward_combine");
  static starpu_codelet* dx_cl = JNNTILE_CODELET(TileArgs, backward_dx_kernel, "layer_norm_backward_dx");
  static starpu_codelet* params_cl = JNNTILE_CODELET(ParamsArgs, backward_params_kernel, "layer_norm_backward_params");
  static starpu_codelet* whole_dx_cl = JNNTILE_CODELET(TileArgs, whole_rows_backward_dx_kernel, "layer_norm_backward");
  for (int64_t lead = 0; lead < l.lead_tiles; ++lead) {
    int64_t rows = l.rows(x, lead);
    if (has_dx && l.k_tiles == 1) {
      starpu_data_handle_t scratch = temporary_vector(2 * rows, sizeof(double));
      submit_task(whole_dx_cl,
                  {{x.tiles[lead], STARPU_R}, {stats.tiles[lead], STARPU_R}, {w.tiles[0], STARPU_R},
                   {dy.tiles[lead], STARPU_R}, {call.tensor(4).tiles[lead], STARPU_RW}, {scratch, STARPU_SCRATCH}},
                  TileArgs{l.type, rows, l.c, l.c, centered}, 14.0 * rows * l.c);
      starpu_data_unregister_submit(scratch);
    } else if (has_dx) {
      std::vector<Buffer> combine;
      for (int64_t k = 0; k < l.k_tiles; ++k) {
        int64_t t = lead * l.k_tiles + k;
        starpu_data_handle_t partial = temporary_vector(2 * rows, sizeof(double));
        submit_task(partial_cl,
                    {{x.tiles[t], STARPU_R}, {stats.tiles[lead], STARPU_R}, {w.tiles[k], STARPU_R},
                     {dy.tiles[t], STARPU_R}, {partial, STARPU_W}},
                    TileArgs{l.type, rows, l.width(k), l.c, centered}, 6.0 * rows * l.width(k));
        combine.push_back({partial, STARPU_R});
      }
      starpu_data_handle_t sums = temporary_vector(2 * rows, sizeof(double));
      combine.push_back({sums, STARPU_W});
      combine.push_back({temporary_vector(l.k_tiles, sizeof(void*)), STARPU_SCRATCH});
      submit_task(combine_cl, combine, CombineArgs{rows, l.k_tiles, l.tile_c, l.c, 0.0});
      for (int64_t k = 0; k < l.k_tiles; ++k) {
        int64_t t = lead * l.k_tiles + k;
        submit_task(dx_cl,
                    {{x.tiles[t], STARPU_R}, {stats.tiles[lead], STARPU_R}, {w.tiles[k], STARPU_R},
                     {dy.tiles[t], STARPU_R}, {sums, STARPU_R}, {call.tensor(4).tiles[t], STARPU_RW}},
                    TileArgs{l.type, rows, l.width(k), l.c, centered}, 8.0 * rows * l.width(k));
      }
      for (const Buffer& buffer : combine) starpu_data_unregister_submit(buffer.handle);
    }
    if (has_dw || has_db) {
      for (int64_t k = 0; k < l.k_tiles; ++k) {
        int64_t t = lead * l.k_tiles + k;
        bool overwrite = fresh_params && lead == 0;
        starpu_data_access_mode mode = overwrite ? STARPU_W : STARPU_RW;
        std::vector<Buffer> buffers{{x.tiles[t], STARPU_R}, {stats.tiles[lead], STARPU_R}, {dy.tiles[t], STARPU_R}};
        if (has_dw) buffers.push_back({call.tensor(5).tiles[k], mode});
        if (has_db) buffers.push_back({call.tensor(6).tiles[k], mode});
        submit_task(params_cl, buffers, ParamsArgs{l.type, rows, l.width(k), has_dw, has_db, overwrite},
                    5.0 * rows * l.width(k));
      }
    }
  }
}
JNNTILE_OP(layer_norm_backward, layernorm_backward_submit);

}  // namespace
}  // namespace jnntile
