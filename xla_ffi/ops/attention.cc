// Causal self-attention, FlashAttention-2 style, multi-head or grouped-query.
//
// qkv: (B, T, G + 2, H, D) tiles (tb, tt, 1, th, D): G query heads share each of
// the H key/value heads (grouped-query attention; G = 1 is multi-head attention,
// GPT-2's (B, T, 3, H, D)). Axis 2 index g < G holds the queries of group
// member g, index G the keys, G + 1 the values, so every query, key and value
// of a (batch, seq, head) block is a tile of its own and D is whole.
// out: (B, T, G, H, D) tiles (tb, tt, 1, th, D); lse: (B, T, G, H) tiles
// (tb, tt, 1, th), the logsumexp of each query row, kept for the backward. With
// G = 1 out and lse may leave out the G axis: (B, T, H, D) and (B, T, H).
//
// Forward, for every (batch tile, head tile, query tile i): one task per key
// tile j <= i (later key tiles are entirely in the future) updates out_i and
// the running (max, sum) per row in a temporary handle with an online softmax,
// the first write-only; the last (j = i) then normalises out_i and writes lse_i. A
// task takes the query tiles of all G members of the group, so each key and value
// tile is read once per group, not once per query head.
//
// Backward: one task per pair (i, j <= i) and group recomputes P = exp(S - lse)
// and accumulates into the dq_i tiles of the group and the dk_j and dv_j tiles of
// grad(qkv), the group members in order; the first (j = 0) computes
// delta_i = rowsum(dout_i * out_i), which they all read, before its product.
//
// The scores of a pair exist only in its task's STARPU_SCRATCH buffer, which
// StarPU allocates on the node that runs the task (kernels/attention.h: th
// (tt, tt) blocks, twice in the backward, reused by the group members), so
// memory does not grow with T^2.
//
// bfloat16 qkv, out and their gradients: on a GPU, and on a CPU whose BLAS multiplies bfloat16 (oneMKL), the
// steps multiply the bfloat16 tiles as they are (attention_*_step_bf16); elsewhere each task widens the
// bfloat16 tiles it only reads into its scratch (after the score blocks, `Widened`). Each tile the op writes
// or accumulates (out, dqkv) sums in a float32 temporary (Float32Tiles), as a bfloat16 product sums in
// float32 across K tiles (ops/gemm.cc), which the tasks themselves start and round: the forward's first
// step writes out's, its finish rounds it into out; the first backward step to touch a dqkv tile zeroes its
// sums or widens the tile, the last rounds them (SumsEnds). Stored activations stay bfloat16; the float32
// copies live during a task or the op only. (Widening and rounding in tasks of their own took 24 convert
// tasks per layer of SmolLM's shape at 4 x 256, 48 us each and as much submission.)
//
// Packed batches (document masking): rows of several examples pass `starts` (B, T) int32, tiled (tb, tt),
// the first position of each position's example (ops/attention.py derives it from the segments); query t
// sees keys starts[t] .. t. Its values also come as extra input 0, read on the host when the op submits (as
// `pos` below; they are data, so one compiled step serves every batch), which classifies each pair of the
// batch tile: wholly outside every query's example (not submitted: a query tile's steps run from the first key
// tile any of its queries sees, which is where the `first` of the forward, delta and dq start), wholly inside
// (the causal steps as they are), or mixed, whose task also reads the starts tile of its queries and masks per
// element (AttentionPair::starts). Every row sees at least its own key, so no row ends empty.
//
// Incremental decoding (no backward): a key/value cache (B, T_max, 2, H, D)
// tiled (tb, tc, 1, th, D) holds the keys (axis 2 index 0) and values (1) of the
// positions so far. `attention_cache_write` copies the k and v of qkv, whose
// rows are the positions pos .. pos + T - 1, into it; `attention_cached` runs the
// forward steps above for each query tile of qkv against the cache tiles up to
// its last position, then the finish. Both read `pos` from an extra int32 input
// when they submit (DESIGN invariant 4: as an attribute, every step would
// compile its own program) and touch only the cache tiles up to pos + T, so a
// decoding step costs O(pos), not a forward over the whole cache.
#include <algorithm>
#include <cmath>
#include <functional>

#include <map>
#include <utility>

#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "ops/values.h"
#include "task.h"

namespace jnntile {
namespace {

// float32 stand-ins for the tiles of a tensor: the tiles themselves when it is float32; for a bfloat16
// tensor, a float32 temporary per tile used, widened from the tile (Start::Widened) or left for the tasks to
// start (Start::Unwritten: the first task to touch it writes it whole, and the last rounds it into the tile).
enum class Start { Widened, Unwritten };
class Float32Tiles {
 public:
  Float32Tiles(const TiledTensor& t, Start start) : t_(t), start_(start) {}
  Float32Tiles(const Float32Tiles&) = delete;
  ~Float32Tiles() { STARPU_ASSERT_MSG(temps_.empty(), "Float32Tiles: finish() was not called"); }

  starpu_data_handle_t tile(const Index& coord) {
    const int64_t linear = t_.tile_linear(coord);
    if (t_.dtype == DType::F32) return t_.tiles[linear];
    auto found = temps_.find(linear);
    if (found != temps_.end()) return found->second;
    starpu_data_handle_t temp = temporary_vector(t_.tile_numel(linear), sizeof(float));
    if (start_ == Start::Widened)
      submit_convert(t_.tiles[linear], FloatType::BF16, temp, FloatType::F32, t_.tile_numel(linear));
    temps_.emplace(linear, temp);
    return temp;
  }

  // After every task on the tiles has been submitted.
  void finish() {
    for (auto [linear, temp] : temps_) starpu_data_unregister_submit(temp);
    temps_.clear();
  }

