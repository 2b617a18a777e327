// Sharded training state (docs/distributed.md, "Sharded state"): with several
// ranks, each tile of a sharded tensor (a parameter, its compute copy, its AdamW
// moments, its summed gradient) has one owner rank, which alone holds its
// values and runs the tasks that write it.
//
// Every rank submits the same ops in the same order (each on its own batch
// rows), so each rank can tell, from its own submissions, what every other rank
// does with a sharded tile. `submit_task` asks `shard_admit` about each task:
//
// * A task that writes tiles of one owner's shard runs on that owner only (a
//   parameter's initialisation, its optimizer update, its compute copy's
//   conversion). Elsewhere it is not submitted; its writes are still counted,
//   so every rank keeps the same account of each tile (TileState).
// * A task that writes no sharded tile runs on every rank (the forward and
//   backward on a rank's rows). A sharded tile it reads comes from its owner:
//   the owner sends it to every other rank, which receives it into its own
//   handle of the tile (a replica), once per op; at the end of the op the
//   replicas are dropped (invalidated, their memory freed), so a rank holds the
//   parameters of the op in flight beside its own shard.
// * A fetch is gated on the input of the op before it: its transfer starts when
//   that op can run, so the next op's parameters travel while the current one
//   computes, and no more than two ops' parameters are in flight.
// * A rank submits an op once all but its last two ops have run (ShardedOp), so
//   owners post their sends as they near an op themselves, and no rank runs
//   ahead of the others holding partial gradients they cannot yet take.
// * With the runtime's shard_keep_fetched, replicas stay past their op until
//   the owner writes the tile: a step fetches each parameter once.
//
// Gradients are accumulated by every rank for its rows, then summed up to the
// owner of each tile (ops/allreduce.cc with the owners as roots and no way
// back down), which makes the gradient sharded until it is consumed.
#pragma once

#include <starpu.h>

#include <cstdint>
#include <vector>

namespace jnntile {

struct Buffer;
struct TiledTensor;

// True once a tensor was sharded in this process: submissions ask nothing before.
bool sharding_in_use();
// Gives tile i of tensor `id` the owner owners[i]. Every rank shards the same tensors in the same
// order (the tiles' transfer tags count them), before anything writes them.
void tensor_shard(int64_t id, const std::vector<int>& owners);
// `id` sharded as `like` (same tiling, same owners), or left alone when `like` is not sharded.
void tensor_shard_like(int64_t id, int64_t like);
// Sharded until invalidated: a gradient summed up to its parameter's owners (ops/allreduce.cc), whose next
// step's partial sums every rank writes again.
void tensor_shard_until_invalidated(int64_t id, const std::vector<int>& owners);
// Back to every rank holding it (at its invalidation, for the above).
void tensor_unshard(TiledTensor& t);
// The owner of every tile of `id`, empty when it is not sharded.
std::vector<int> tensor_owners(int64_t id);
// The owner of the tile, -1 when every rank holds it.
int tile_owner(starpu_data_handle_t handle);

// Whether this rank submits a task on `buffers` (see above); posts the transfers of the sharded tiles it
// reads. Throws when a task writes tiles of two owners' shards, or of a shard and of every rank's.
bool shard_admit(const std::vector<Buffer>& buffers);

// Lives while an op submits its tasks: its start waits until all but the last 2 ops before it have run
// (the watchdog fails a wait that cannot end; not with shard_keep_fetched), its end drops the replicas the op
// fetched (kept with shard_keep_fetched) and marks the op's input for the next op's fetches. Ops nest (a host
// read inside an op): the outermost one counts.
class ShardedOp {
 public:
  ShardedOp();
  ~ShardedOp();
  ShardedOp(const ShardedOp&) = delete;
  ShardedOp& operator=(const ShardedOp&) = delete;
};

// The StarPU-MPI tag of a sharded tile's transfers: the tensor's shard key and the tile.
int64_t shard_tag(starpu_data_handle_t tile);

}  // namespace jnntile
