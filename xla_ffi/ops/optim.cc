// Optimizer steps that update parameter and moment tiles in place.
//
// An update call takes every parameter of one kind (same weight decay, compute copy and clip): their small
// tiles share tasks (tile_groups in task.h): a GPT-2 block's biases and norm vectors take a task or two.
//
// Per-step values (learning rate, step count) are extra array inputs read at
// submission (DESIGN invariant 4); hyper-parameters that never change are
// attributes. An update may take a global norm as its last id (attribute
// max_norm): it then applies clip_by_global_norm's scale to the gradient as it
// reads it, instead of a clip task rewriting every gradient tile first. An update may also take the
// parameter's compute copy (attribute copy=1, its id after the update's own): the task that writes the
// master writes its bfloat16 copy too, and the next forward's convert finds it fresh (tensor_compute_copy).
#include <cmath>

#include "kernels/optim.h"
#include "ops/values.h"
#include "task.h"

namespace jnntile {
namespace {

// The tile of the global norm an update clips by (a float32 scalar).
starpu_data_handle_t clip_norm(const TiledTensor& norm, const char* op) {
  if (norm.num_tiles() != 1 || norm.numel() != 1 || norm.dtype != DType::F32)
    throw std::invalid_argument(std::string(op) + ": the clip's norm must be a float32 scalar, got " + norm.describe());
  return norm.tiles[0];
}

// The parameter's compute copy when the update writes it (attribute copy), else null.
const TiledTensor* update_copy(const OpCall& call, const TiledTensor& p, size_t own_ids, const char* op) {
  auto copy = call.attrs.get<int64_t>("copy");
  if (copy.has_error() || copy.value() == 0) return nullptr;
  const TiledTensor& c = call.tensor(own_ids);
  if (p.copy_id != c.id || c.dtype != DType::BF16)
    throw std::invalid_argument(std::string(op) + ": " + c.describe() + " is not the bfloat16 compute copy of " +
                                p.describe());
  return &c;
}

// Submits the speculative update of tile t: `buffers` (the update's own), then the copy when given.
template <class Args>
void submit_update(starpu_codelet* cl, std::vector<Buffer> buffers, const TiledTensor& p, const TiledTensor* copy,
                   int64_t t, const Args& args, double flops) {
  if (copy) buffers.push_back({copy->tiles[t], STARPU_W});
  submit_task(cl, buffers, args, flops);
  if (copy) mark_copy_fresh(copy->tiles[t], p.tiles[t]);
}

// The step's hyper-parameters: attributes b1, b2, eps, weight_decay; inputs [lr, step (1-based)].
AdamwStep adamw_step(const OpCall& call) {
  float lr = float(call.input_scalar(0));
  double step = call.input_scalar(1);
  float b1 = float(attr<double>(call.attrs, "b1")), b2 = float(attr<double>(call.attrs, "b2"));
  return {lr, b1, b2, float(attr<double>(call.attrs, "eps")), float(attr<double>(call.attrs, "weight_decay")),
          float(1.0 - std::pow(double(b1), step)), float(1.0 - std::pow(double(b2), step))};
}

// The operands of an in-place update: per parameter its own tensors ([p, g, m, v] for AdamW, [p, g] for
// SGD), then its compute copy (attribute copy=1); after the last parameter, optionally the norm of a clip.
struct UpdateOperands {
  int own;      // tensors per parameter, the copy not counted
  bool copied;  // each parameter's compute copy follows its tensors
  std::vector<std::vector<const TiledTensor*>> params;  // per parameter: its own tensors, then the copy
  starpu_data_handle_t norm = nullptr;

