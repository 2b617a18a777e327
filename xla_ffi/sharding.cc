#include "sharding.h"

#include <atomic>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>

#include "distributed.h"
#include "task.h"

namespace jnntile {
namespace {

std::atomic<bool> in_use{false};

TileState* state_of(starpu_data_handle_t handle) {
  return static_cast<TileState*>(starpu_data_get_user_data(handle));
}

int my_rank() {
  static const int rank = mpi_world().first;
  return rank;
}

// The ops' bookkeeping: what the op in progress fetched, and the marks that gate fetches. Ops are submitted
// one after the other (XLA calls them in token order), so one state serves.
struct OpState {
  std::mutex mutex;
  int depth = 0;
  std::vector<starpu_data_handle_t> fetched;  // tiles whose replicas the op in progress brought
  starpu_data_handle_t gate = nullptr;        // written once the op before this one could run
  starpu_data_handle_t next_gate = nullptr;   // written once this op can run: the next op's gate
  // Keys of tensors sharded from Python (as models are built and programs traced) and of gradients sharded
  // when their sums run: two counters, as a rank may trace its next program while the last one runs.
  int64_t next_key = 0;
  int64_t next_summed_key = kSummedKeys;
  static constexpr int64_t kSummedKeys = int64_t(1) << 28;
  // The tasks submitted at the end of each of the last ops: an op starts once the tasks of all but the last
  // kOpsAhead ops have completed (see ShardedOp).
  std::deque<int64_t> op_ends;
  static constexpr size_t kOpsAhead = 2;
};

OpState& op_state() {
  static OpState* s = new OpState();
  return *s;
}

// Gates order a tile's transfers without changing its values: submitted past submit_task's bookkeeping
// (submit_task_unchecked), so no rank counts them (every rank must keep the same account of each tile).
struct NoArgs {};
void gate_kernel(void**, const NoArgs&) {}

starpu_codelet* gate_codelet() {
  static starpu_codelet* cl = codelet<NoArgs, gate_kernel>("shard_gate");
  return cl;
}

// The owner sends the tile to every other rank, which receives it into its replica once its gate (the op
// before has its input) is written. Sends of all but small tiles are synchronous (send_synchronously): their
// data moves when the receive is posted, so a rank ahead of another does not fill the other's memory with
// tiles it does not need yet (StarPU-MPI receives early data into memory of its own).
void fetch(starpu_data_handle_t tile, starpu_data_handle_t gate) {
  const auto [me, n] = mpi_world();
  const TileState* state = state_of(tile);
  const int64_t tag = shard_tag(tile);
  if (state->owner == me) {
    for (int r = 0; r < n; ++r)
      if (r != me) send_tile(tile, r, tag, send_synchronously(tile));
    return;
  }
  if (gate != nullptr) submit_task_unchecked(gate_codelet(), {{gate, STARPU_R}, {tile, STARPU_W}}, NoArgs{});
  receive_tile(tile, state->owner, tag);
}

}  // namespace

bool sharding_in_use() { return in_use.load(std::memory_order_relaxed); }

void tensor_shard(int64_t id, const std::vector<int>& owners) {
  TiledTensor& t = tensor_get(id);
  const int n = mpi_world().second;
  if (int64_t(owners.size()) != t.num_tiles())
    throw std::invalid_argument("sharding " + t.describe() + ": " + std::to_string(owners.size()) + " owners for " +
                                std::to_string(t.num_tiles()) + " tiles");
  for (int owner : owners)
    if (owner < 0 || owner >= n)
      throw std::invalid_argument("sharding " + t.describe() + ": rank " + std::to_string(owner) + " is not one of " +
                                  std::to_string(n));
  for (int64_t i = 0; i < t.num_tiles(); ++i)
    if (TileContent(t.tile_states[i].content.load()) != TileContent::NeverWritten)
      throw std::invalid_argument("sharding " + t.describe() + ": shard a tensor before anything writes it");
  OpState& s = op_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (t.shard_key < 0) t.shard_key = s.next_key++;
  if (t.shard_key >= OpState::kSummedKeys || t.num_tiles() >= (int64_t(1) << 32))
    throw std::invalid_argument("sharding " + t.describe() + ": beyond the range of StarPU-MPI tags");
  for (int64_t i = 0; i < t.num_tiles(); ++i) t.tile_states[i].owner = owners[size_t(i)];
  in_use.store(true);
}

void tensor_shard_like(int64_t id, int64_t like) {
  std::vector<int> owners = tensor_owners(like);
  if (!owners.empty()) {
    check_same_tiling(tensor_get(id), tensor_get(like), "tensor_shard_like");
    tensor_shard(id, owners);
  }
}

void tensor_shard_until_invalidated(int64_t id, const std::vector<int>& owners) {
  TiledTensor& t = tensor_get(id);
  {
    OpState& s = op_state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (t.shard_key < 0) t.shard_key = s.next_summed_key++;
  }
  for (int64_t i = 0; i < t.num_tiles(); ++i) {
    t.tile_states[i].owner = owners[size_t(i)];
    t.tile_states[i].replicas_fresh = false;
  }
  t.sharded_until_invalidated = true;
  in_use.store(true);
}

void tensor_unshard(TiledTensor& t) {
  for (int64_t i = 0; i < t.num_tiles(); ++i) t.tile_states[i].owner = -1;
  t.sharded_until_invalidated = false;
}

std::vector<int> tensor_owners(int64_t id) {
  const TiledTensor& t = tensor_get(id);
  if (t.num_tiles() == 0 || t.tile_states[0].owner < 0) return {};
  std::vector<int> owners;
  for (int64_t i = 0; i < t.num_tiles(); ++i) owners.push_back(t.tile_states[i].owner);
  return owners;
}

int tile_owner(starpu_data_handle_t handle) {
  const TileState* state = state_of(handle);
  return state == nullptr ? -1 : state->owner;
}

int64_t shard_tag(starpu_data_handle_t tile) {
  const TileState* state = state_of(tile);
  const TiledTensor& t = *state->tensor;
  const int64_t index = int64_t(state - t.tile_states.get());
  // Bit 62 keeps these apart from the gradient sums' tags (ops/allreduce.cc), which stay below it.
  return (int64_t(1) << 62) | (t.shard_key << 32) | index;
}

bool shard_admit(const std::vector<Buffer>& buffers) {
  const int me = my_rank();
  int writer = -1;
  bool writes_unsharded = false;
  for (const Buffer& b : buffers) {
    if (!(b.mode & STARPU_W)) continue;
    const int owner = tile_owner(b.handle);
    if (owner < 0) {
      writes_unsharded = true;
    } else if (writer >= 0 && owner != writer) {
      throw std::invalid_argument("a task writes tiles of the shards of ranks " + std::to_string(writer) + " and " +
                                  std::to_string(owner) + " (" + state_of(b.handle)->tensor->describe() +
                                  "): tensors updated together must be sharded alike");
    } else {
      writer = owner;
    }
  }
  if (writer >= 0 && writes_unsharded)
    throw std::invalid_argument("a task writes tiles of rank " + std::to_string(writer) +
                                "'s shard and tiles every rank holds: shard its outputs alike");
  for (const Buffer& b : buffers) {
    if (!(b.mode & STARPU_W)) continue;
    TileState* state = state_of(b.handle);
    if (state == nullptr) continue;
    // A replica kept past the op that fetched it (shard_keep_fetched) goes when its owner writes the tile.
    if (state->replicas_fresh && state->owner >= 0 && state->owner != me) starpu_data_invalidate_submit(b.handle);
    state->replicas_fresh = false;
  }
  if (writer >= 0 && writer != me) return false;

  OpState& s = op_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const Buffer& b : buffers) {
    if (!(b.mode & STARPU_R)) continue;
    TileState* state = state_of(b.handle);
    if (state == nullptr) continue;
    if (state->owner < 0) {
      if (s.next_gate == nullptr && TileContent(state->content.load()) == TileContent::Valid) {
        // Marked now, as the op reads it: the op may release its input before it ends.
        s.next_gate = temporary_vector(1, 1);
        submit_task_unchecked(gate_codelet(), {{b.handle, STARPU_R}, {s.next_gate, STARPU_W}}, NoArgs{});
      }
      continue;
    }
    if (writer >= 0) {
      if (state->owner != writer)
        throw std::invalid_argument("a task of rank " + std::to_string(writer) + "'s shard reads " +
                                    state->tensor->describe() + " of rank " + std::to_string(state->owner) +
                                    "'s: shard the tensors of an update alike");
      continue;
    }
    if (state->replicas_fresh) continue;
    fetch(b.handle, s.gate);
    state->replicas_fresh = true;
    if (!runtime_config().shard_keep_fetched) s.fetched.push_back(b.handle);  // else kept until written
  }
  return true;
}