 private:
  const TiledTensor& t_;
  const Start start_;
  std::map<int64_t, starpu_data_handle_t> temps_;
};

// The float32 view of the tiles a task only reads: a float32 tile as it is, a bfloat16 one widened into the
// task's scratch, from `space` on (CPU or GPU alike, in the task's stream).
template <Device D>
class Widened {
 public:
  explicit Widened(float* space) : next_(space) {}
  float* operator()(void* buffer, FloatType type, int64_t n) {
    if (type == FloatType::F32) return tile_ptr<float>(buffer);
    float* widened = next_;
    next_ += n;
    convert<D>(n, FloatType::BF16, tile_ptr<void>(buffer), FloatType::F32, widened);
    return widened;
  }

 private:
  float* next_;
};

// Elements of a pair's query-side tile (q, out, dout) and key-side tile (k, v).
int64_t query_rows(const AttentionPair& p) { return p.nb * p.nq * p.nh; }  // of lse, the stats and delta
int64_t query_tile_size(const AttentionPair& p) { return query_rows(p) * p.d; }
int64_t key_tile_size(const AttentionPair& p) { return p.nb * p.nk * p.nh * p.d; }

// Scratch floats for widening a step's read tiles: G query-side tiles `per_query` times, key and value.
int64_t widened_floats(const AttentionPair& p, int64_t groups, FloatType q_type, FloatType kv_type,
                       int64_t per_query) {
  return (q_type == FloatType::BF16 ? per_query * groups * query_tile_size(p) : 0) +
         (kv_type == FloatType::BF16 ? 2 * key_tile_size(p) : 0);
}

// Whether a step multiplies bfloat16 operands as they are (attention_*_step_bf16): with q, k and v all
// bfloat16. Elsewhere (a float32 cache's keys and values) the tiles are widened.
bool bf16_operands(FloatType q_type, FloatType kv_type) {
  return q_type == FloatType::BF16 && kv_type == FloatType::BF16;
}

// Whether a GPU runs a step in the fused kernels (kernels/cuda/attention.cu): bfloat16 q, k and v, head_dim 64
// and the runtime's fused_attention. Such steps take codelets of their own (named "..._fused"; a CPU worker
// runs them as the others), so dmdas keeps the timings of the two kinds apart and a profile says which ran.
bool fused_step(const AttentionPair& p, FloatType q_type, FloatType kv_type) {
  return bf16_operands(q_type, kv_type) && runtime_config().fused_attention && p.d == attention::kFusedHeadDim;
}

// Scratch floats of a step, sized before StarPU picks the worker: the score blocks and the widened tiles; with
// bfloat16 operands, what the bfloat16 steps need instead: one head's blocks on a CPU, all heads' on a GPU
// unless its fused steps take them (they need none). All heads' blocks of a GPT-2 124M backward step in tiles
// of 1024 tokens are 126 MB.
int64_t step_scratch_floats(const AttentionPair& p, int64_t groups, FloatType q_type, FloatType kv_type,
                            bool backward) {
  if (bf16_operands(q_type, kv_type)) {
    const bool all_heads = starpu_cuda_worker_get_count() > 0 && !fused_step(p, q_type, kv_type);
    return attention::bf16_scratch_size(p, backward, all_heads ? p.nh : 1);
  }
  return backward ? attention::backward_scratch_size(p) + widened_floats(p, groups, q_type, kv_type, 2)
                  : attention::forward_scratch_size(p) + widened_floats(p, groups, q_type, kv_type, 1);
}

struct StepArgs {
  bool first;
  bool finish;                  // the query tile's last step: it also finishes the rows (see forward_step_kernel)
  int64_t groups;               // G query tiles per key/value tile
  FloatType q_type, kv_type;    // of the q tiles and of the k and v tiles (a cache's are float32); out is q's
  AttentionPair pair;
  int64_t starts_buffer;        // the buffer of the query tile's starts (document masking), or -1
};

// The pair of a task, with its starts where the task masks per document (the last buffer, `starts_buffer`).
AttentionPair task_pair(void** buffers, const AttentionPair& pair, int64_t starts_buffer) {
  AttentionPair p = pair;
  if (starts_buffer >= 0) p.starts = tile_ptr<int32_t>(buffers[starts_buffer]);
  return p;
}

// buffers: q_g (G), k_j, v_j, out_g (G, float32: the tiles or their sums), stats_g (G), scratch, then in a
// finishing step lse_g (G) and, where out is bfloat16, the out_g tiles (G), then the starts tile where the
// step masks per document.
// A finishing step normalises out_g, writes lse_g and rounds a bfloat16 out_g from its float32 sums after its
// product, in its own task: a finish task per query tile was 12 of GPT-2 124M's tasks per step and, on a GPU,
// a link of its own in the forward's chain of dependent tasks.
template <Device D>
void forward_step_kernel(void** buffers, const StepArgs& a) {
  const int64_t G = a.groups;
  const AttentionPair pair = task_pair(buffers, a.pair, a.starts_buffer);
  float* scratch = tile_ptr<float>(buffers[3 * G + 2]);
  auto at = [&](int64_t index) { return tile_ptr<float>(buffers[index]); };
  if (bf16_operands(a.q_type, a.kv_type)) {
    auto bf16 = [&](int64_t index) { return tile_ptr<bfloat16>(buffers[index]); };
    for (int64_t g = 0; g < G; ++g)
      attention_forward_step_bf16<D>(a.first, pair, bf16(g), bf16(G), bf16(G + 1), at(G + 2 + g),
                                     at(2 * G + 2 + g), scratch);
  } else {
    const int64_t q = query_tile_size(pair), kv = key_tile_size(pair);
    Widened<D> widen(scratch + attention::forward_scratch_size(pair));
    float *k = widen(buffers[G], a.kv_type, kv), *v = widen(buffers[G + 1], a.kv_type, kv);
    for (int64_t g = 0; g < G; ++g)
      attention_forward_step<D>(a.first, pair, widen(buffers[g], a.q_type, q), k, v, at(G + 2 + g),
                                at(2 * G + 2 + g), scratch);
  }
  if (!a.finish) return;
  const int64_t rows = query_rows(a.pair);
  for (int64_t g = 0; g < G; ++g) {
    attention_forward_finish<D>(rows, a.pair.d, at(2 * G + 2 + g), at(G + 2 + g), at(3 * G + 3 + g));
    if (a.q_type == FloatType::BF16)
      convert<D>(rows * a.pair.d, FloatType::F32, at(G + 2 + g), FloatType::BF16,
                 tile_ptr<void>(buffers[4 * G + 3 + g]));
  }
}

// The buffers a finishing step adds (forward_step_kernel): lse_g, and the bfloat16 out_g tiles its float32
// sums are rounded into (out32 then never writes them back).
void add_finish_buffers(std::vector<Buffer>& buffers, const TiledTensor& out,
                        const std::vector<starpu_data_handle_t>& lse, const std::vector<Index>& out_coords) {
  for (starpu_data_handle_t handle : lse) buffers.push_back({handle, STARPU_W});
  if (out.dtype == DType::BF16)
    for (const Index& coord : out_coords) buffers.push_back({out.tile(coord), STARPU_W});
}

// How a backward step treats the float32 sums of the gradient tiles it adds to (dq_g, or dk_j and dv_j) where
// dqkv is bfloat16: the first step to touch a tile starts its sums (at zero where dqkv holds nothing yet, else
// widened from the tile) and the last rounds them into the tile, in the same tasks as their products (a fill
// and a conversion task per tile were 144 of GPT-2 124M's 2,193 tasks per step in bfloat16 at 4 x 256).
enum class SumsStart : uint8_t { Continue, Zeros, Widened };
struct SumsEnds {
  SumsStart start = SumsStart::Continue;
  bool round = false;
  // Whether the step's task takes the bfloat16 tiles, and how.
  bool takes_tiles() const { return start == SumsStart::Widened || round; }
  starpu_data_access_mode tiles_mode() const {
    return start == SumsStart::Widened ? (round ? STARPU_RW : STARPU_R) : STARPU_W;
  }
  starpu_data_access_mode sums_mode() const { return start == SumsStart::Continue ? STARPU_RW : STARPU_W; }
};

template <Device D>
void start_sums(const SumsEnds& ends, int64_t n, const void* tile, float* sums) {
  if (ends.start == SumsStart::Zeros) fill<D>(n, 0.0f, sums);
  if (ends.start == SumsStart::Widened) convert<D>(n, FloatType::BF16, tile, FloatType::F32, sums);
}

template <Device D>
void end_sums(const SumsEnds& ends, int64_t n, const float* sums, void* tile) {
  if (ends.round) convert<D>(n, FloatType::F32, sums, FloatType::BF16, tile);
}

struct BackwardArgs {
  int64_t groups;
  FloatType type;  // of the q, k, v, out and dout tiles
  bool delta;      // the query tile's first step: it computes delta_g first (see backward_step_kernel)
  SumsEnds dq, dkv;
  AttentionPair pair;
  int64_t starts_buffer;  // as StepArgs'
};

// Scratch floats the delta of a query tile needs: out and dout widened where they are bfloat16.
int64_t delta_scratch_floats(const AttentionPair& p, FloatType type) {
  return type == FloatType::BF16 ? 2 * query_tile_size(p) : 0;
}

// The step itself, on the float32 gradient tiles (buffers as in backward_step_kernel below).
template <Device D>
void backward_steps(void** buffers, const BackwardArgs& a) {
  const int64_t G = a.groups;
  const AttentionPair pair = task_pair(buffers, a.pair, a.starts_buffer);
  float* scratch = tile_ptr<float>(buffers[5 * G + 4]);
  auto at = [&](int64_t index) { return tile_ptr<float>(buffers[index]); };
  if (bf16_operands(a.type, a.type)) {
    auto bf16 = [&](int64_t index) { return tile_ptr<bfloat16>(buffers[index]); };
    for (int64_t g = 0; g < G; ++g)
      attention_backward_step_bf16<D>(pair, bf16(g), bf16(G), bf16(G + 1), bf16(G + 2 + g), at(2 * G + 2 + g),
                                      at(3 * G + 2 + g), at(4 * G + 2 + g), at(5 * G + 2), at(5 * G + 3), scratch);
    return;
  }
  const int64_t q = query_tile_size(pair), kv = key_tile_size(pair);
  Widened<D> widen(scratch + attention::backward_scratch_size(pair));
  float *k = widen(buffers[G], a.type, kv), *v = widen(buffers[G + 1], a.type, kv);
  for (int64_t g = 0; g < G; ++g)
    attention_backward_step<D>(pair, widen(buffers[g], a.type, q), k, v, widen(buffers[G + 2 + g], a.type, q),
                               at(2 * G + 2 + g), at(3 * G + 2 + g), at(4 * G + 2 + g), at(5 * G + 2),
                               at(5 * G + 3), scratch);
}

// buffers: q_g (G), k_j, v_j, dout_g (G), lse_g (G), delta_g (G), dq_g (G), dk_j, dv_j (float32: the tiles or
// their sums), scratch, then the bfloat16 dq_g (G) where a.dq.takes_tiles(), dk_j, dv_j where
// a.dkv.takes_tiles(), out_g (G) where a.delta, and the starts tile where the step masks per document.
// The query tile's first step computes delta_g = rowsum(dout_g * out_g) before its product, in its scratch's
// space (before the step's own use of it): a delta task per query tile was 12 of GPT-2 124M's tasks per step
// and, on a GPU, a link of its own in the backward's chain of dependent tasks.
template <Device D>
void backward_step_kernel(void** buffers, const BackwardArgs& a) {
  const int64_t G = a.groups, q = query_tile_size(a.pair), kv = key_tile_size(a.pair);
  int64_t next = 5 * G + 5;
  void** dq_tiles = a.dq.takes_tiles() ? buffers + std::exchange(next, next + G) : nullptr;
  void** dkv_tiles = a.dkv.takes_tiles() ? buffers + std::exchange(next, next + 2) : nullptr;
  auto tile = [](void** tiles, int64_t index) { return tiles == nullptr ? nullptr : tile_ptr<void>(tiles[index]); };
  auto sums = [&](int64_t index) { return tile_ptr<float>(buffers[index]); };
  for (int64_t g = 0; a.delta && g < G; ++g) {
    Widened<D> widen(tile_ptr<float>(buffers[5 * G + 4]));
    attention_backward_delta<D>(query_rows(a.pair), a.pair.d, widen(buffers[next + g], a.type, q),
                                widen(buffers[G + 2 + g], a.type, q), sums(3 * G + 2 + g));
  }
  for (int64_t g = 0; g < G; ++g) start_sums<D>(a.dq, q, tile(dq_tiles, g), sums(4 * G + 2 + g));
  for (int64_t x = 0; x < 2; ++x) start_sums<D>(a.dkv, kv, tile(dkv_tiles, x), sums(5 * G + 2 + x));
  backward_steps<D>(buffers, a);
  for (int64_t g = 0; g < G; ++g) end_sums<D>(a.dq, q, sums(4 * G + 2 + g), tile(dq_tiles, g));
  for (int64_t x = 0; x < 2; ++x) end_sums<D>(a.dkv, kv, sums(5 * G + 2 + x), tile(dkv_tiles, x));
}

// The same kernels for the fused steps' codelets (fused_step): a codelet is declared once per kernel.
template <Device D>
void fused_forward_step_kernel(void** buffers, const StepArgs& a) {
  forward_step_kernel<D>(buffers, a);
}
template <Device D>
void fused_backward_step_kernel(void** buffers, const BackwardArgs& a) {
  backward_step_kernel<D>(buffers, a);
}

// The tile grid shared by qkv, out and lse, checked once.
struct Layout {
  int64_t gb, gt, gh;  // tiles on B, T, H
  int64_t groups;      // G
  bool group_axis;     // out and lse have the G axis
  int64_t tt, d;
  float scale;
  Index out_coord(int64_t ib, int64_t i, int64_t g, int64_t ih) const {
    return group_axis ? Index{ib, i, g, ih, 0} : Index{ib, i, ih, 0};
  }
  starpu_data_handle_t lse_tile(const TiledTensor& lse, int64_t ib, int64_t i, int64_t g, int64_t ih) const {
    return group_axis ? lse.tile({ib, i, g, ih}) : lse.tile({ib, i, ih});
  }
};

void check_qkv(const TiledTensor& qkv, const std::function<void(const std::string&)>& fail) {
  if ((qkv.dtype != DType::F32 && qkv.dtype != DType::BF16) || qkv.ndim() != 5 || qkv.shape[2] < 3)
    fail("qkv must be float32 or bfloat16 (B, T, G + 2, H, D)");
  if (qkv.tile_shape[2] != 1 || qkv.tile_shape[4] != qkv.shape[4]) fail("qkv tiles must be (tb, tt, 1, th, D)");
}

// out (B, T, G, H, D) tiled (tb, tt, 1, th, D), or without the G axis where G = 1.
bool check_out(const TiledTensor& qkv, const TiledTensor& out, const std::function<void(const std::string&)>& fail) {
  const Index &s = qkv.shape, &ts = qkv.tile_shape;
  const int64_t G = s[2] - 2;
  const bool group_axis = out.ndim() == 5;
  if (out.dtype != qkv.dtype || (!group_axis && G != 1) ||
      out.shape != (group_axis ? Index{s[0], s[1], G, s[3], s[4]} : Index{s[0], s[1], s[3], s[4]}) ||
      out.tile_shape != (group_axis ? Index{ts[0], ts[1], 1, ts[3], ts[4]} : Index{ts[0], ts[1], ts[3], ts[4]}))
    fail("out must have qkv's dtype and be (B, T, G, H, D) tiled (tb, tt, 1, th, D) (where G = 1 also "
         "(B, T, H, D) tiled (tb, tt, th, D))");
  return group_axis;
}

Layout check_layout(const TiledTensor& qkv, const TiledTensor& out, const TiledTensor& lse, const char* op) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(op) + ": " + why + ": qkv " + qkv.describe() + ", out " +
                                out.describe() + ", lse " + lse.describe());
  };
  check_qkv(qkv, fail);
  const bool group_axis = check_out(qkv, out, fail);
  const Index &s = qkv.shape, &ts = qkv.tile_shape;
  const int64_t G = s[2] - 2;
  if (lse.dtype != DType::F32 || lse.shape != (group_axis ? Index{s[0], s[1], G, s[3]} : Index{s[0], s[1], s[3]}) ||
      lse.tile_shape != (group_axis ? Index{ts[0], ts[1], 1, ts[3]} : Index{ts[0], ts[1], ts[3]}))
    fail("lse must be float32 like out without D");
  return {qkv.grid[0], qkv.grid[1], qkv.grid[3], G, group_axis, ts[1], s[4], float(1.0 / std::sqrt(double(s[4])))};
}

