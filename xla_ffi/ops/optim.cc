// Optimizer steps that update parameter and moment tiles in place.
//
// Per-step values (learning rate, step count) are extra array inputs read at
// submission (DESIGN invariant 4); hyper-parameters that never change are
// attributes. An update may take a global norm as its last id (attribute
// max_norm): it then applies clip_by_global_norm's scale to the gradient as it
// reads it, instead of a clip task rewriting every gradient tile first.
#include <cmath>

#include "kernels/optim.h"
#include "task.h"

namespace jnntile {
namespace {

// The norm's tile when an update clips (ids: the update's own, then the norm), else null.
starpu_data_handle_t clip_norm(const OpCall& call, size_t own_ids) {
  if (call.ids.size() == own_ids) return nullptr;
  const TiledTensor& norm = call.tensor(own_ids);
  if (call.ids.size() != own_ids + 1 || norm.num_tiles() != 1)
    throw std::invalid_argument("optimizer update: expected " + std::to_string(own_ids) +
                                " tensors and optionally a scalar norm, got " + std::to_string(call.ids.size()));
  return norm.tiles[0];
}

// The kernel's clip: the norm is the buffer after the update's own ones.
GradClip grad_clip(void** buffers, int own_buffers, float max_norm, bool clipped) {
  return {clipped ? tile_ptr<float>(buffers[own_buffers]) : nullptr, max_norm};
}

struct AdamwArgs {
  int64_t n;
  AdamwStep step;
  float max_norm;
  bool clipped;
};

template <Device D>
void adamw_kernel(void** buffers, const AdamwArgs& a) {
  adamw<D>(a.n, a.step, grad_clip(buffers, 4, a.max_norm, a.clipped), tile_ptr<float>(buffers[0]),
           tile_ptr<float>(buffers[1]), tile_ptr<float>(buffers[2]), tile_ptr<float>(buffers[3]));
}

// ids [p, g, m, v] or [p, g, m, v, norm]; inputs [lr, step (1-based)]
void adamw_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(0), &g = call.tensor(1), &m = call.tensor(2), &v = call.tensor(3);
  starpu_data_handle_t norm = clip_norm(call, 4);
  for (const TiledTensor* t : {&g, &m, &v}) check_same_tiling(p, *t, "adamw");
  float lr = float(call.input_scalar(0));
  double step = call.input_scalar(1);
  float b1 = float(attr<double>(call.attrs, "b1")), b2 = float(attr<double>(call.attrs, "b2"));
  float bc1 = float(1.0 - std::pow(double(b1), step)), bc2 = float(1.0 - std::pow(double(b2), step));
  AdamwArgs args{0, {lr, b1, b2, float(attr<double>(call.attrs, "eps")),
                     float(attr<double>(call.attrs, "weight_decay")), bc1, bc2},
                 float(attr<double>(call.attrs, "max_norm")), norm != nullptr};
  static starpu_codelet* cl = JNNTILE_CODELET(AdamwArgs, adamw_kernel, "adamw");
  for (int64_t t = 0; t < p.num_tiles(); ++t) {
    args.n = p.tile_numel(t);
    std::vector<Buffer> buffers{
        {p.tiles[t], STARPU_RW}, {g.tiles[t], STARPU_R}, {m.tiles[t], STARPU_RW}, {v.tiles[t], STARPU_RW}};
    if (norm) buffers.push_back({norm, STARPU_R});
    submit_task(cl, buffers, args, 10.0 * args.n);
  }
}
JNNTILE_OP(adamw, adamw_submit);

struct SgdArgs {
  int64_t n;
  float lr;
  float max_norm;
  bool clipped;
};

template <Device D>
void sgd_kernel(void** buffers, const SgdArgs& a) {
  sgd<D>(a.n, a.lr, grad_clip(buffers, 2, a.max_norm, a.clipped), tile_ptr<float>(buffers[0]),
         tile_ptr<float>(buffers[1]));
}

// ids [p, g] or [p, g, norm]; inputs [lr]
void sgd_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(0), &g = call.tensor(1);
  check_same_tiling(p, g, "sgd");
  starpu_data_handle_t norm = clip_norm(call, 2);
  float lr = float(call.input_scalar(0));
  float max_norm = float(attr<double>(call.attrs, "max_norm"));
  static starpu_codelet* cl = JNNTILE_CODELET(SgdArgs, sgd_kernel, "sgd");
  for (int64_t t = 0; t < p.num_tiles(); ++t) {
    std::vector<Buffer> buffers{{p.tiles[t], STARPU_RW}, {g.tiles[t], STARPU_R}};
    if (norm) buffers.push_back({norm, STARPU_R});
    submit_task(cl, buffers, SgdArgs{p.tile_numel(t), lr, max_norm, norm != nullptr}, 2.0 * p.tile_numel(t));
  }
}
JNNTILE_OP(sgd, sgd_submit);

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
