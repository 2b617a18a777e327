// Dropout: y = x * mask / (1 - rate), mask from a counter-based hash of
// (seed, global element index); one task per tile. The seed is a per-step
// value, so it arrives as extra input 0 (DESIGN invariant 4) and is read at
// submit time; the rate selects code and is an attribute. The backward
// recomputes the mask: dx += dy * mask / (1 - rate).
#include "kernels/dropout.h"
#include "ops/values.h"
#include "task.h"

namespace jnntile {
namespace {

struct DropoutArgs {
  FloatType type;
  TileGeometry geo;
  uint64_t seed;
  double rate;
  bool accumulate;
};

template <Device D>
void dropout_kernel(void** buffers, const DropoutArgs& a) {
  dropout<D>(a.type, a.geo, a.seed, a.rate, a.accumulate, tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]));
}

// Submits out = (or +=) in * mask / (1 - rate) for every tile; `in` and `out` share the tiling.
void submit_dropout(const OpCall& call, const TiledTensor& in, const TiledTensor& out, bool accumulate) {
  check_same_tiling(in, out, "dropout");
  FloatType type = float_type(in, "dropout");
  if (float_type(out, "dropout") != type)
    throw std::invalid_argument("dropout: in and out differ in dtype: " + in.describe() + ", " + out.describe());
  double rate = attr<double>(call.attrs, "rate");
  if (!(rate >= 0.0 && rate < 1.0)) throw std::invalid_argument("dropout: rate must be in [0, 1)");
  // An int32 seed; negative values are as good as any.
  uint64_t seed = uint64_t(int64_t(call.input_scalar(0)));
  static starpu_codelet* cl = JNNTILE_CODELET(DropoutArgs, dropout_kernel, "dropout");
  for (int64_t t = 0; t < in.num_tiles(); ++t)
    submit_task(cl, {{in.tiles[t], STARPU_R}, {out.tiles[t], accumulate ? STARPU_RW : STARPU_W}},
                DropoutArgs{type, tile_geometry(in, t), seed, rate, accumulate}, double(in.tile_numel(t)));
}

// ids [x, y]; extra input 0: the seed
void dropout_submit(const OpCall& call) { submit_dropout(call, call.tensor(0), call.tensor(1), false); }
JNNTILE_OP(dropout, dropout_submit);

// ids [dy, dx or -1]; extra input 0: the seed of the forward
void dropout_backward_submit(const OpCall& call) {
  if (call.ids[1] >= 0) submit_dropout(call, call.tensor(0), call.tensor(1), true);
}
JNNTILE_OP(dropout_backward, dropout_backward_submit);

}  // namespace
}  // namespace jnntile