  UpdateOperands(const OpCall& call, int own_tensors, const char* op) : own(own_tensors) {
    auto copy = call.attrs.get<int64_t>("copy");
    copied = !copy.has_error() && copy.value() != 0;
    const size_t stride = size_t(own + copied), count = call.ids.size() / stride;
    if (count == 0 || call.ids.size() % stride > 1)
      throw std::invalid_argument(std::string(op) + ": expected " + std::to_string(stride) +
                                  " tensors per parameter and optionally a scalar norm, got " +
                                  std::to_string(call.ids.size()));
    if (call.ids.size() % stride == 1) norm = clip_norm(call.tensor(call.ids.size() - 1), op);
    for (size_t k = 0; k < count; ++k) {
      std::vector<const TiledTensor*> tensors;
      for (int j = 0; j < own; ++j) tensors.push_back(&call.tensor(k * stride + j));
      for (int j = 1; j < own; ++j) check_same_tiling(*tensors[0], *tensors[j], op);
      if (copied) tensors.push_back(update_copy(call, *tensors[0], k * stride + own, op));
      params.push_back(std::move(tensors));
    }
  }

  // Submits the update: every tile of every parameter, small ones several to a task (tile_groups). A task's
  // buffers: per tile its own tensors' tiles in `modes`, then the copy's; last the norm. `args.layout.tiles`
  // is set per task.
  template <class Args>
  void submit(starpu_codelet* cl, const std::vector<starpu_data_access_mode>& modes, Args args,
              double flops_per_element) const {
    std::vector<std::pair<size_t, int64_t>> tiles;  // (parameter, tile)
    std::vector<int64_t> numel, bytes;
    std::vector<int> owners;
    for (size_t k = 0; k < params.size(); ++k)
      for (int64_t t = 0; t < params[k][0]->num_tiles(); ++t) {
        tiles.push_back({k, t});
        owners.push_back(tile_owner(params[k][0]->tiles[t]));
        numel.push_back(params[k][0]->tile_numel(t));
        bytes.push_back(0);
        for (const TiledTensor* tensor : params[k]) bytes.back() += int64_t(starpu_data_get_size(tensor->tiles[t]));
      }
    for (const std::vector<size_t>& group :
         tile_groups(numel, bytes, small_tile_numel(), task_group_bytes_limit(), owners)) {
      std::vector<Buffer> buffers;
      TaskTiles& task_tiles = args.layout.tiles;
      task_tiles.count = 0;
      for (size_t i : group) {
        auto [k, t] = tiles[i];
        for (int j = 0; j < own; ++j) buffers.push_back({params[k][j]->tiles[t], modes[j]});
        if (copied) buffers.push_back({params[k][own]->tiles[t], STARPU_W});
        task_tiles.numel[task_tiles.count++] = numel[i];
      }
      if (norm) buffers.push_back({norm, STARPU_R});
      submit_task(cl, buffers, args, flops_per_element * double(task_tiles.total()));
      if (copied)
        for (size_t i : group) mark_copy_fresh(params[tiles[i].first][own]->tiles[tiles[i].second],
                                               params[tiles[i].first][0]->tiles[tiles[i].second]);
    }
  }
};

// What a task's kernel needs to find its tiles: per tile `own` buffers and the copy's, then the norm.
struct UpdateLayout {
  TaskTiles tiles;
  int own;
  bool copied, clipped;
  float max_norm;