// The pair (query tile i, key tile j) of batch tile ib and head tile ih.
AttentionPair pair_of(const TiledTensor& qkv, const Layout& l, int64_t ib, int64_t ih, int64_t i, int64_t j) {
  Index q_ext = qkv.tile_extent({ib, i, 0, ih, 0}), k_ext = qkv.tile_extent({ib, j, 0, ih, 0});
  return {q_ext[0], q_ext[3], q_ext[1], k_ext[1], l.d, i * l.tt, j * l.tt, l.scale};
}

double pair_flops(const AttentionPair& p) { return double(p.nb) * p.nh * p.nq * p.nk * p.d; }

// Document masking (see the top of the file): which pairs of a batch tile run, which mask per element, and
// the tiles of the starts they read. Without a starts tensor every pair j <= i runs, unmasked.
class Documents {
 public:
  // starts: call's tensor `index` and extra input 0, where the call has that tensor.
  Documents(const OpCall& call, size_t index, const TiledTensor& qkv, const Layout& l, const char* op) : l_(l) {
    if (call.ids.size() <= index) return;
    starts_ = &call.tensor(index);
    const int64_t B = qkv.shape[0], T = qkv.shape[1];
    if (starts_->dtype != DType::I32 || starts_->shape != Index{B, T} ||
        starts_->tile_shape != Index{qkv.tile_shape[0], qkv.tile_shape[1]})
      throw std::invalid_argument(std::string(op) + ": the example starts must be int32 (B, T) tiled (tb, tt) like "
                                  "qkv's rows: " + starts_->describe() + ", qkv " + qkv.describe());
    if (call.inputs.empty() || call.inputs[0].element_type() != ffi::DataType::S32 ||
        int64_t(call.inputs[0].element_count()) != B * T)
      throw std::invalid_argument(std::string(op) + ": the example starts need their values as an int32 (B, T) "
                                  "extra input");
    const int32_t* host = static_cast<const int32_t*>(call.inputs[0].untyped_data());
    // Per query tile of each batch tile, the smallest and largest start of its queries.
    low_.assign(l.gb * l.gt, T);
    high_.assign(l.gb * l.gt, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int32_t start = host[b * T + t];
        if (start < 0 || start > t)
          throw std::invalid_argument(std::string(op) + ": example start " + std::to_string(start) + " of position " +
                                      std::to_string(t) + " (batch row " + std::to_string(b) +
                                      ") must lie in [0, " + std::to_string(t) + "]: an example starts at or "
                                      "before its positions");
        const int64_t tile = b / qkv.tile_shape[0] * l.gt + t / l.tt;
        low_[tile] = std::min<int64_t>(low_[tile], start);
        high_[tile] = std::max<int64_t>(high_[tile], start);
      }
  }

