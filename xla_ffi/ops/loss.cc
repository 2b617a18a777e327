// Cross-entropy fused with softmax: logits (B, T, V) tiles (tb, tt, tv),
// targets int32 (B, T) tiles (tb, tt), loss = mean over non-ignored tokens of
// logsumexp(logits) - logits[target].
//
// Forward, per token tile (tb, tt): one task per vocabulary tile updates the
// row stats (running max, sum of exp, target logit) in a scratch handle (the
// first write-only), a finish task writes logsumexp (kept for the backward)
// and a partial (loss sum, count) in double, and one combine task over all
// token tiles writes the mean and 1 / count (on a GPU it reads the partials
// through a device copy of their pointers, in a scratch). Token tiles run in
// parallel. The backward reads dloss and 1 / count inside its kernel: on a GPU
// they are in device memory.
//
// A target outside [0, V) that is not ignore_index contributes only its
// logsumexp (no logit is subtracted, no one-hot in the gradient): the model
// validates token ids before they arrive; this only keeps bad ids from
// reading out of bounds.
#include "kernels/loss.h"
#include "task.h"

namespace jnntile {
namespace {

struct StatsArgs {
  FloatType type;  // of the logits
  bool first;
  int64_t rows, nv, v0;
};

// buffers: logits, targets, stats
template <Device D>
void stats_kernel(void** buffers, const StatsArgs& a) {
  cross_entropy_stats<D>(a.type, a.first, a.rows, a.nv, a.v0, tile_ptr<void>(buffers[0]),
                         tile_ptr<int32_t>(buffers[1]), tile_ptr<double>(buffers[2]));
}

struct FinishArgs {
  int64_t rows;
  int32_t ignore_index;
};

// buffers: stats, targets, lse, partial
template <Device D>
void finish_kernel(void** buffers, const FinishArgs& a) {
  cross_entropy_finish<D>(a.rows, tile_ptr<double>(buffers[0]), tile_ptr<int32_t>(buffers[1]), a.ignore_index,
                          tile_ptr<float>(buffers[2]), tile_ptr<double>(buffers[3]));
}

struct CombineArgs {
  int64_t count;  // token tiles
};

// buffers: partial (sum, count) per token tile, then loss, inv_count, scratch (count pointers).
template <Device D>
void combine_kernel(void** buffers, const CombineArgs& a) {
  std::vector<const double*> partials(a.count);
  for (int64_t i = 0; i < a.count; ++i) partials[i] = tile_ptr<double>(buffers[i]);
  cross_entropy_combine<D>(a.count, partials.data(), tile_ptr<float>(buffers[a.count]),
                           tile_ptr<float>(buffers[a.count + 1]), tile_ptr<void>(buffers[a.count + 2]));
}

struct BackwardArgs {
  FloatType type;  // of the logits and their gradient
  int64_t rows, nv, v0;
  int32_t ignore_index;
  bool overwrite;  // dlogits holds nothing yet
};

// buffers: logits, targets, lse, inv_count, dloss, dlogits (RW, or W with overwrite)
template <Device D>
void backward_kernel(void** buffers, const BackwardArgs& a) {
  cross_entropy_backward<D>(a.type, a.rows, a.nv, a.v0, a.overwrite, tile_ptr<void>(buffers[0]),
                            tile_ptr<int32_t>(buffers[1]), tile_ptr<float>(buffers[2]), a.ignore_index,
                            tile_ptr<float>(buffers[3]), tile_ptr<float>(buffers[4]), tile_ptr<void>(buffers[5]));
}

// Checks logits (B, T, V) float32 or bfloat16, targets (B, T) i32 and a per-token tensor
// `rows` (B, T) f32 tiled like the logits on (B, T); returns the logits' float type.
FloatType check_layout(const TiledTensor& logits, const TiledTensor& targets, const TiledTensor& rows, const char* op) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(op) + ": " + why + ": logits " + logits.describe() + ", targets " +
                                targets.describe() + ", per-token " + rows.describe());
  };
  if ((logits.dtype != DType::F32 && logits.dtype != DType::BF16) || logits.ndim() != 3)
    fail("logits must be float32 or bfloat16 (B, T, V)");
  if (targets.dtype != DType::I32) fail("targets must be int32");
  Index bt(logits.shape.begin(), logits.shape.begin() + 2);
  Index bt_tiles(logits.tile_shape.begin(), logits.tile_shape.begin() + 2);
  if (targets.shape != bt || targets.tile_shape != bt_tiles) fail("targets must be tiled like the logits on (B, T)");
  if (rows.dtype != DType::F32 || rows.shape != bt || rows.tile_shape != bt_tiles)
    fail("per-token tensor must be float32 tiled like the logits on (B, T)");
  return float_type(logits, op);
}

// Rows (tokens) in the token tile `tok` = (ib, it) of the logits.
int64_t tile_rows(const TiledTensor& logits, int64_t ib, int64_t it) {
  Index ext = logits.tile_extent({ib, it, 0});
  return ext[0] * ext[1];
}