  float* tensor(void** buffers, int tile, int j) const { return tile_ptr<float>(buffers[tile * stride() + j]); }
  bfloat16* copy(void** buffers, int tile) const {
    return copied ? tile_ptr<bfloat16>(buffers[tile * stride() + own]) : nullptr;
  }
  GradClip clip(void** buffers) const {
    return {clipped ? tile_ptr<float>(buffers[tiles.count * stride()]) : nullptr, max_norm};
  }
  int stride() const { return own + copied; }
};

UpdateLayout update_layout(const OpCall& call, const UpdateOperands& u) {
  return {{}, u.own, u.copied, u.norm != nullptr, float(attr<double>(call.attrs, "max_norm"))};
}

struct AdamwArgs {
  UpdateLayout layout;
  AdamwStep step;
};

template <Device D>
void adamw_kernel(void** buffers, const AdamwArgs& a) {
  const UpdateLayout& l = a.layout;
  GradClip clip = l.clip(buffers);
  for (int i = 0; i < l.tiles.count; ++i)
    adamw<D>(l.tiles.numel[i], a.step, clip, l.tensor(buffers, i, 0), l.tensor(buffers, i, 1), l.tensor(buffers, i, 2),
             l.tensor(buffers, i, 3), l.copy(buffers, i));
}

// ids [p, g, m, v] per parameter, each followed by p's compute copy (attribute copy=1), then optionally a
// norm; inputs [lr, step (1-based)]
void adamw_submit(const OpCall& call) {
  UpdateOperands u(call, 4, "adamw");
  static starpu_codelet* cl = JNNTILE_CODELET(AdamwArgs, adamw_kernel, "adamw");
  u.submit(cl, {STARPU_RW, STARPU_R, STARPU_RW, STARPU_RW}, AdamwArgs{update_layout(call, u), adamw_step(call)}, 10.0);
}
JNNTILE_OP(adamw, adamw_submit);

struct SgdArgs {
  UpdateLayout layout;
  float lr;
};

template <Device D>
void sgd_kernel(void** buffers, const SgdArgs& a) {
  const UpdateLayout& l = a.layout;
  GradClip clip = l.clip(buffers);
  for (int i = 0; i < l.tiles.count; ++i)
    sgd<D>(l.tiles.numel[i], a.lr, clip, l.tensor(buffers, i, 0), l.tensor(buffers, i, 1), l.copy(buffers, i));
}

// ids [p, g] per parameter, each followed by p's compute copy (attribute copy=1), then optionally a norm;
// inputs [lr]
void sgd_submit(const OpCall& call) {
  UpdateOperands u(call, 2, "sgd");
  static starpu_codelet* cl = JNNTILE_CODELET(SgdArgs, sgd_kernel, "sgd");
  u.submit(cl, {STARPU_RW, STARPU_R}, SgdArgs{update_layout(call, u), float(call.input_scalar(0))}, 2.0);
}
JNNTILE_OP(sgd, sgd_submit);

// ---- speculative updates (jnntile.optim's fused update) ----------------------------------------------
//
// A parameter whose gradient is final while the backward still runs is updated at once, so the gradient is
// read in RAM and never swapped; a global-norm clip is not known yet. The update is then written apart
// (into shadow tensors, the parameter and its moments left as they were), unclipped. Once the norm is
// known, the commit makes the shadows the parameter's state by exchanging their tiles (no data moves), after
// replacing the speculative step by the clipped one when the norm clips. The old tiles are invalidated.

// The clip's scale (max_norm / norm) once the norm is computed, or 1 when it does not clip: blocks until the
// backward is done (the watchdog turns a wait that cannot end into an error).
float clip_scale(const TiledTensor& norm, float max_norm) {
  if (norm.num_tiles() != 1 || norm.dtype != DType::F32)
    throw std::invalid_argument("update commit: the norm must be a float32 scalar, got " + norm.describe());
  float value = 0.0f;
  read_to_host(norm.id, &value, sizeof value);
  return clips(value, max_norm) ? max_norm / value : 1.0f;
}

// Makes each shadow its tensor's state and invalidates what the tensor held before.
void exchange(const std::vector<std::pair<const TiledTensor*, const TiledTensor*>>& pairs) {
  for (auto [tensor, shadow] : pairs) {
    tensor_swap_tiles(tensor->id, shadow->id);
    tensor_invalidate(*shadow);
  }
}

struct AdamwApartArgs {
  int64_t n;
  AdamwStep step;
  bool copied;
};

template <Device D>
void adamw_apart_kernel(void** buffers, const AdamwApartArgs& a) {
  adamw_apart<D>(a.n, a.step, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]), tile_ptr<float>(buffers[2]),
                 tile_ptr<float>(buffers[3]), tile_ptr<float>(buffers[4]), tile_ptr<float>(buffers[5]),
                 tile_ptr<float>(buffers[6]), a.copied ? tile_ptr<bfloat16>(buffers[7]) : nullptr);
}

