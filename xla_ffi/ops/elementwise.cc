// Elementwise ops on tensors of identical shape and tiling: one task per tile, float32 or bfloat16 tiles.
#include "kernels/elementwise.h"
#include "task.h"

namespace jnntile {
namespace {

// The float type of tensors that must share it.
FloatType same_float_type(std::initializer_list<const TiledTensor*> tensors, const char* op) {
  FloatType type = float_type(**tensors.begin(), op);
  for (const TiledTensor* t : tensors)
    if (float_type(*t, op) != type)
      throw std::invalid_argument(std::string(op) + ": tensors differ in dtype: " + (*tensors.begin())->describe() +
                                  " vs " + t->describe());
  return type;
}

struct UnaryArgs {
  Unary op;
  FloatType type;
  int64_t n;
  bool overwrite;  // backward: dx holds nothing yet
};

template <Device D>
void unary_kernel(void** buffers, const UnaryArgs& a) {
  unary_forward<D>(a.op, a.type, a.n, tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]));
}

template <Device D>
void unary_backward_kernel(void** buffers, const UnaryArgs& a) {
  unary_backward<D>(a.op, a.type, a.n, a.overwrite, tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]),
                    tile_ptr<void>(buffers[2]));
}

// ids [x, y]: y = f(x)
void unary_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &y = call.tensor(1);
  FloatType type = same_float_type({&x, &y}, "unary op");
  check_same_tiling(x, y, "unary op");
  auto op = Unary(attr<int64_t>(call.attrs, "op"));
  static starpu_codelet* cl = JNNTILE_CODELET(UnaryArgs, unary_kernel, "unary");
  for (int64_t t = 0; t < x.num_tiles(); ++t)
    submit_task(cl, {{x.tiles[t], STARPU_R}, {y.tiles[t], STARPU_W}}, UnaryArgs{op, type, x.tile_numel(t), false},
                double(x.tile_numel(t)));
}
JNNTILE_OP(unary, unary_submit);

// ids [x, dy, dx]: dx += dy * f'(x) (dx = ... with attr fresh: its zero-fill was pending)
void unary_backward_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &dy = call.tensor(1), &dx = call.tensor(2);
  FloatType type = same_float_type({&x, &dy, &dx}, "unary op backward");
  check_same_tiling(x, dy, "unary op backward");
  check_same_tiling(x, dx, "unary op backward");
  auto op = Unary(attr<int64_t>(call.attrs, "op"));
  static starpu_codelet* cl = JNNTILE_CODELET(UnaryArgs, unary_backward_kernel, "unary_backward");
  bool fresh = attr<int64_t>(call.attrs, "fresh") != 0;
  for (int64_t t = 0; t < x.num_tiles(); ++t)
    submit_task(cl, {{x.tiles[t], STARPU_R}, {dy.tiles[t], STARPU_R}, {dx.tiles[t], fresh ? STARPU_W : STARPU_RW}},
                UnaryArgs{op, type, x.tile_numel(t), fresh}, 2.0 * x.tile_numel(t));
}
JNNTILE_OP(unary_backward, unary_backward_submit);

struct AxpbyArgs {
  FloatType type;
  int64_t n;
  float a, b;
  bool has_y;
};

template <Device D>
void axpby_kernel(void** buffers, const AxpbyArgs& a) {
  const void* y = a.has_y ? tile_ptr<void>(buffers[1]) : nullptr;
  axpby<D>(a.type, a.n, a.a, tile_ptr<void>(buffers[0]), a.b, y, tile_ptr<void>(buffers[a.has_y ? 2 : 1]));
}

// ids [x, y, out]: out = a x + b y;  ids [x, out]: out = a x.
void axpby_submit(const OpCall& call) {
  bool has_y = call.ids.size() == 3;
  const TiledTensor &x = call.tensor(0), &out = call.tensor(has_y ? 2 : 1);
  FloatType type = has_y ? same_float_type({&x, &call.tensor(1), &out}, "axpby") : same_float_type({&x, &out}, "axpby");
  check_same_tiling(x, out, "axpby");
  if (has_y) check_same_tiling(x, call.tensor(1), "axpby");
  float a = float(attr<double>(call.attrs, "a")), b = has_y ? float(attr<double>(call.attrs, "b")) : 0.0f;
  static starpu_codelet* cl = JNNTILE_CODELET(AxpbyArgs, axpby_kernel, "axpby");
  for (int64_t t = 0; t < x.num_tiles(); ++t) {
    std::vector<Buffer> buffers{{x.tiles[t], STARPU_R}};
    if (has_y) buffers.push_back({call.tensor(1).tiles[t], STARPU_R});
    buffers.push_back({out.tiles[t], STARPU_W});
    submit_task(cl, buffers, AxpbyArgs{type, x.tile_numel(t), a, b, has_y}, 2.0 * x.tile_numel(t));
  }
}
JNNTILE_OP(axpby, axpby_submit);

struct AccumulateArgs {
  FloatType src_type, dst_type;
  int64_t n;
  float a;
  bool overwrite;
};