// ids [logits, targets, loss, lse, inv_count], attr ignore_index.
void cross_entropy_submit(const OpCall& call) {
  const TiledTensor &logits = call.tensor(0), &targets = call.tensor(1), &loss = call.tensor(2),
                    &lse = call.tensor(3), &inv_count = call.tensor(4);
  FloatType type = check_layout(logits, targets, lse, "cross_entropy");
  if (loss.numel() != 1 || inv_count.numel() != 1 || loss.dtype != DType::F32 || inv_count.dtype != DType::F32)
    throw std::invalid_argument("cross_entropy: loss and inv_count must be float32 scalars");
  auto ignore_index = int32_t(attr<int64_t>(call.attrs, "ignore_index"));
  static starpu_codelet* stats_cl = JNNTILE_CODELET(StatsArgs, stats_kernel, "cross_entropy_stats");
  static starpu_codelet* finish_cl = JNNTILE_CODELET(FinishArgs, finish_kernel, "cross_entropy_finish");
  static starpu_codelet* combine_cl = JNNTILE_CODELET(CombineArgs, combine_kernel, "cross_entropy_combine");
  const int64_t gb = logits.grid[0], gt = logits.grid[1], gv = logits.grid[2];
  std::vector<Buffer> combine_buffers;
  for (int64_t ib = 0; ib < gb; ++ib)
    for (int64_t it = 0; it < gt; ++it) {
      int64_t rows = tile_rows(logits, ib, it);
      // stats: (rows, 3) double, scratch of this token tile
      starpu_data_handle_t stats = temporary_vector(rows * kCrossEntropyStats, sizeof(double));
      starpu_data_handle_t partial = temporary_vector(2, sizeof(double));
      starpu_data_handle_t target_tile = targets.tile({ib, it});
      for (int64_t iv = 0; iv < gv; ++iv) {
        int64_t nv = logits.tile_extent({ib, it, iv})[2];
        starpu_data_access_mode stats_mode = iv == 0 ? STARPU_W : STARPU_RW;
        submit_task(stats_cl, {{logits.tile({ib, it, iv}), STARPU_R}, {target_tile, STARPU_R}, {stats, stats_mode}},
                    StatsArgs{type, iv == 0, rows, nv, iv * logits.tile_shape[2]}, 3.0 * rows * nv);
      }
      submit_task(finish_cl,
                  {{stats, STARPU_R}, {target_tile, STARPU_R}, {lse.tile({ib, it}), STARPU_W}, {partial, STARPU_W}},
                  FinishArgs{rows, ignore_index}, 2.0 * rows);
      starpu_data_unregister_submit(stats);
      combine_buffers.push_back({partial, STARPU_R});
    }
  int64_t n_partials = int64_t(combine_buffers.size());
  starpu_data_handle_t pointers = temporary_vector(n_partials, sizeof(void*));
  combine_buffers.push_back({loss.tiles[0], STARPU_W});
  combine_buffers.push_back({inv_count.tiles[0], STARPU_W});
  combine_buffers.push_back({pointers, STARPU_SCRATCH});
  submit_task(combine_cl, combine_buffers, CombineArgs{n_partials}, double(n_partials));
  for (int64_t i = 0; i < n_partials; ++i) starpu_data_unregister_submit(combine_buffers[i].handle);
  starpu_data_unregister_submit(pointers);
}
JNNTILE_OP(cross_entropy, cross_entropy_submit);

// ids [logits, targets, lse, inv_count, dloss, dlogits or -1], attr ignore_index:
// dlogits += dloss / count * (softmax - onehot(target)) on non-ignored rows.
void cross_entropy_backward_submit(const OpCall& call) {
  if (call.ids.size() != 6) throw std::invalid_argument("cross_entropy backward: needs 6 tensor ids");
  if (call.ids[5] < 0) return;  // nobody differentiates the logits
  const TiledTensor &logits = call.tensor(0), &targets = call.tensor(1), &lse = call.tensor(2),
                    &inv_count = call.tensor(3), &dloss = call.tensor(4), &dlogits = call.tensor(5);
  FloatType type = check_layout(logits, targets, lse, "cross_entropy backward");
  check_same_tiling(logits, dlogits, "cross_entropy backward");
  if (dlogits.dtype != logits.dtype)
    throw std::invalid_argument("cross_entropy backward: dlogits must have the logits' dtype: " + dlogits.describe());
  auto ignore_index = int32_t(attr<int64_t>(call.attrs, "ignore_index"));
  bool fresh = attr<int64_t>(call.attrs, "fresh_dlogits") != 0;  // its zero-fill was pending: write it
  static starpu_codelet* cl = JNNTILE_CODELET(BackwardArgs, backward_kernel, "cross_entropy_backward");
  for (int64_t t = 0; t < logits.num_tiles(); ++t) {
    Index coord = logits.tile_coord(t), ext = logits.tile_extent(coord);
    Index tok{coord[0], coord[1]};
    int64_t rows = ext[0] * ext[1], nv = ext[2];
    submit_task(cl,
                {{logits.tiles[t], STARPU_R}, {targets.tile(tok), STARPU_R}, {lse.tile(tok), STARPU_R},
                 {inv_count.tiles[0], STARPU_R}, {dloss.tiles[0], STARPU_R},
                 {dlogits.tiles[t], fresh ? STARPU_W : STARPU_RW}},
                BackwardArgs{type, rows, nv, coord[2] * logits.tile_shape[2], ignore_index, fresh}, 4.0 * rows * nv);
  }
}
JNNTILE_OP(cross_entropy_backward, cross_entropy_backward_submit);

}  // namespace
}  // namespace jnntile