// ids [p, g, m, v, p', m', v'], then the compute copy of p' (attribute copy=1); inputs [lr, step]
void adamw_apart_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(0), &g = call.tensor(1), &m = call.tensor(2), &v = call.tensor(3);
  const TiledTensor &p2 = call.tensor(4), &m2 = call.tensor(5), &v2 = call.tensor(6);
  for (const TiledTensor* t : {&g, &m, &v, &p2, &m2, &v2}) check_same_tiling(p, *t, "adamw_apart");
  const TiledTensor* copy = update_copy(call, p2, 7, "adamw_apart");
  AdamwApartArgs args{0, adamw_step(call), copy != nullptr};
  static starpu_codelet* cl = JNNTILE_CODELET(AdamwApartArgs, adamw_apart_kernel, "adamw_apart");
  for (int64_t t = 0; t < p.num_tiles(); ++t) {
    args.n = p.tile_numel(t);
    std::vector<Buffer> buffers{{p.tiles[t], STARPU_R},   {g.tiles[t], STARPU_R},  {m.tiles[t], STARPU_R},
                                {v.tiles[t], STARPU_R},   {p2.tiles[t], STARPU_W}, {m2.tiles[t], STARPU_W},
                                {v2.tiles[t], STARPU_W}};
    submit_update(cl, buffers, p2, copy, t, args, 10.0 * args.n);
  }
}
JNNTILE_OP(adamw_apart, adamw_apart_submit);

struct AdamwRescaleArgs {
  int64_t n;
  AdamwStep step;
  float scale;
  bool copied;
};

template <Device D>
void adamw_rescale_kernel(void** buffers, const AdamwRescaleArgs& a) {
  adamw_rescale<D>(a.n, a.step, a.scale, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]),
                   tile_ptr<float>(buffers[2]), tile_ptr<float>(buffers[3]), tile_ptr<float>(buffers[4]),
                   tile_ptr<float>(buffers[5]), a.copied ? tile_ptr<bfloat16>(buffers[6]) : nullptr);
}

// ids [norm, p, m, v, p', m', v'], then the compute copies of p and p' (attribute copy=1); inputs [lr, step]
void adamw_commit_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(1), &m = call.tensor(2), &v = call.tensor(3);
  const TiledTensor &p2 = call.tensor(4), &m2 = call.tensor(5), &v2 = call.tensor(6);
  for (const TiledTensor* t : {&m, &v, &p2, &m2, &v2}) check_same_tiling(p, *t, "adamw_commit");
  const TiledTensor* copy = update_copy(call, p, 7, "adamw_commit");
  const TiledTensor* copy2 = update_copy(call, p2, 8, "adamw_commit");
  float scale = clip_scale(call.tensor(0), float(attr<double>(call.attrs, "max_norm")));
  if (scale != 1.0f) {
    AdamwRescaleArgs args{0, adamw_step(call), scale, copy2 != nullptr};
    static starpu_codelet* cl = JNNTILE_CODELET(AdamwRescaleArgs, adamw_rescale_kernel, "adamw_rescale");
    for (int64_t t = 0; t < p.num_tiles(); ++t) {
      args.n = p.tile_numel(t);
      std::vector<Buffer> buffers{{p.tiles[t], STARPU_R},   {m.tiles[t], STARPU_R},   {v.tiles[t], STARPU_R},
                                  {p2.tiles[t], STARPU_RW}, {m2.tiles[t], STARPU_RW}, {v2.tiles[t], STARPU_RW}};
      submit_update(cl, buffers, p2, copy2, t, args, 12.0 * args.n);
    }
  }
  std::vector<std::pair<const TiledTensor*, const TiledTensor*>> pairs{{&p, &p2}, {&m, &m2}, {&v, &v2}};
  if (copy != nullptr) pairs.push_back({copy, copy2});
  exchange(pairs);
}
JNNTILE_OP(adamw_commit, adamw_commit_submit);

struct SgdApartArgs {
  int64_t n;
  float lr;
  bool copied;
};

template <Device D>
void sgd_apart_kernel(void** buffers, const SgdApartArgs& a) {
  sgd_apart<D>(a.n, a.lr, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]), tile_ptr<float>(buffers[2]),
               a.copied ? tile_ptr<bfloat16>(buffers[3]) : nullptr);
}