  // The first key tile some query of query tile i sees: the tile's first step.
  int64_t first(int64_t ib, int64_t i) const { return starts_ ? low_[ib * l_.gt + i] / l_.tt : 0; }
  // The last query tile whose queries see key tile j: the last step on its dk, dv.
  int64_t last(int64_t ib, int64_t j) const {
    int64_t last = j;
    for (int64_t i = j + 1; i < l_.gt; ++i)
      if (first(ib, i) <= j) last = i;
    return last;
  }
  // Where pair (i, j) masks per element (some query of tile i starts after key tile j's first key), adds
  // the starts tile to its buffers and returns its index; else -1.
  int64_t add_buffer(std::vector<Buffer>& buffers, int64_t ib, int64_t i, int64_t j) const {
    if (!starts_ || high_[ib * l_.gt + i] <= j * l_.tt) return -1;
    buffers.push_back({starts_->tile({ib, i}), STARPU_R});
    return int64_t(buffers.size()) - 1;
  }

 private:
  const Layout& l_;
  const TiledTensor* starts_ = nullptr;
  std::vector<int64_t> low_, high_;
};

// ids [qkv, out, lse] or, packed, [qkv, out, lse, starts] with inputs [starts]
void attention_submit(const OpCall& call) {
  const TiledTensor &qkv = call.tensor(0), &out = call.tensor(1), &lse = call.tensor(2);
  const Layout l = check_layout(qkv, out, lse, "causal_attention");
  const Documents documents(call, 3, qkv, l, "causal_attention");
  const int64_t G = l.groups;
  const FloatType type = float_type(qkv, "causal_attention");
  Float32Tiles out32(out, Start::Unwritten);  // the first steps write it, the finish tasks round it
  static starpu_codelet* step_cl = JNNTILE_CODELET(StepArgs, forward_step_kernel, "attention_forward_step");
  static starpu_codelet* fused_cl =
      JNNTILE_CODELET(StepArgs, fused_forward_step_kernel, "attention_forward_step_fused");
  for (int64_t ib = 0; ib < l.gb; ++ib)
    for (int64_t ih = 0; ih < l.gh; ++ih)
      for (int64_t i = 0; i < l.gt; ++i) {
        const int64_t rows = query_rows(pair_of(qkv, l, ib, ih, i, i));
        // stats_g: (tb, tt, th, 2) running max and sum of group member g's query tile
        std::vector<starpu_data_handle_t> stats(G), lse_tiles(G);
        std::vector<Index> out_coords(G);
        for (auto& handle : stats) handle = temporary_vector(rows * 2, sizeof(float));
        for (int64_t g = 0; g < G; ++g) {
          lse_tiles[g] = l.lse_tile(lse, ib, i, g, ih);
          out_coords[g] = l.out_coord(ib, i, g, ih);
        }
        const int64_t j0 = documents.first(ib, i);
        for (int64_t j = j0; j <= i; ++j) {
          AttentionPair p = pair_of(qkv, l, ib, ih, i, j);
          starpu_data_access_mode mode = j == j0 ? STARPU_W : STARPU_RW;
          std::vector<Buffer> buffers;
          for (int64_t g = 0; g < G; ++g) buffers.push_back({qkv.tile({ib, i, g, ih, 0}), STARPU_R});
          buffers.push_back({qkv.tile({ib, j, G, ih, 0}), STARPU_R});
          buffers.push_back({qkv.tile({ib, j, G + 1, ih, 0}), STARPU_R});
          for (const Index& coord : out_coords) buffers.push_back({out32.tile(coord), mode});
          for (int64_t g = 0; g < G; ++g) buffers.push_back({stats[g], mode});
          starpu_data_handle_t scratch = temporary_vector(step_scratch_floats(p, G, type, type, false), sizeof(float));
          buffers.push_back({scratch, STARPU_SCRATCH});
          if (j == i) add_finish_buffers(buffers, out, lse_tiles, out_coords);
          const int64_t starts = documents.add_buffer(buffers, ib, i, j);
          submit_task(fused_step(p, type, type) ? fused_cl : step_cl, buffers,
                      StepArgs{j == j0, j == i, G, type, type, p, starts}, 4.0 * G * pair_flops(p));
          starpu_data_unregister_submit(scratch);
        }
        for (starpu_data_handle_t handle : stats) starpu_data_unregister_submit(handle);
      }
  out32.finish();
}
JNNTILE_OP(attention, attention_submit);

