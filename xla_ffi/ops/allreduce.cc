// Sum of gradient tiles over the MPI ranks, left bit-identical on every rank
// (data-parallel training: jnntile.optim.allreduce_sum).
//
// Tile i of a call is summed at its root rank roots[i] (the Python ownership
// mapping spreads roots over the ranks, so every rank sends and receives about
// the same bytes) in a fixed order, and the root's result goes back to every
// rank. Everything is submitted at once and runs as data arrives: a tile's
// transfers start when the backward tasks that write it finish, overlapping
// the rest of the backward, and nothing here blocks.
//
// Two schedules route a tile. "tree": a binomial tree rooted at the root, up
// for the sum and down for the result (2 log2(N) hops). "ring": partial sums
// pass root+1 -> root+2 -> ... -> root, the result root -> root+1 -> ...
// (2(N-1) hops). Both send 2(N-1)/N of the gradients per rank per step.
#include "distributed.h"
#include "kernels/elementwise.h"
#include "sharding.h"
#include "task.h"

#if JNNTILE_MPI
#include <starpu_mpi.h>

#include <cstdint>

namespace jnntile {
namespace {

enum class Schedule : int64_t { Tree = 0, Ring = 1 };

// What this rank does for one tile.
struct Route {
  std::vector<int> reduce_from;  // ranks whose partial sums this rank adds, in this order
  int reduce_to = -1;            // where this rank's partial sum goes
  int result_from = -1;          // where the result comes from
  std::vector<int> result_to;    // where this rank passes the result on
};

Route route(Schedule schedule, int root, int me, int n) {
  Route r;
  auto rank_at = [&](int position) { return (position % n + root) % n; };
  const int v = (me - root + n) % n;  // position relative to the root
  if (schedule == Schedule::Tree) {
    // Binomial tree: the children of v are v + 2^k for every 2^k below v's lowest set bit.
    for (int k = 1; k < n; k <<= 1) {
      if (v & k) {
        r.reduce_to = r.result_from = rank_at(v - k);
        break;
      }
      if (v + k < n) r.reduce_from.push_back(rank_at(v + k));
    }
    r.result_to.assign(r.reduce_from.rbegin(), r.reduce_from.rend());  // the largest subtree first
  } else {
    if (v != 1 % n) r.reduce_from.push_back(rank_at(v - 1 + n));
    if (v != 0) r.reduce_to = rank_at(v + 1);
    if (v != 0) r.result_from = rank_at(v - 1 + n);
    if (v != n - 1) r.result_to.push_back(rank_at(v + 1));
  }
  return r;
}

// Data tags: the call's key (distinct per traced allreduce, the same on every
// rank and every step), the tile's index in the call, and the phase. A tag is
// reused every step: a tile's next transfer with a tag starts only after the
// last one completed (each rank's gradient tile orders them).
constexpr int kTileBits = 39;
starpu_mpi_tag_t tag(int64_t key, int64_t tile, int phase) {
  return (key << (kTileBits + 1)) | (tile << 1) | phase;
}

struct GateArgs {};

// Runs when the local tile is final and only then makes the receive buffer
// writable. StarPU-MPI allocates a receive's buffer and posts it as soon as
// the buffer is writable: ungated, every partial sum of the step would hold a
// tile of memory (which the planner does not count) from submission on, and
// StarPU-MPI's thread would poll for them through the whole backward.
void gate_kernel(void**, const GateArgs&) {}

struct AddArgs {
  int64_t n;
};

// buffers: received partial sum, local tile (+=)
template <Device D>
void add_kernel(void** buffers, const AddArgs& a) {
  accumulate<D>(FloatType::F32, FloatType::F32, a.n, 1.0f, false, tile_ptr<float>(buffers[0]),
                tile_ptr<float>(buffers[1]));
}

// ids: the gradient tensors (every rank the same, in the same order);
// attrs: roots (one rank per tile, tensors in order, tiles row-major), schedule, key, and optionally
// to_owner = 1: the sums stay at their roots, the owners of the parameters' tiles in a run with sharded
// state (sharding.h), and the other ranks drop their partial sums once sent (a reduce-scatter).
void allreduce_submit(const OpCall& call) {
  if (!runtime_config().distributed)
    throw std::invalid_argument("allreduce needs the runtime started with distributed=True "
                                "(jnntile.runtime.start(distributed=True), under mpirun)");
  const auto [me, n] = mpi_world();
  const Index roots = attr_index(call.attrs, "roots");
  const auto schedule = Schedule(attr<int64_t>(call.attrs, "schedule"));
  const int64_t key = attr<int64_t>(call.attrs, "key");
  auto to_owner_attr = call.attrs.get<int64_t>("to_owner");
  const bool to_owner = !to_owner_attr.has_error() && to_owner_attr.value() != 0;
  int64_t tiles = 0;
  for (size_t i = 0; i < call.ids.size(); ++i) tiles += call.tensor(i).num_tiles();
  if (int64_t(roots.size()) != tiles)
    throw std::invalid_argument("allreduce: " + std::to_string(roots.size()) + " roots for " + std::to_string(tiles) +
                                " tiles");
  if (tiles >= (int64_t(1) << kTileBits) || key <= 0 || key >= (int64_t(1) << (62 - kTileBits)))
    throw std::invalid_argument("allreduce: tile count or key out of the range of StarPU-MPI tags");
  for (int64_t root : roots)
    if (root < 0 || root >= n)
      throw std::invalid_argument("allreduce: root " + std::to_string(root) + " is not a rank of " + std::to_string(n));

  static starpu_codelet* gate_cl = codelet<GateArgs, gate_kernel>("allreduce_gate");
  static starpu_codelet* add_cl = JNNTILE_CODELET(AddArgs, add_kernel, "allreduce_add");
  int64_t index = 0;
  for (size_t i = 0; i < call.ids.size(); ++i) {
    const TiledTensor& g = call.tensor(i);
    if (g.dtype != DType::F32) throw std::invalid_argument("allreduce: needs float32 tensors: " + g.describe());
    std::vector<int> owners;
    for (int64_t t = 0; t < g.num_tiles(); ++t, ++index) {
      owners.push_back(int(roots[size_t(index)]));
      const Route r = route(schedule, owners.back(), me, n);
      starpu_data_handle_t tile = g.tiles[t];
      // Partial sums of other ranks: gates (which only read the tile, so run together), receives,
      // then additions in the route's order, which fixes the order of the sum.
      std::vector<starpu_data_handle_t> partials;
      for (size_t c = 0; c < r.reduce_from.size(); ++c) {
        partials.push_back(temporary_vector(starpu_vector_get_nx(tile), sizeof(float)));
        submit_task(gate_cl, {{tile, STARPU_R}, {partials.back(), STARPU_W}}, GateArgs{});
      }
      for (size_t c = 0; c < r.reduce_from.size(); ++c) receive_tile(partials[c], r.reduce_from[c], tag(key, index, 0));
      for (starpu_data_handle_t partial : partials) {
        submit_task(add_cl, {{partial, STARPU_R}, {tile, STARPU_RW}}, AddArgs{g.tile_numel(t)},
                    double(g.tile_numel(t)));
        starpu_data_unregister_submit(partial);
      }
      // Sums to owners go as the sharded state's fetches do (send_synchronously): a partial sum sent ahead of
      // its receive would wait in memory of StarPU-MPI's on a rank that may have none to spare.
      if (r.reduce_to >= 0) send_tile(tile, r.reduce_to, tag(key, index, 0), to_owner && send_synchronously(tile));
      if (to_owner) {
        // Its memory goes once the send read it; every rank still counts the tile as holding values.
        if (owners.back() != me) starpu_data_invalidate_submit(tile);
        continue;
      }
      if (r.result_from >= 0) receive_tile(tile, r.result_from, tag(key, index, 1));
      for (int dest : r.result_to) send_tile(tile, dest, tag(key, index, 1));
    }
    if (to_owner) tensor_shard_until_invalidated(g.id, owners);
  }
}
JNNTILE_OP(allreduce, allreduce_submit);

}  // namespace
}  // namespace jnntile

#endif  // JNNTILE_MPI
