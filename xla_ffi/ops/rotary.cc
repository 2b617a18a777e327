// Rotary position embedding over the tiles of x (B, T, P, H, D) tiled
// (tb, tt, 1, th, D): the parts p < rotated_parts on axis 2 (queries and keys
// of a fused q/k/v tensor) turn by their positions' angles, the others (values)
// are copied. One task per tile, forward and backward. The sequence position of
// row t is pos + t: `pos` is a per-step value, extra input 0 (DESIGN invariant
// 4), read at submit time, so one compiled step serves every offset (prefill
// and decoding); the frequencies are fixed by the model and are an attribute.
// A packed batch, whose examples restart at position 0, passes the positions
// instead: an int32 (B, T) tensor tiled (tb, tt), whose tile each task reads.
#include "kernels/rotary.h"
#include "task.h"

namespace jnntile {
namespace {

struct RotaryArgs {
  FloatType type;  // of x and y (dy and dx)
  RotaryTile tile;
  bool positions;  // buffer 2 holds the rows' positions
};

// The task's tile, with its positions where it reads them.
RotaryTile task_tile(void** buffers, const RotaryArgs& a) {
  RotaryTile t = a.tile;
  if (a.positions) t.positions = tile_ptr<int32_t>(buffers[2]);
  return t;
}

template <Device D>
void forward_kernel(void** buffers, const RotaryArgs& a) {
  rotary_forward<D>(a.type, task_tile(buffers, a), tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]));
}

template <Device D>
void backward_kernel(void** buffers, const RotaryArgs& a) {
  rotary_backward<D>(a.type, task_tile(buffers, a), tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]));
}

// Tensor `index` of the call, the positions (B, T) tiled (tb, tt) like x's rows, or nullptr where it has none.
const TiledTensor* positions_of(const OpCall& call, size_t index, const TiledTensor& x, const char* op) {
  if (call.ids.size() <= index) return nullptr;
  const TiledTensor& positions = call.tensor(index);
  if (positions.dtype != DType::I32 || positions.shape != Index{x.shape[0], x.shape[1]} ||
      positions.tile_shape != Index{x.tile_shape[0], x.tile_shape[1]})
    throw std::invalid_argument(std::string(op) + ": positions must be int32 (B, T) tiled (tb, tt) like x's rows: " +
                                positions.describe() + ", x " + x.describe());
  return &positions;
}

// The task's buffers: a and b, then the positions tile of `index`'s rows where there are positions.
std::vector<Buffer> rotary_buffers(Buffer a, Buffer b, const TiledTensor* positions, const TiledTensor& x,
                                   int64_t index) {
  if (positions == nullptr) return {a, b};
  const Index coord = x.tile_coord(index);
  return {a, b, {positions->tile({coord[0], coord[1]}), STARPU_R}};
}

// Calls submit(tile index, RotaryArgs) for every tile of x, after checking the layout and the attributes.
template <class Submit>
void for_each_tile(const OpCall& call, const TiledTensor& x, const TiledTensor& y, const char* op, Submit submit,
                   bool overwrite = false) {
  if ((x.dtype != DType::F32 && x.dtype != DType::BF16) || x.ndim() != 5 || x.tile_shape[2] != 1 ||
      x.tile_shape[4] != x.shape[4] || x.shape[4] % 2 != 0)
    throw std::invalid_argument(std::string(op) + ": x must be float32 or bfloat16 (B, T, P, H, D) with an even D, "
                                "tiled (tb, tt, 1, th, D): " + x.describe());
  check_same_tiling(x, y, op);
  if (y.dtype != x.dtype) throw std::invalid_argument(std::string(op) + ": dtypes differ: " + y.describe());
  const FloatType type = float_type(x, op);
  auto freqs = call.attrs.get<ffi::Span<const double>>("inv_freq");
  if (freqs.has_error()) throw std::invalid_argument(std::string(op) + ": missing attribute 'inv_freq'");
  const int64_t half = x.shape[4] / 2, rotated = attr<int64_t>(call.attrs, "rotated_parts");
  if (int64_t(freqs.value().size()) != half || half > kRotaryMaxHalf)
    throw std::invalid_argument(std::string(op) + ": needs D / 2 frequencies, at most " +
                                std::to_string(kRotaryMaxHalf) + ": " + x.describe());
  const int64_t pos = int64_t(call.input_scalar(0));
  const bool positions = call.ids.size() > 2;
  RotaryTile t{};
  t.overwrite = overwrite;
  for (int64_t c = 0; c < half; ++c) t.inv_freq[c] = float(freqs.value()[c]);
  for (int64_t index = 0; index < x.num_tiles(); ++index) {
    const Index coord = x.tile_coord(index), ext = x.tile_extent(coord);
    t.nb = ext[0];
    t.nt = ext[1];
    t.nh = ext[3];
    t.d = ext[4];
    t.pos0 = pos + coord[1] * x.tile_shape[1];
    t.rotate = coord[2] < rotated;
    submit(index, RotaryArgs{type, t, positions});
  }
}

// ids [x, y] or [x, y, positions], inputs [pos]; attrs inv_freq (D/2 floats), rotated_parts
void rotary_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &y = call.tensor(1);
  const TiledTensor* positions = positions_of(call, 2, x, "rotary");
  static starpu_codelet* cl = JNNTILE_CODELET(RotaryArgs, forward_kernel, "rotary_forward");
  for_each_tile(call, x, y, "rotary", [&](int64_t index, const RotaryArgs& a) {
    submit_task(cl, rotary_buffers({x.tiles[index], STARPU_R}, {y.tiles[index], STARPU_W}, positions, x, index), a,
                6.0 * rotary::numel(a.tile));
  });
}
JNNTILE_OP(rotary, rotary_submit);

// ids [dy, dx or -1] or [dy, dx or -1, positions], inputs [pos]: dx += dy turned back (= with attr fresh: its
// zero-fill was pending).
void rotary_backward_submit(const OpCall& call) {
  if (call.ids[1] < 0) return;
  const TiledTensor &dy = call.tensor(0), &dx = call.tensor(1);
  const TiledTensor* positions = positions_of(call, 2, dy, "rotary backward");
  static starpu_codelet* cl = JNNTILE_CODELET(RotaryArgs, backward_kernel, "rotary_backward");
  const bool fresh = attr<int64_t>(call.attrs, "fresh") != 0;
  for_each_tile(
      call, dy, dx, "rotary backward",
      [&](int64_t index, const RotaryArgs& a) {
        submit_task(cl,
                    rotary_buffers({dy.tiles[index], STARPU_R}, {dx.tiles[index], fresh ? STARPU_W : STARPU_RW},
                                   positions, dy, index),
                    a, 6.0 * rotary::numel(a.tile));
      },
      fresh);
}
JNNTILE_OP(rotary_backward, rotary_backward_submit);

}  // namespace
}  // namespace jnntile