// ids [qkv, out, lse, dout, dqkv or -1] and, packed, starts with inputs [starts]: grad(qkv) += the attention
// backward. Attr fresh: a bfloat16 dqkv holds
// nothing yet (its zero-fill was pending), so its float32 sums start at zero, not widened from a fill.
void attention_backward_submit(const OpCall& call) {
  if (call.ids.size() != 5 && call.ids.size() != 6)
    throw std::invalid_argument("causal_attention backward: needs 5 tensor ids, or 6 with the example starts");
  if (call.ids[4] < 0) return;  // nobody differentiates qkv
  const TiledTensor &qkv = call.tensor(0), &out = call.tensor(1), &lse = call.tensor(2), &dout = call.tensor(3),
                    &dqkv = call.tensor(4);
  const Layout l = check_layout(qkv, out, lse, "causal_attention backward");
  const Documents documents(call, 5, qkv, l, "causal_attention backward");
  check_same_tiling(out, dout, "causal_attention backward");
  check_same_tiling(qkv, dqkv, "causal_attention backward");
  if (dout.dtype != out.dtype || dqkv.dtype != qkv.dtype)
    throw std::invalid_argument("causal_attention backward: gradients must have their tensors' dtypes: " +
                                dout.describe() + ", " + dqkv.describe());
  const int64_t G = l.groups;
  const FloatType type = float_type(qkv, "causal_attention backward");
  const bool fresh = attr<int64_t>(call.attrs, "fresh") != 0;
  if (fresh && type != FloatType::BF16)
    throw std::invalid_argument("causal_attention backward: only a bfloat16 dqkv can start fresh (its float32 "
                                "sums start at zero); a float32 one is accumulated into");
  Float32Tiles dqkv32(dqkv, Start::Unwritten);  // the steps start and round the sums of a bfloat16 dqkv
  // The steps of query tile i touch dq_i from key tile documents.first(ib, i) to i, and dk_j, dv_j in query
  // tiles j to documents.last(ib, j). A float32 dqkv is its own sums, accumulated into.
  auto ends = [&](bool first, bool last) {
    if (type != FloatType::BF16) return SumsEnds{};
    return SumsEnds{first ? (fresh ? SumsStart::Zeros : SumsStart::Widened) : SumsStart::Continue, last};
  };
  static starpu_codelet* step_cl = JNNTILE_CODELET(BackwardArgs, backward_step_kernel, "attention_backward_step");
  static starpu_codelet* fused_cl =
      JNNTILE_CODELET(BackwardArgs, fused_backward_step_kernel, "attention_backward_step_fused");
  for (int64_t ib = 0; ib < l.gb; ++ib) {
    std::vector<int64_t> last(l.gt);
    for (int64_t j = 0; j < l.gt; ++j) last[j] = documents.last(ib, j);
    for (int64_t ih = 0; ih < l.gh; ++ih)
      for (int64_t i = 0; i < l.gt; ++i) {
        const int64_t rows = query_rows(pair_of(qkv, l, ib, ih, i, i));
        // delta_g: (tb, tt, th) rowsum(dout * out) of group member g's query tile, written by its first step
        std::vector<starpu_data_handle_t> delta(G);
        std::vector<Index> out_coords(G);
        for (auto& handle : delta) handle = temporary_vector(rows, sizeof(float));
        for (int64_t g = 0; g < G; ++g) out_coords[g] = l.out_coord(ib, i, g, ih);
        const int64_t j0 = documents.first(ib, i);
        for (int64_t j = j0; j <= i; ++j) {
          AttentionPair p = pair_of(qkv, l, ib, ih, i, j);
          std::vector<Buffer> buffers;
          for (int64_t g = 0; g < G; ++g) buffers.push_back({qkv.tile({ib, i, g, ih, 0}), STARPU_R});
          buffers.push_back({qkv.tile({ib, j, G, ih, 0}), STARPU_R});
          buffers.push_back({qkv.tile({ib, j, G + 1, ih, 0}), STARPU_R});
          for (const Index& coord : out_coords) buffers.push_back({dout.tile(coord), STARPU_R});
          for (int64_t g = 0; g < G; ++g) buffers.push_back({l.lse_tile(lse, ib, i, g, ih), STARPU_R});
          for (int64_t g = 0; g < G; ++g) buffers.push_back({delta[g], j == j0 ? STARPU_W : STARPU_R});
          const SumsEnds dq = ends(j == j0, j == i), dkv = ends(i == j, i == last[j]);
          for (int64_t g = 0; g < G; ++g) buffers.push_back({dqkv32.tile({ib, i, g, ih, 0}), dq.sums_mode()});
          buffers.push_back({dqkv32.tile({ib, j, G, ih, 0}), dkv.sums_mode()});
          buffers.push_back({dqkv32.tile({ib, j, G + 1, ih, 0}), dkv.sums_mode()});
          const int64_t scratch_floats = std::max(step_scratch_floats(p, G, type, type, true),
                                                  j == j0 ? delta_scratch_floats(p, type) : 0);
          starpu_data_handle_t scratch = temporary_vector(scratch_floats, sizeof(float));
          buffers.push_back({scratch, STARPU_SCRATCH});
          if (dq.takes_tiles())
            for (int64_t g = 0; g < G; ++g) buffers.push_back({dqkv.tile({ib, i, g, ih, 0}), dq.tiles_mode()});
          if (dkv.takes_tiles())
            for (int64_t x = G; x < G + 2; ++x) buffers.push_back({dqkv.tile({ib, j, x, ih, 0}), dkv.tiles_mode()});
          if (j == j0)
            for (const Index& coord : out_coords) buffers.push_back({out.tile(coord), STARPU_R});
          const int64_t starts = documents.add_buffer(buffers, ib, i, j);
          submit_task(fused_step(p, type, type) ? fused_cl : step_cl, buffers,
                      BackwardArgs{G, type, j == j0, dq, dkv, p, starts}, 10.0 * G * pair_flops(p));
          starpu_data_unregister_submit(scratch);
        }
        for (starpu_data_handle_t handle : delta) starpu_data_unregister_submit(handle);
      }
  }
  dqkv32.finish();
}
JNNTILE_OP(attention_backward, attention_backward_submit);

