// Registry of tiled tensors: id -> grid of StarPU data handles.
//
// A tensor of shape (n_0, ..., n_{d-1}) with tile shape (t_0, ..., t_{d-1}) is
// cut into ceil(n_i / t_i) tiles per axis; the last tile on an axis may be
// smaller. Each tile is one contiguous row-major StarPU vector registered with
// home node -1, so it takes no memory until first written (and that first
// access must be write-only, DESIGN invariant 3) and StarPU may evict it.
#pragma once

#include <starpu.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "format.h"

namespace jnntile {

// U8: the codes of a quantized weight (kernels/quant.h), NF4 pairs or int8 bytes.
enum class DType : int { F32 = 0, I32 = 1, I64 = 2, BF16 = 3, U8 = 4 };
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

using Index = std::vector<int64_t>;

struct TiledTensor;

// What a tile holds, as far as submissions tell: tasks are checked against it
// when they are submitted (in token order), so reading a tile that was never
// written or was invalidated raises a clear error instead of StarPU aborting
// the process (DESIGN invariants 3 and 7). Attached to each handle as user data.
enum class TileContent : uint8_t { NeverWritten = 0, Valid = 1, Invalidated = 2 };
struct TileState {
  std::atomic<uint8_t> content{uint8_t(TileContent::NeverWritten)};
  const TiledTensor* tensor = nullptr;
  // Submissions that write the tile (or invalidate it), counted: a compute copy's tile is fresh while
  // its master tile's count is the one it was made from (`copy_of_version`).
  std::atomic<uint64_t> version{0};
  std::atomic<uint64_t> copy_of_version{UINT64_MAX};
  // Sharded state (sharding.h): the rank that owns the tile (-1: every rank holds it), and whether the other
  // ranks received its current values for the op in progress. Every rank keeps the same account.
  int32_t owner = -1;
  bool replicas_fresh = false;
};

struct TiledTensor {
  int64_t id;
  DType dtype;
  Index shape;
  Index tile_shape;
  Index grid;  // tiles per axis
  std::vector<starpu_data_handle_t> tiles;  // row-major over the grid
  std::unique_ptr<TileState[]> tile_states;  // one per tile, user data of its handle
  int64_t grad_id = -1;  // companion gradient tensor, created on demand
  int64_t copy_id = -1;  // compute copy in another float dtype (a bfloat16 copy of a float32 weight), on demand
  int64_t shard_key = -1;  // sharded (sharding.h): the order it was sharded in, the same on every rank
  bool sharded_until_invalidated = false;  // a summed gradient: every rank writes its next partial sums

  int ndim() const { return int(shape.size()); }
  int64_t numel() const;
  int64_t num_tiles() const { return int64_t(tiles.size()); }
  // Shape of the tile at grid coordinates `coord`.
  Index tile_extent(const Index& coord) const;
  Index tile_coord(int64_t linear) const;
  int64_t tile_linear(const Index& coord) const;
  starpu_data_handle_t tile(const Index& coord) const { return tiles[tile_linear(coord)]; }
  int64_t tile_numel(int64_t linear) const;
  std::string describe() const;  // "tensor 3 f32 (64, 48) tiles (32, 32)"
};

int64_t tensor_create(const Index& shape, const Index& tile_shape, DType dtype);
void tensor_free(int64_t id);
// Throws std::invalid_argument naming the id when it is unknown or freed.
TiledTensor& tensor_get(int64_t id);
bool tensor_exists(int64_t id);
// The gradient companion of `id` (same shape, tiles and dtype), created once.
int64_t tensor_grad(int64_t id);
// The compute copy of `id` in `dtype` (same shape and tiles), created once, freed with it. Nothing keeps it
// equal to `id`: a convert into it skips the tiles that are fresh (`copy_is_fresh`), and an optimizer
// update that writes it as it writes the master marks them so (`mark_copy_fresh`).
int64_t tensor_compute_copy(int64_t id, DType dtype);
// Exchanges the tiles (StarPU handles, with what they hold and the tasks on them) of two tensors of the same
// shape, tiles and dtype: tasks submitted afterwards on `a` use the tiles `b` had. A speculative optimizer
// update (ops/optim.cc) writes apart and makes its result the parameter's this way, moving no data.
void tensor_swap_tiles(int64_t a, int64_t b);
bool copy_is_fresh(starpu_data_handle_t copy, starpu_data_handle_t master);
// After the submission that writes `copy` from `master`'s current values.
void mark_copy_fresh(starpu_data_handle_t copy, starpu_data_handle_t master);
int64_t tensor_count();
// Throws std::invalid_argument naming the tensor when a task may not read `handle`
// (a tile of a registered tensor never written or invalidated); other handles pass.
void check_readable(starpu_data_handle_t handle);
// Records a write-only access (the tile becomes valid) or an invalidation.
void mark_written(starpu_data_handle_t handle);
// Counts a submission that writes the tile (write-only or read-write).
void count_write(starpu_data_handle_t handle);
void mark_invalidated(starpu_data_handle_t handle);
// Invalidates every tile of `t` after the tasks already submitted on it (DESIGN invariant 7).
void tensor_invalidate(const TiledTensor& t);
// Unregisters every tensor; `sync` (only once no task is pending) waits for
// StarPU's requests on each tile, so that shutdown finds none queued.
void tensor_free_all(bool sync = false);

}  // namespace jnntile