template <Device D>
void accumulate_kernel(void** buffers, const AccumulateArgs& a) {
  accumulate<D>(a.src_type, a.dst_type, a.n, a.a, a.overwrite, tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]));
}

// ids [src, dst_0, dst_1, ...], attr alphas: dst_i += alphas[i] * src (ids < 0 skipped), or dst_i = alphas[i] *
// src where attr fresh[i] is 1 (a gradient whose zero-fill was pending). The backward of every linear
// elementwise op; src and dst may differ in float type.
void accumulate_submit(const OpCall& call) {
  const TiledTensor& src = call.tensor(0);
  auto alphas = call.attrs.get<ffi::Span<const double>>("alphas");
  if (alphas.has_error() || alphas.value().size() != call.ids.size() - 1)
    throw std::invalid_argument("accumulate: needs one alpha per destination");
  auto fresh = call.attrs.get<ffi::Span<const int64_t>>("fresh");
  if (fresh.has_error() || fresh.value().size() != call.ids.size() - 1)
    throw std::invalid_argument("accumulate: needs one fresh flag per destination");
  static starpu_codelet* cl = JNNTILE_CODELET(AccumulateArgs, accumulate_kernel, "accumulate");
  for (size_t d = 1; d < call.ids.size(); ++d) {
    if (call.ids[d] < 0) continue;
    const TiledTensor& dst = call.tensor(d);
    check_same_tiling(src, dst, "accumulate");
    FloatType src_type = float_type(src, "accumulate"), dst_type = float_type(dst, "accumulate");
    bool overwrite = fresh.value()[d - 1] != 0;
    for (int64_t t = 0; t < src.num_tiles(); ++t)
      submit_task(cl, {{src.tiles[t], STARPU_R}, {dst.tiles[t], overwrite ? STARPU_W : STARPU_RW}},
                  AccumulateArgs{src_type, dst_type, src.tile_numel(t), float(alphas.value()[d - 1]), overwrite},
                  2.0 * src.tile_numel(t));
  }
}
JNNTILE_OP(accumulate, accumulate_submit);

// ids [src, dst], attrs axis, offset, alpha, fresh, into_part: one of the two is a part of the other along
// `axis` (the part: dst where into_part is 1, else src), made of whole tiles of the same tiling that start
// `offset` tiles into the whole; dst += alpha * src over the part's tiles alone (dst = alpha * src where
// fresh is 1). A LoRA adapter of one part of a fused projection adds its update into that part's tiles of
// the product, and its gradient is read from them.
void accumulate_part_submit(const OpCall& call) {
  const TiledTensor &src = call.tensor(0), &dst = call.tensor(1);
  const bool into_part = attr<int64_t>(call.attrs, "into_part") != 0;
  const TiledTensor &part = into_part ? dst : src, &whole = into_part ? src : dst;
  const int64_t axis = attr<int64_t>(call.attrs, "axis"), offset = attr<int64_t>(call.attrs, "offset");
  if (part.ndim() != whole.ndim() || axis < 0 || axis >= part.ndim() || part.tile_shape != whole.tile_shape ||
      offset < 0 || offset + part.grid[axis] > whole.grid[axis])
    throw std::invalid_argument("accumulate_part: " + part.describe() + " is not a part of " + whole.describe() +
                                " along axis " + std::to_string(axis) + " at tile " + std::to_string(offset));
  for (int d = 0; d < part.ndim(); ++d)
    if (d != axis && part.shape[d] != whole.shape[d])
      throw std::invalid_argument("accumulate_part: " + part.describe() + " and " + whole.describe() +
                                  " differ outside axis " + std::to_string(axis));
  const float alpha = float(attr<double>(call.attrs, "alpha"));
  const bool overwrite = attr<int64_t>(call.attrs, "fresh") != 0;
  const FloatType src_type = float_type(src, "accumulate_part"), dst_type = float_type(dst, "accumulate_part");
  static starpu_codelet* cl = JNNTILE_CODELET(AccumulateArgs, accumulate_kernel, "accumulate");
  for (int64_t t = 0; t < part.num_tiles(); ++t) {
    Index coord = part.tile_coord(t);
    const Index extent = part.tile_extent(coord);
    coord[axis] += offset;
    if (whole.tile_extent(coord) != extent)
      throw std::invalid_argument("accumulate_part: the tiles of " + part.describe() + " are not whole tiles of " +
                                  whole.describe());
    starpu_data_handle_t whole_tile = whole.tile(coord), part_tile = part.tiles[t];
    starpu_data_handle_t from = into_part ? whole_tile : part_tile, to = into_part ? part_tile : whole_tile;
    submit_task(cl, {{from, STARPU_R}, {to, overwrite ? STARPU_W : STARPU_RW}},
                AccumulateArgs{src_type, dst_type, part.tile_numel(t), alpha, overwrite}, 2.0 * part.tile_numel(t));
  }
}
JNNTILE_OP(accumulate_part, accumulate_part_submit);

}  // namespace
}  // namespace jnntile