// ---- key/value cache ----------------------------------------------------------

struct CacheCopyArgs {
  bool first;
  attention::CacheCopy copy;
};

// buffers: a key or value tile of qkv, the matching cache tile
template <Device D>
void cache_copy_kernel(void** buffers, const CacheCopyArgs& a) {
  attention_cache_copy<D>(a.first, a.copy, tile_ptr<float>(buffers[0]), tile_ptr<float>(buffers[1]));
}

// The grids of qkv and the cache and the positions of this call, checked once.
struct CacheLayout {
  int64_t gb, gh, gt;  // qkv tiles on B, H, T
  int64_t groups;      // G
  int64_t tq, tc, d;   // sequence tiles of qkv and of the cache
  int64_t pos, t;      // qkv's rows are the positions pos .. pos + t - 1
  float scale;
};

CacheLayout check_cache(const OpCall& call, const TiledTensor& qkv, const TiledTensor& cache, const char* op) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(op) + ": " + why + ": qkv " + qkv.describe() + ", cache " +
                                cache.describe());
  };
  check_qkv(qkv, fail);
  const Index &s = qkv.shape, &ts = qkv.tile_shape;
  if (cache.dtype != DType::F32 || cache.ndim() != 5 || cache.shape[0] != s[0] || cache.shape[2] != 2 ||
      cache.shape[3] != s[3] || cache.shape[4] != s[4])
    fail("the cache must be float32 (B, T_max, 2, H, D) with the B, H and D of qkv");
  if (cache.tile_shape[0] != ts[0] || cache.tile_shape[2] != 1 || cache.tile_shape[3] != ts[3] ||
      cache.tile_shape[4] != s[4])
    fail("the cache must be tiled (tb, tc, 1, th, D) with the tb and th of qkv");
  const int64_t pos = int64_t(call.input_scalar(0));
  if (pos < 0 || pos + s[1] > cache.shape[1])
    fail("positions " + std::to_string(pos) + " .. " + std::to_string(pos + s[1] - 1) + " lie outside the cache's " +
         std::to_string(cache.shape[1]) + " positions");
  return {qkv.grid[0], qkv.grid[3], qkv.grid[1], s[2] - 2, ts[1], cache.tile_shape[1], s[4], pos, s[1],
          float(1.0 / std::sqrt(double(s[4])))};
}

