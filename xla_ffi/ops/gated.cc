// SwiGLU over tiles: x (..., 2, I) tiled (..., 1, ti) holds the gate (index 0
// on axis -2) and up (1) projections in separate tiles; y (..., I) tiled
// (..., ti) = silu(gate) * up. One task per tile of y reads the gate and up
// tiles of its coordinates; the backward's task per tile accumulates into both
// tiles of grad(x).
#include "kernels/gated.h"
#include "task.h"

namespace jnntile {
namespace {

struct Args {
  FloatType type;  // of x, y and their gradients
  int64_t n;       // elements in the tile
  bool overwrite;  // backward: grad(x) holds nothing yet
};

// buffers: gate, up, y
template <Device D>
void forward_kernel(void** buffers, const Args& a) {
  swiglu_forward<D>(a.type, a.n, tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]), tile_ptr<void>(buffers[2]));
}

// buffers: gate, up, dy, dgate, dup
template <Device D>
void backward_kernel(void** buffers, const Args& a) {
  swiglu_backward<D>(a.type, a.n, a.overwrite, tile_ptr<void>(buffers[0]), tile_ptr<void>(buffers[1]),
                     tile_ptr<void>(buffers[2]), tile_ptr<void>(buffers[3]), tile_ptr<void>(buffers[4]));
}

// The gate (half 0) or up (half 1) tile of x for tile `index` of y.
starpu_data_handle_t half_tile(const TiledTensor& x, const TiledTensor& y, int64_t index, int64_t half) {
  Index coord = y.tile_coord(index);
  coord.insert(coord.end() - 1, half);
  return x.tile(coord);
}

FloatType check_layout(const TiledTensor& x, const TiledTensor& y, const char* op) {
  const size_t n = x.ndim();
  Index y_shape(x.shape.begin(), x.shape.end()), y_tiles(x.tile_shape.begin(), x.tile_shape.end());
  if (n >= 2) {
    y_shape.erase(y_shape.end() - 2);
    y_tiles.erase(y_tiles.end() - 2);
  }
  if ((x.dtype != DType::F32 && x.dtype != DType::BF16) || y.dtype != x.dtype || n < 2 || x.shape[n - 2] != 2 ||
      x.tile_shape[n - 2] != 1 || y.shape != y_shape || y.tile_shape != y_tiles)
    throw std::invalid_argument(std::string(op) + ": needs float32 or bfloat16 x (..., 2, I) tiled (..., 1, ti) and "
                                "y (..., I) of its dtype tiled (..., ti): x " + x.describe() + ", y " + y.describe());
  return float_type(x, op);
}

// ids [x, y]
void swiglu_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &y = call.tensor(1);
  const FloatType type = check_layout(x, y, "swiglu");
  static starpu_codelet* cl = JNNTILE_CODELET(Args, forward_kernel, "swiglu_forward");
  for (int64_t t = 0; t < y.num_tiles(); ++t) {
    const int64_t n = y.tile_numel(t);
    submit_task(cl, {{half_tile(x, y, t, 0), STARPU_R}, {half_tile(x, y, t, 1), STARPU_R}, {y.tiles[t], STARPU_W}},
                Args{type, n, false}, 6.0 * n);
  }
}
JNNTILE_OP(swiglu, swiglu_submit);

// ids [x, dy, dx or -1]: grad(x) += the backward (= with attr fresh: its zero-fill was pending).
void swiglu_backward_submit(const OpCall& call) {
  if (call.ids[2] < 0) return;
  const TiledTensor &x = call.tensor(0), &dy = call.tensor(1), &dx = call.tensor(2);
  const FloatType type = check_layout(x, dy, "swiglu backward");
  check_same_tiling(x, dx, "swiglu backward");
  if (dx.dtype != x.dtype) throw std::invalid_argument("swiglu backward: dx must have x's dtype: " + dx.describe());
  static starpu_codelet* cl = JNNTILE_CODELET(Args, backward_kernel, "swiglu_backward");
  const bool fresh = attr<int64_t>(call.attrs, "fresh") != 0;
  const starpu_data_access_mode mode = fresh ? STARPU_W : STARPU_RW;
  for (int64_t t = 0; t < dy.num_tiles(); ++t) {
    const int64_t n = dy.tile_numel(t);
    submit_task(cl,
                {{half_tile(x, dy, t, 0), STARPU_R}, {half_tile(x, dy, t, 1), STARPU_R}, {dy.tiles[t], STARPU_R},
                 {half_tile(dx, dy, t, 0), mode}, {half_tile(dx, dy, t, 1), mode}},
                Args{type, n, fresh}, 12.0 * n);
  }
}
JNNTILE_OP(swiglu_backward, swiglu_backward_submit);

}  // namespace
}  // namespace jnntile
