// Optimizer steps that update parameter and moment tiles in place.
//
// Per-step values (learning rate, step count) are extra array inputs read at
// submission (DESIGN invariant 4); hyper-parameters that never change are
// attributes.
#include <cmath>

#include "kernels/optim.h"
#include "task.h"

namespace jnntile {
namespace {

struct AdamwArgs {
  int64_t n;
  AdamwStep step;
};

template <Device D>
void adamw_kernel(void** buffers, const AdamwArgs& a) {
  adamw<D>(a.n, a.step, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]), tile_ptr<float>(buffers[2]),
           tile_ptr<float>(buffers[3]));
}

// ids [p, g, m, v]; inputs [lr, step (1-based)]
void adamw_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(0), &g = call.tensor(1), &m = call.tensor(2), &v = call.tensor(3);
  for (const TiledTensor* t : {&g, &m, &v}) check_same_tiling(p, *t, "adamw");
  float lr = float(call.input_scalar(0));
  double step = call.input_scalar(1);
  float b1 = float(attr<double>(call.attrs, "b1")), b2 = float(attr<double>(call.attrs, "b2"));
  float bc1 = float(1.0 - std::pow(double(b1), step)), bc2 = float(1.0 - std::pow(double(b2), step));
  AdamwArgs args{0, {lr, b1, b2, float(attr<double>(call.attrs, "eps")),
                     float(attr<double>(call.attrs, "weight_decay")), bc1, bc2}};
  static starpu_codelet* cl = JNNTILE_CODELET(AdamwArgs, adamw_kernel, "adamw");
  for (int64_t t = 0; t < p.num_tiles(); ++t) {
    args.n = p.tile_numel(t);
    submit_task(cl, {{p.tiles[t], STARPU_RW}, {g.tiles[t], STARPU_R}, {m.tiles[t], STARPU_RW}, {v.tiles[t], STARPU_RW}},
                args, 10.0 * args.n);
  }
}
JNNTILE_OP(adamw, adamw_submit);

struct SgdArgs {
  int64_t n;
  float lr;
};

template <Device D>
void sgd_kernel(void** buffers, const SgdArgs& a) {
  sgd<D>(a.n, a.lr, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]));
}

// ids [p, g]; inputs [lr]
void sgd_submit(const OpCall& call) {
  const TiledTensor &p = call.tensor(0), &g = call.tensor(1);
  check_same_tiling(p, g, "sgd");
  float lr = float(call.input_scalar(0));
  static starpu_codelet* cl = JNNTILE_CODELET(SgdArgs, sgd_kernel, "sgd");
  for (int64_t t = 0; t < p.num_tiles(); ++t)
    submit_task(cl, {{p.tiles[t], STARPU_RW}, {g.tiles[t], STARPU_R}}, SgdArgs{p.tile_numel(t), lr},
                2.0 * p.tile_numel(t));
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