// A rank submits an op once the tasks of the ops before its last kOpsAhead have completed. Unpaced, a rank
// submits a step at once, and the owners' sends, posted at submission, let it run its whole backward ahead of
// the others: it then holds its partial gradients of every tile a slower rank owns until that rank's sum
// takes them, while the slower rank, short of memory to compute its own, holds its partials for the faster
// one's tiles: under a memory limit, both wait for good (4 ranks, a limit of their share of the state + 20%).
// Paced, an owner posts an op's sends when it nears that op itself, so no rank runs more than a few ops ahead
// of the owners of what it reads, and the partial gradients a rank holds are those of the ops in flight.
// Ranks that keep what they fetch (shard_keep_fetched) are not paced: their plan holds every parameter and
// every partial gradient whole (planning/sharding.py), and pacing cost them a third of their speed (GPT-2
// 124M's shape on 2 ranks sharing 2 cores: 165 tokens/s paced, 253 unpaced, 234 replicated).
ShardedOp::ShardedOp() {
  if (!sharding_in_use()) return;
  OpState& s = op_state();
  int64_t wait_for = -1;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.depth++ > 0) return;
    if (s.op_ends.size() >= OpState::kOpsAhead) {
      wait_for = s.op_ends.front();
      s.op_ends.pop_front();
    }
  }
  if (wait_for < 0) return;
  if (wait_for > tasks_submitted()) {  // counts of an earlier runtime (stopped and started again) pace nothing
    std::lock_guard<std::mutex> lock(s.mutex);
    s.op_ends.clear();
    return;
  }
  try {
    wait_completed(wait_for, "the ops before this one (a rank with sharded state runs at most 2 ops ahead)");
  } catch (...) {  // no destructor runs for a constructor that throws
    std::lock_guard<std::mutex> lock(s.mutex);
    --s.depth;
    throw;
  }
}

ShardedOp::~ShardedOp() {
  if (!sharding_in_use()) return;
  OpState& s = op_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.depth == 0 || --s.depth > 0) return;
  if (!runtime_config().shard_keep_fetched) s.op_ends.push_back(tasks_submitted());
  const int me = my_rank();
  for (starpu_data_handle_t tile : s.fetched) {
    TileState* state = state_of(tile);
    state->replicas_fresh = false;
    if (state->owner != me) starpu_data_invalidate_submit(tile);
  }
  s.fetched.clear();
  if (s.next_gate == nullptr) return;
  // The next op's fetches wait for this op's input: they travel while this op runs.
  if (s.gate != nullptr) starpu_data_unregister_submit(s.gate);
  s.gate = s.next_gate;
  s.next_gate = nullptr;
}

}  // namespace jnntile
