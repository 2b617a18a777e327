// Sum of squares and Euclidean norm of a whole tensor into a scalar tensor.
//
// Each tile writes its partial sum (double) to a scratch handle; one final
// task combines them, so tiles are reduced in parallel and the result does not
// depend on the order tasks ran in.
#include "kernels/reduce.h"
#include "task.h"

namespace jnntile {
namespace {

// buffers: count tiles x, their partial sums (one double each), then scratch (kSumsqBlocks doubles)
template <Device D>
void partial_kernel(void** buffers, const TaskTiles& tiles) {
  double* scratch = tile_ptr<double>(buffers[2 * tiles.count]);
  for (int i = 0; i < tiles.count; ++i)
    sumsq<D>(tiles.numel[i], tile_ptr<float>(buffers[i]), tile_ptr<double>(buffers[tiles.count + i]), scratch);
}

struct CombineArgs {
  int64_t count;
  bool take_sqrt;
};

// buffers: count partials, out, scratch (count pointers)
template <Device D>
void combine_kernel(void** buffers, const CombineArgs& a) {
  std::vector<const double*> partials(a.count);
  for (int64_t i = 0; i < a.count; ++i) partials[i] = tile_ptr<double>(buffers[i]);
  sumsq_combine<D>(a.count, partials.data(), a.take_sqrt, tile_ptr<float>(buffers[a.count]),
                   tile_ptr<void>(buffers[a.count + 1]));
}

// A tile whose sum of squares is wanted, and the handle (one double) that receives it.
struct PartialSum {
  const TiledTensor* x;
  int64_t tile;
  starpu_data_handle_t partial;
};

// Submits the partial sums of squares, small tiles several to a task (tile_groups).
void submit_partials(const std::vector<PartialSum>& sums, std::vector<starpu_data_handle_t>& temporaries) {
  static starpu_codelet* cl = JNNTILE_CODELET(TaskTiles, partial_kernel, "sumsq_partial");
  std::vector<int64_t> numel, bytes;
  std::vector<int> owners;  // with sharded state, a partial sum is its tile's owner's
  for (const PartialSum& s : sums) {
    if (s.x->dtype != DType::F32) throw std::invalid_argument("sumsq: needs float32 inputs: " + s.x->describe());
    owners.push_back(tile_owner(s.partial));
    numel.push_back(s.x->tile_numel(s.tile));
    bytes.push_back(int64_t(starpu_data_get_size(s.x->tiles[s.tile]) + starpu_data_get_size(s.partial)));
  }
  for (const std::vector<size_t>& group :
       tile_groups(numel, bytes, small_tile_numel(), task_group_bytes_limit(), owners)) {
    std::vector<Buffer> buffers;
    TaskTiles tiles;
    for (size_t i : group) {
      buffers.push_back({sums[i].x->tiles[sums[i].tile], STARPU_R});
      tiles.numel[tiles.count++] = numel[i];
    }
    for (size_t i : group) buffers.push_back({sums[i].partial, STARPU_W});
    starpu_data_handle_t blocks = temporary_vector(kSumsqBlocks, sizeof(double));
    buffers.push_back({blocks, STARPU_SCRATCH});
    submit_task(cl, buffers, tiles, 2.0 * double(tiles.total()));
    temporaries.push_back(blocks);
  }
}

// Tensors of partial sums: int64, one element per tile, holding a double's bits (attribute partials).
bool holds_partials(const TiledTensor& t) { return t.dtype == DType::I64 && t.num_tiles() == t.numel(); }

// ids [x_0, ..., x_{n-1}, out]: out = sum of x_i^2 over all tensors (one tensor for
// sumsq/norm, all gradients for a global norm), or its square root when attr sqrt = 1.
// An x_i may hold partial sums already (written with attribute partials = 1: ids [x, partials], one
// per tile of x): the sum then takes them as they are, in their place, so a norm summed from partials
// written early (jnntile.optim's fused update) has the bits of the one summed from the tensors.
void sumsq_submit(const OpCall& call) {
  const TiledTensor& out = call.tensor(call.ids.size() - 1);
  std::vector<starpu_data_handle_t> temporaries;
  auto partials = call.attrs.get<int64_t>("partials");
  if (!partials.has_error() && partials.value() != 0) {
    const TiledTensor& x = call.tensor(0);
    if (call.ids.size() != 2 || !holds_partials(out) || out.num_tiles() != x.num_tiles())
      throw std::invalid_argument("sumsq partials: needs [x, an int64 tensor of one element per tile of x], got " +
                                  out.describe() + " for " + x.describe());
    std::vector<PartialSum> sums;
    for (int64_t t = 0; t < x.num_tiles(); ++t) sums.push_back({&x, t, out.tiles[t]});
    submit_partials(sums, temporaries);
    for (starpu_data_handle_t handle : temporaries) starpu_data_unregister_submit(handle);
    return;
  }
  if (out.dtype != DType::F32 || out.numel() != 1)
    throw std::invalid_argument("sumsq: needs a float32 scalar output: " + out.describe());
  bool take_sqrt = attr<int64_t>(call.attrs, "sqrt") != 0;
  static starpu_codelet* combine_cl = JNNTILE_CODELET(CombineArgs, combine_kernel, "sumsq_combine");
  std::vector<Buffer> combine_buffers;
  std::vector<PartialSum> sums;
  for (size_t i = 0; i + 1 < call.ids.size(); ++i) {
    const TiledTensor& x = call.tensor(i);
    for (int64_t t = 0; t < x.num_tiles(); ++t) {
      starpu_data_handle_t partial = x.tiles[t];
      if (!holds_partials(x)) {
        partial = temporary_vector(1, sizeof(double));
        sums.push_back({&x, t, partial});
        temporaries.push_back(partial);
      }
      combine_buffers.push_back({partial, STARPU_R});
    }
  }
  submit_partials(sums, temporaries);
  int64_t count = int64_t(combine_buffers.size());
  starpu_data_handle_t pointers = temporary_vector(count, sizeof(void*));
  combine_buffers.push_back({out.tiles[0], STARPU_W});
  combine_buffers.push_back({pointers, STARPU_SCRATCH});
  temporaries.push_back(pointers);
  submit_task(combine_cl, combine_buffers, CombineArgs{count, take_sqrt});
  for (starpu_data_handle_t handle : temporaries) starpu_data_unregister_submit(handle);
}
JNNTILE_OP(sumsq, sumsq_submit);

struct SumsqBackwardArgs {
  int64_t n;
  bool take_sqrt;
};

// buffers: x, out, dout, dx
template <Device D>
void sumsq_backward_kernel(void** buffers, const SumsqBackwardArgs& a) {
  sumsq_backward<D>(a.n, a.take_sqrt, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]),
                    tile_ptr<float>(buffers[2]), tile_ptr<float>(buffers[3]));
}

// ids [x, out, dout, dx]
void sumsq_backward_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &out = call.tensor(1), &dout = call.tensor(2), &dx = call.tensor(3);
  check_same_tiling(x, dx, "sumsq backward");
  bool take_sqrt = attr<int64_t>(call.attrs, "sqrt") != 0;
  static starpu_codelet* cl = JNNTILE_CODELET(SumsqBackwardArgs, sumsq_backward_kernel, "sumsq_backward");
  for (int64_t t = 0; t < x.num_tiles(); ++t)
    submit_task(cl,
                {{x.tiles[t], STARPU_R}, {out.tiles[0], STARPU_R}, {dout.tiles[0], STARPU_R}, {dx.tiles[t], STARPU_RW}},
                SumsqBackwardArgs{x.tile_numel(t), take_sqrt}, 2.0 * x.tile_numel(t));
}
JNNTILE_OP(sumsq_backward, sumsq_backward_submit);

}  // namespace
}  // namespace jnntile