// ids [p, g, p'], then the compute copy of p' (attribute copy=1); inputs [lr]
void sgd_apart_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(0), &g = call.tensor(1), &p2 = call.tensor(2);
  for (const TiledTensor* t : {&g, &p2}) check_same_tiling(p, *t, "sgd_apart");
  const TiledTensor* copy = update_copy(call, p2, 3, "sgd_apart");
  float lr = float(call.input_scalar(0));
  static starpu_codelet* cl = JNNTILE_CODELET(SgdApartArgs, sgd_apart_kernel, "sgd_apart");
  for (int64_t t = 0; t < p.num_tiles(); ++t)
    submit_update(cl, {{p.tiles[t], STARPU_R}, {g.tiles[t], STARPU_R}, {p2.tiles[t], STARPU_W}}, p2, copy,
                  t, SgdApartArgs{p.tile_numel(t), lr, copy != nullptr}, 2.0 * p.tile_numel(t));
}
JNNTILE_OP(sgd_apart, sgd_apart_submit);

struct SgdRescaleArgs {
  int64_t n;
  float scale;
  bool copied;
};

template <Device D>
void sgd_rescale_kernel(void** buffers, const SgdRescaleArgs& a) {
  sgd_rescale<D>(a.n, a.scale, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]),
                 a.copied ? tile_ptr<bfloat16>(buffers[2]) : nullptr);
}

// ids [norm, p, p'], then the compute copies of p and p' (attribute copy=1)
void sgd_commit_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(1), &p2 = call.tensor(2);
  check_same_tiling(p, p2, "sgd_commit");
  const TiledTensor* copy = update_copy(call, p, 3, "sgd_commit");
  const TiledTensor* copy2 = update_copy(call, p2, 4, "sgd_commit");
  float scale = clip_scale(call.tensor(0), float(attr<double>(call.attrs, "max_norm")));
  if (scale != 1.0f) {
    static starpu_codelet* cl = JNNTILE_CODELET(SgdRescaleArgs, sgd_rescale_kernel, "sgd_rescale");
    for (int64_t t = 0; t < p.num_tiles(); ++t)
      submit_update(cl, {{p.tiles[t], STARPU_R}, {p2.tiles[t], STARPU_RW}}, p2, copy2, t,
                    SgdRescaleArgs{p.tile_numel(t), scale, copy2 != nullptr}, 3.0 * p.tile_numel(t));
  }
  std::vector<std::pair<const TiledTensor*, const TiledTensor*>> pairs{{&p, &p2}};
  if (copy != nullptr) pairs.push_back({copy, copy2});
  exchange(pairs);
}
JNNTILE_OP(sgd_commit, sgd_commit_submit);

struct ClipArgs {
  int64_t n;
  float max_norm;
};

template <Device D>
void clip_kernel(void** buffers, const ClipArgs& a) {
  clip_by_norm<D>(a.n, a.max_norm, tile_ptr<float>(buffers[1]), tile_ptr<float>(buffers[0]));
}

// ids [x_0, ..., x_{n-1}, norm]: x_i *= min(1, max_norm / norm), reading the norm on StarPU.
void clip_submit(const OpCall& call) {
  const TiledTensor& norm = call.tensor(call.ids.size() - 1);
  float max_norm = float(attr<double>(call.attrs, "max_norm"));
  static starpu_codelet* cl = JNNTILE_CODELET(ClipArgs, clip_kernel, "clip_by_norm");
  for (size_t i = 0; i + 1 < call.ids.size(); ++i) {
    const TiledTensor& x = call.tensor(i);
    for (int64_t t = 0; t < x.num_tiles(); ++t)
      submit_task(cl, {{x.tiles[t], STARPU_RW}, {norm.tiles[0], STARPU_R}}, ClipArgs{x.tile_numel(t), max_norm},
                  double(x.tile_numel(t)));
  }
}
JNNTILE_OP(clip_by_norm, clip_submit);

}  // namespace
}  // namespace jnntile