// Before anything is submitted: the key and value tiles j_from <= j < j_to of
// the cache hold data, else `why` (with the cache described) is thrown.
void require_cache_written(const TiledTensor& cache, const CacheLayout& l, int64_t j_from, int64_t j_to,
                           const std::string& why) {
  for (int64_t ib = 0; ib < l.gb; ++ib)
    for (int64_t ih = 0; ih < l.gh; ++ih)
      for (int64_t j = j_from; j < j_to; ++j)
        for (int64_t kv = 0; kv < 2; ++kv) try {
            check_readable(cache.tile({ib, j, kv, ih, 0}));
          } catch (const std::invalid_argument&) {
            throw std::invalid_argument(why + "; cache " + cache.describe());
          }
}

// ids [qkv, cache], inputs [pos]: cache[:, pos + r, 0|1] = qkv[:, r, G|G + 1] for every row r of qkv.
void cache_write_submit(const OpCall& call) {
  const TiledTensor &qkv = call.tensor(0), &cache = call.tensor(1);
  const CacheLayout l = check_cache(call, qkv, cache, "attention cache write");
  static starpu_codelet* cl = JNNTILE_CODELET(CacheCopyArgs, cache_copy_kernel, "attention_cache_copy");
  // The cache tile holding pos is continued unless pos is its first row (the
  // later tiles start afresh), so its earlier positions must hold keys and values.
  if (l.pos % l.tc != 0)
    require_cache_written(cache, l, l.pos / l.tc, l.pos / l.tc + 1,
                          "attention cache write: position " + std::to_string(l.pos) +
                              " continues a cache tile whose earlier positions hold nothing (never written, or "
                              "invalidated): write the positions in order from 0");
  const int64_t end = l.pos + l.t;
  Float32Tiles qkv32(qkv, Start::Widened);
  for (int64_t ib = 0; ib < l.gb; ++ib)
    for (int64_t ih = 0; ih < l.gh; ++ih)
      for (int64_t j = l.pos / l.tc; j * l.tc < end; ++j) {  // the cache tiles the positions fall in
        const int64_t c0 = j * l.tc;
        const Index c_ext = cache.tile_extent({ib, j, 0, ih, 0});
        const int64_t c_end = std::min(c0 + c_ext[1], end);
        // qkv tiles in increasing order: the copy that starts at the cache tile's
        // first row, write-only, is submitted before those that fill it further.
        for (int64_t i = std::max(c0 - l.pos, int64_t(0)) / l.tq; i < l.gt && l.pos + i * l.tq < c_end; ++i) {
          const Index q_ext = qkv.tile_extent({ib, i, 0, ih, 0});
          const int64_t q0 = l.pos + i * l.tq;
          const int64_t start = std::max(q0, c0), stop = std::min(q0 + q_ext[1], c_end);
          const CacheCopyArgs a{start == c0, {q_ext[0], q_ext[3] * l.d, q_ext[1], start - q0, c_ext[1], start - c0,
                                              stop - start}};
          for (int64_t kv = 0; kv < 2; ++kv)
            submit_task(cl, {{qkv32.tile({ib, i, l.groups + kv, ih, 0}), STARPU_R},
                             {cache.tile({ib, j, kv, ih, 0}), a.first ? STARPU_W : STARPU_RW}},
                        a);
        }
      }
  qkv32.finish();
}
JNNTILE_OP(attention_cache_write, cache_write_submit);

