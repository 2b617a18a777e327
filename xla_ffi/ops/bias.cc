// Bias: out = x + b, with b broadcast over the leading axes of x.
//
// x: (..., N..) tile (..., tn..); b: (N..) tile (tn..): b has the trailing
// axes of x with the same tiles (one axis for a Linear layer, several for a
// fused projection such as (3, H, D)). One task per x tile. The backward adds
// dy into dx per tile (parallel) and sums dy over the leading axes into db:
// one chain per b tile over the x tiles that share it. (A linear layer adds its
// bias in its product's tasks, ops/gemm.cc, and sums db in its weight gradient's
// tasks; it uses the db half here only when its weight is frozen.)
#include <algorithm>

#include "kernels/bias.h"
#include "kernels/elementwise.h"
#include "task.h"

namespace jnntile {
namespace {

struct BiasArgs {
  FloatType type;  // of x, out, dy and dx; b and db are float32
  int64_t rows;    // product of the leading extents of the x tile
  int64_t n;       // elements of the b tile
  bool overwrite;  // dx (db) holds nothing yet: dx = dy (db = the sum)
};

template <Device D>
void forward_kernel(void** buffers, const BiasArgs& a) {
  add_bias<D>(a.type, a.rows, a.n, tile_ptr<void>(buffers[0]), tile_ptr<float>(buffers[1]), tile_ptr<void>(buffers[2]));
}

template <Device D>
void dx_kernel(void** buffers, const BiasArgs& a) {
  accumulate<D>(a.type, a.type, a.rows * a.n, 1.0f, a.overwrite, tile_ptr<void>(buffers[0]),
                tile_ptr<void>(buffers[1]));
}

template <Device D>
void db_kernel(void** buffers, const BiasArgs& a) {
  bias_grad<D>(a.type, a.rows, a.n, a.overwrite, tile_ptr<void>(buffers[0]), tile_ptr<float>(buffers[1]));
}

// x's float type; b must be float32 with the trailing axes and tiles of x.
FloatType check_layout(const TiledTensor& x, const TiledTensor& b, const char* op) {
  FloatType type = float_type(x, op);
  int lead = x.ndim() - b.ndim();
  if (b.dtype != DType::F32 || lead < 0 ||
      !std::equal(b.shape.begin(), b.shape.end(), x.shape.begin() + lead) ||
      !std::equal(b.tile_shape.begin(), b.tile_shape.end(), x.tile_shape.begin() + lead))
    throw std::invalid_argument(std::string(op) + ": b must be float32 with the trailing axes and tiles of x: " +
                                x.describe() + ", " + b.describe());
  return type;
}

// The b tile that an x tile uses: the trailing part of its grid coordinates.
int64_t bias_tile(const TiledTensor& x, const TiledTensor& b, int64_t x_linear) {
  Index coord = x.tile_coord(x_linear);
  return b.tile_linear(Index(coord.end() - b.ndim(), coord.end()));
}

// ids [x, b, out]
void bias_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &b = call.tensor(1), &out = call.tensor(2);
  FloatType type = check_layout(x, b, "add_bias");
  check_same_tiling(x, out, "add_bias");
  if (float_type(out, "add_bias") != type)
    throw std::invalid_argument("add_bias: out must have x's dtype: " + x.describe() + ", " + out.describe());
  static starpu_codelet* cl = JNNTILE_CODELET(BiasArgs, forward_kernel, "add_bias");
  for (int64_t t = 0; t < x.num_tiles(); ++t) {
    int64_t bt = bias_tile(x, b, t), n = b.tile_numel(bt);
    submit_task(cl, {{x.tiles[t], STARPU_R}, {b.tiles[bt], STARPU_R}, {out.tiles[t], STARPU_W}},
                BiasArgs{type, x.tile_numel(t) / n, n}, double(x.tile_numel(t)));
  }
}
JNNTILE_OP(add_bias, bias_submit);

// ids [dy, dx or -1, db or -1]: dx += dy (dx = dy with attr fresh_dx: its zero-fill was pending); db += sum of
// dy over the leading axes (with attr fresh_db, the first task of each db tile's chain writes it).
void bias_backward_submit(const OpCall& call) {
  const TiledTensor& dy = call.tensor(0);
  FloatType type = float_type(dy, "add_bias backward");
  static starpu_codelet* dx_cl = JNNTILE_CODELET(BiasArgs, dx_kernel, "add_bias_dx");
  static starpu_codelet* db_cl = JNNTILE_CODELET(BiasArgs, db_kernel, "add_bias_db");
  if (call.ids[1] >= 0) {
    const TiledTensor& dx = call.tensor(1);
    check_same_tiling(dy, dx, "add_bias backward");
    if (float_type(dx, "add_bias backward") != type)
      throw std::invalid_argument("add_bias backward: dx must have dy's dtype: " + dx.describe());
    bool fresh = attr<int64_t>(call.attrs, "fresh_dx") != 0;
    for (int64_t t = 0; t < dy.num_tiles(); ++t)
      submit_task(dx_cl, {{dy.tiles[t], STARPU_R}, {dx.tiles[t], fresh ? STARPU_W : STARPU_RW}},
                  BiasArgs{type, dy.tile_numel(t), 1, fresh}, double(dy.tile_numel(t)));
  }
  if (call.ids[2] >= 0) {
    const TiledTensor& db = call.tensor(2);
    check_layout(dy, db, "add_bias backward");
    bool fresh = attr<int64_t>(call.attrs, "fresh_db") != 0;
    std::vector<bool> written(db.num_tiles(), !fresh);
    // Tiles of dy in row-major order: the chain on each db tile follows the leading axes.
    for (int64_t t = 0; t < dy.num_tiles(); ++t) {
      int64_t bt = bias_tile(dy, db, t), n = db.tile_numel(bt);
      bool overwrite = !written[bt];
      written[bt] = true;
      submit_task(db_cl, {{dy.tiles[t], STARPU_R}, {db.tiles[bt], overwrite ? STARPU_W : STARPU_RW}},
                  BiasArgs{type, dy.tile_numel(t) / n, n, overwrite}, double(dy.tile_numel(t)));
    }
  }
}
JNNTILE_OP(add_bias_backward, bias_backward_submit);

}  // namespace
}  // namespace jnntile
