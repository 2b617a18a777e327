// Embedding: out[..., :] = table[ids[...], :].
//
// ids: (B, T) int32 tile (tb, tt); table: (V, C) tile (tv, tc); out: (B, T, C)
// tile (tb, tt, tc). Every output tile gets one task per vocabulary tile: the
// first writes the whole tile (zeros where its ids are in another vocabulary
// tile, DESIGN invariant 3), the others fill in their rows (RW). Output tiles
// are independent, so they run in parallel. The backward scatter-adds dOut
// rows into the table gradient: every (vocab tile, column tile) of dtable is an
// RW chain over the id tiles, which keeps the sum deterministic. ids may have
// any number of axes. The table is float32, or bfloat16 when it is a frozen
// base (nn.base_dtype), which has no gradient.
#include "kernels/embedding.h"
#include "task.h"

namespace jnntile {
namespace {

struct EmbeddingArgs {
  FloatType table_type;  // float32, or a frozen bfloat16 table (forward only)
  FloatType type;        // of out and dout
  int64_t n;             // positions in the id tile
  int64_t c;             // columns in the table tile
  int64_t v0;            // first vocabulary row of the table tile
  int64_t vlen;          // rows in the table tile
  bool first;            // forward only: first vocabulary tile of this output tile
};

// buffers: ids, table, out
template <Device D>
void forward_kernel(void** buffers, const EmbeddingArgs& a) {
  embedding_forward<D>(a.table_type, a.type, a.n, a.c, a.v0, a.vlen, tile_ptr<int32_t>(buffers[0]),
                       tile_ptr<void>(buffers[1]), a.first, tile_ptr<void>(buffers[2]));
}

// buffers: ids, dout, dtable
template <Device D>
void backward_kernel(void** buffers, const EmbeddingArgs& a) {
  embedding_backward<D>(a.type, a.n, a.c, a.v0, a.vlen, tile_ptr<int32_t>(buffers[0]), tile_ptr<void>(buffers[1]),
                        tile_ptr<float>(buffers[2]));
}

// out (or dout) must be ids' axes plus the table's columns, tiled the same way.
FloatType check_layout(const TiledTensor& ids, const TiledTensor& table, const TiledTensor& out, const char* op) {
  if (ids.dtype != DType::I32 || table.ndim() != 2)
    throw std::invalid_argument(std::string(op) + ": needs int32 ids and a (V, C) table: " + ids.describe() + ", " +
                                table.describe());
  FloatType type = float_type(out, op);
  Index shape = ids.shape, tile_shape = ids.tile_shape;
  shape.push_back(table.shape[1]);
  tile_shape.push_back(table.tile_shape[1]);
  if (out.shape != shape || out.tile_shape != tile_shape)
    throw std::invalid_argument(std::string(op) + ": output does not match ids and table: " + out.describe() +
                                " for " + ids.describe() + ", " + table.describe());
  return type;
}

// ids [ids, table, out]
void embedding_submit(const OpCall& call) {
  const TiledTensor &ids = call.tensor(0), &table = call.tensor(1), &out = call.tensor(2);
  FloatType type = check_layout(ids, table, out, "embedding");
  FloatType table_type = float_type(table, "embedding");
  static starpu_codelet* cl = JNNTILE_CODELET(EmbeddingArgs, forward_kernel, "embedding");
  for (int64_t t = 0; t < out.num_tiles(); ++t) {
    Index ids_coord = out.tile_coord(t);  // the output tile is (id tile, column tile)
    int64_t col = ids_coord.back();
    ids_coord.pop_back();
    int64_t n = ids.tile_numel(ids.tile_linear(ids_coord));
    for (int64_t v = 0; v < table.grid[0]; ++v) {
      Index extent = table.tile_extent({v, col});
      bool first = v == 0;
      submit_task(cl, {{ids.tile(ids_coord), STARPU_R}, {table.tile({v, col}), STARPU_R},
                       {out.tiles[t], first ? STARPU_W : STARPU_RW}},
                  EmbeddingArgs{table_type, type, n, extent[1], v * table.tile_shape[0], extent[0], first});
    }
  }
}
JNNTILE_OP(embedding, embedding_submit);

// ids [ids, dout, dtable or -1]: dtable += scatter of dout rows by id.
void embedding_backward_submit(const OpCall& call) {
  if (call.ids[2] < 0) return;  // ids get no gradient; nobody wants the table's
  const TiledTensor &ids = call.tensor(0), &dout = call.tensor(1), &dtable = call.tensor(2);
  FloatType type = check_layout(ids, dtable, dout, "embedding backward");
  if (dtable.dtype != DType::F32)  // a bfloat16 table is a frozen base: jnntile/ops/embedding.py refuses first
    throw std::invalid_argument("embedding backward: the table's gradient must be float32: " + dtable.describe());
  static starpu_codelet* cl = JNNTILE_CODELET(EmbeddingArgs, backward_kernel, "embedding_backward");
  for (int64_t t = 0; t < dtable.num_tiles(); ++t) {
    Index coord = dtable.tile_coord(t), extent = dtable.tile_extent(coord);
    for (int64_t i = 0; i < ids.num_tiles(); ++i) {
      Index dout_coord = ids.tile_coord(i);
      dout_coord.push_back(coord[1]);
      int64_t n = ids.tile_numel(i);
      submit_task(cl, {{ids.tiles[i], STARPU_R}, {dout.tile(dout_coord), STARPU_R}, {dtable.tiles[t], STARPU_RW}},
                  EmbeddingArgs{FloatType::F32, type, n, extent[1], coord[0] * dtable.tile_shape[0], extent[0],
                                false},
                  double(n * extent[1]));
    }
  }
}
JNNTILE_OP(embedding_backward, embedding_backward_submit);

}  // namespace
}  // namespace jnntile