// ids [qkv, cache, out], inputs [pos]: out (B, T, G, H, D) tiled (tb, tt, 1, th, D), or (B, T, H, D) tiled
// (tb, tt, th, D) where G = 1, = softmax attention of the queries of qkv (positions pos ..) over the keys and
// values of the cache at positions 0 .. pos + T - 1, causally.
void cached_attention_submit(const OpCall& call) {
  const TiledTensor &qkv = call.tensor(0), &cache = call.tensor(1), &out = call.tensor(2);
  const CacheLayout l = check_cache(call, qkv, cache, "cached attention");
  const bool group_axis = check_out(qkv, out, [&](const std::string& why) {
    throw std::invalid_argument("cached attention: " + why + ": qkv " + qkv.describe() + ", out " + out.describe());
  });
  const int64_t G = l.groups;
  const FloatType type = float_type(qkv, "cached attention");
  Float32Tiles out32(out, Start::Unwritten);  // the first steps write it, the finish tasks round it
  auto out_coord = [&](int64_t ib, int64_t i, int64_t g, int64_t ih) {
    return group_axis ? Index{ib, i, g, ih, 0} : Index{ib, i, ih, 0};
  };
  // The cache tiles up to the last position hold keys and values.
  require_cache_written(cache, l, 0, (l.pos + l.t - 1) / l.tc + 1,
                        "cached attention: the cache holds nothing at some of the positions 0 .. " +
                            std::to_string(l.pos + l.t - 1) + ": write them with the cache write first");
  static starpu_codelet* step_cl = JNNTILE_CODELET(StepArgs, forward_step_kernel, "attention_forward_step");
  for (int64_t ib = 0; ib < l.gb; ++ib)
    for (int64_t ih = 0; ih < l.gh; ++ih)
      for (int64_t i = 0; i < l.gt; ++i) {
        const Index q_ext = qkv.tile_extent({ib, i, 0, ih, 0});
        const int64_t q0 = l.pos + i * l.tq, last = q0 + q_ext[1] - 1;
        const int64_t rows = q_ext[0] * q_ext[1] * q_ext[3];
        // stats_g: (tb, tt, th, 2) running max and sum of group member g's queries; lse_g: the finishing step
        // writes it, nobody reads it
        std::vector<starpu_data_handle_t> stats(G), lse(G);
        std::vector<Index> out_coords(G);
        for (auto& handle : stats) handle = temporary_vector(rows * 2, sizeof(float));
        for (auto& handle : lse) handle = temporary_vector(rows, sizeof(float));
        for (int64_t g = 0; g < G; ++g) out_coords[g] = out_coord(ib, i, g, ih);
        for (int64_t j = 0; j * l.tc <= last; ++j) {
          const Index k_ext = cache.tile_extent({ib, j, 0, ih, 0});
          const AttentionPair p{q_ext[0], q_ext[3], q_ext[1], k_ext[1], l.d, q0, j * l.tc, l.scale};
          starpu_data_access_mode mode = j == 0 ? STARPU_W : STARPU_RW;
          std::vector<Buffer> buffers;
          for (int64_t g = 0; g < G; ++g) buffers.push_back({qkv.tile({ib, i, g, ih, 0}), STARPU_R});
          buffers.push_back({cache.tile({ib, j, 0, ih, 0}), STARPU_R});
          buffers.push_back({cache.tile({ib, j, 1, ih, 0}), STARPU_R});
          for (const Index& coord : out_coords) buffers.push_back({out32.tile(coord), mode});
          for (int64_t g = 0; g < G; ++g) buffers.push_back({stats[g], mode});
          starpu_data_handle_t scratch =
              temporary_vector(step_scratch_floats(p, G, type, FloatType::F32, false), sizeof(float));
          buffers.push_back({scratch, STARPU_SCRATCH});
          const bool finish = (j + 1) * l.tc > last;
          if (finish) add_finish_buffers(buffers, out, lse, out_coords);
          submit_task(step_cl, buffers, StepArgs{j == 0, finish, G, type, FloatType::F32, p, -1},
                      4.0 * G * pair_flops(p));
          starpu_data_unregister_submit(scratch);
        }
        for (starpu_data_handle_t handle : stats) starpu_data_unregister_submit(handle);
        for (starpu_data_handle_t handle : lse) starpu_data_unregister_submit(handle);
      }
  out32.finish();
}
JNNTILE_OP(attention_cached, cached_attention_submit);

}  // namespace
}  // namespace jnntile
