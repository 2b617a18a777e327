// Tiled GEMM: C = alpha * op(A) @ op(B) + beta * C with leading batch axes.
//
// Axes are grouped: A is [batch][M..][K..] (or [batch][K..][M..] when
// transposed), B is [batch][K..][N..] (or [batch][N..][K..]), C is
// [batch][M..][N..]; `ndim` is the number of contraction axes K. Every C tile
// gets one task over all its K tiles, in order, where their tiles fit a task
// (task_group_bytes_limit), else one per group of consecutive K tiles that do; the
// first is write-only when beta == 0 (DESIGN invariant 3), the rest accumulate.
// A bias (the trailing N.. axes of C, float32)
// is added by each C tile's last task, to the tile it has just written: a
// linear layer's y = x W + b in one task per tile instead of two, and no pass of
// its own over y (nor over dy in the backward: dx of the bias was a copy of dy).
// Likewise a residual connection, y = r + x W (+ b): each C tile's first task
// starts from a copy of r's tile instead of zero, and no addition task follows.
// A bfloat16 C summed over several K tiles is summed in float32: in the task's
// scratch within one task; over several tasks, in a float32 tile that its first
// task widens C into (when beta != 0) and its last rounds into C, in the
// same tasks as their products (a conversion task each was 170 of GPT-2 124M's
// 2,291 tasks per step in bfloat16 at 4 x 256, each also a submission and, on a
// GPU, a launch of its own).
// Symmetrically, the backward of a linear layer sums its bias gradient in the tasks of its weight gradient
// (dW = x^T dy reads every dy tile once, in the tasks of dW's first row of tiles): db += the column sums of
// each dy tile, in the order of the separate pass it replaces (the same bits), without that pass's tasks
// and its second read of dy (168 of GPT-2 124M's tasks per step at 4 x 256).
// B may be quantized (a frozen base's weight, kernels/quant.h): each task dequantizes its B tiles, one at a time,
// into its scratch in A's dtype and multiplies that, so no float copy of the weight exists outside a task. A
// double-quantized NF4 B tile's scales are 8-bit codes, read with their tile of statistics.
#include <algorithm>
#include <limits>

#include "kernels/bias.h"
#include "kernels/values.h"
#include "kernels/gemm.h"
#include "ops/quant.h"
#include "ops/values.h"
#include "task.h"

namespace jnntile {
namespace {

enum class BiasGradFrom : int8_t { None, A, B };

struct GemmArgs {
  GemmTypes types;
  bool trans_a, trans_b;
  int64_t batch, m, n;
  int32_t k_tiles;             // consecutive K tiles the task sums, each a pair of buffers (at most kTilesPerTask)
  int64_t k[kTilesPerTask];    // the contraction length of each
  float alpha, beta;
  bool bias;     // C += bias (n floats) after the product
  bool residual;  // the products add onto a copy of a residual tile of C's shape (and beta is 1)
  FloatType residual_type;
  bool widen;    // C is the float32 sum of a bfloat16 tile, which is widened into it first
  bool round;    // C is the float32 sum of a bfloat16 tile, into which it is rounded last
  BiasGradFrom bias_grad;  // db += the column sums of operand A or B (dy of a linear layer), or nothing
  bool bias_grad_overwrite;  // db holds nothing yet: db = the sums
  Quant quant_b;  // B's tiles are codes, each with its scales (and statistics) tile, dequantized into scratch
  int64_t b_cols[kTilesPerTask];  // with quant_b: the contiguous extent of each B tile
};

bool has_scratch(const GemmArgs& g) { return !g.types.all_f32() || g.quant_b != Quant::None; }

// Floats of scratch that hold n values of `type`.
int64_t dequantized_floats(FloatType type, int64_t n) {
  return type == FloatType::F32 ? n : (n + 1) / 2;
}

// Whether a task sums several K tiles into a bfloat16 C in float32 in its scratch (the first c_numel floats),
// rounding once at the end, as a single product does.
bool sums_in_scratch(const GemmArgs& g) { return g.k_tiles > 1 && g.types.c == FloatType::BF16; }

// buffers: A and B of each K tile (A_0, .., A_{k_tiles-1}, B_0, ..), C, the bias tile when adding one, the
// bfloat16 tile when widening or rounding, the bias gradient's tile when summing into it, the residual tile
// when adding onto one, the scales of each B tile when B is quantized (then each one's statistics under
// NF4Double), and scratch when an operand is bfloat16 or B is quantized
template <Device D>
void gemm_kernel(void** buffers, const GemmArgs& g) {
  const int n_k = g.k_tiles;
  int next = 2 * n_k + 1;
  const float* bias = g.bias ? tile_ptr<float>(buffers[next++]) : nullptr;
  void* c_bf16 = g.widen || g.round ? tile_ptr<void>(buffers[next++]) : nullptr;
  float* db = g.bias_grad != BiasGradFrom::None ? tile_ptr<float>(buffers[next++]) : nullptr;
  const void* residual = g.residual ? tile_ptr<void>(buffers[next++]) : nullptr;
  const int b_scales = next, b_stats = next + n_k;
  if (g.quant_b != Quant::None) next += n_k;
  if (g.quant_b == Quant::NF4Double) next += n_k;
  float* scratch = has_scratch(g) ? tile_ptr<float>(buffers[next]) : nullptr;
  // The dequantized B tile: the first floats of scratch, k x n values of A's dtype.
  void* b_dequantized = scratch;
  if (g.quant_b != Quant::None)
    scratch += dequantized_floats(g.types.a, *std::max_element(g.k, g.k + n_k) * g.n);
  void* c = tile_ptr<void>(buffers[2 * n_k]);
  const int64_t c_numel = g.batch * g.m * g.n;
  GemmTypes types = g.types;
  void* sum = c;  // where the products add up
  if (sums_in_scratch(g)) {
    sum = scratch;
    scratch += c_numel;
    types.c = FloatType::F32;
  }
  // What the products add onto (beta != 0): the residual, else C as it is.
  if (residual != nullptr)
    convert<D>(c_numel, g.residual_type, residual, types.c, sum);
  else if (sums_in_scratch(g) && g.beta != 0.0f)
    convert<D>(c_numel, FloatType::BF16, c, FloatType::F32, sum);
  if (g.widen) convert<D>(c_numel, FloatType::BF16, c_bf16, FloatType::F32, c);
  for (int t = 0; t < n_k; ++t) {
    void *a = tile_ptr<void>(buffers[t]), *b = tile_ptr<void>(buffers[n_k + t]);
    if (g.quant_b != Quant::None) {
      dequantize<D>(g.quant_b, g.k[t] * g.n / g.b_cols[t], g.b_cols[t], static_cast<const uint8_t*>(b),
                    tile_ptr<void>(buffers[b_scales + t]),
                    g.quant_b == Quant::NF4Double ? tile_ptr<float>(buffers[b_stats + t]) : nullptr, g.types.a,
                    b_dequantized);
      b = b_dequantized;
    }
    // dy is A transposed (stored k x m) or B (stored k x n): k rows of dy, m or n bias elements, in K order.
    const bool overwrite = g.bias_grad_overwrite && t == 0;
    if (g.bias_grad == BiasGradFrom::A) bias_grad<D>(g.types.a, g.k[t], g.m, overwrite, a, db);
    if (g.bias_grad == BiasGradFrom::B) bias_grad<D>(g.types.b, g.k[t], g.n, overwrite, b, db);
    gemm<D>(types, g.trans_a, g.trans_b, g.batch, g.m, g.n, g.k[t], g.alpha, a, b, t == 0 ? g.beta : 1.0f, sum,
            scratch);
  }
  if (bias != nullptr) add_bias<D>(types.c, g.batch * g.m, g.n, sum, bias, sum);
  if (sums_in_scratch(g)) convert<D>(c_numel, FloatType::F32, sum, FloatType::BF16, c);
  if (g.round) convert<D>(c_numel, FloatType::F32, c, FloatType::BF16, c_bf16);
}

Index slice(const Index& v, int start, int count) {
  return Index(v.begin() + start, v.begin() + start + count);
}

Index concat(std::initializer_list<Index> parts) {
  Index out;
  for (const Index& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

int64_t product(const Index& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// The axes of one operand, split into its two matrix groups after the batch.
struct Operand {
  Index batch, rows, cols;  // shapes
  Index batch_tiles, rows_tiles, cols_tiles;
};

Operand split(const TiledTensor& t, int batch_ndim, int rows_ndim, const char* name) {
  float_type(t, (std::string("gemm: ") + name).c_str());
  int cols_ndim = t.ndim() - batch_ndim - rows_ndim;
  if (rows_ndim < 0 || cols_ndim < 0)
    throw std::invalid_argument(std::string("gemm: ") + name + " has too few axes: " + t.describe());
  return {slice(t.shape, 0, batch_ndim), slice(t.shape, batch_ndim, rows_ndim),
          slice(t.shape, batch_ndim + rows_ndim, cols_ndim), slice(t.tile_shape, 0, batch_ndim),
          slice(t.tile_shape, batch_ndim, rows_ndim), slice(t.tile_shape, batch_ndim + rows_ndim, cols_ndim)};
}

void require_match(const Index& s1, const Index& t1, const Index& s2, const Index& t2, const std::string& what,
                   const TiledTensor& x, const TiledTensor& y) {
  if (s1 != s2 || t1 != t2)
    throw std::invalid_argument("gemm: " + what + " differ in shape or tiles: " + x.describe() + " vs " + y.describe());
}

// A bias gradient summed in a weight gradient's product: db, the operand holding dy (A transposed, stored
// k x m, or B, stored k x n), and whether db holds nothing yet.
struct BiasGrad {
  const TiledTensor* db;
  BiasGradFrom from;
  bool fresh;
};

}  // namespace

// C = alpha op(A) op(B) + beta C (+ bias), or with `residual` (a tensor of C's layout) C = residual + alpha
// op(A) op(B) (+ bias): a residual connection added by the product's own tasks (beta is then ignored). With
// `b_scales` (and `b_stats` under NF4Double), B is the quantized_view of codes quantized as `quant_b`.
void gemm_tiles(const TiledTensor& A, const TiledTensor& B, const TiledTensor& C, bool trans_a, bool trans_b,
                float alpha, float beta, int ndim, int batch_ndim, const TiledTensor* bias = nullptr,
                const BiasGrad* bias_grad = nullptr, const TiledTensor* residual = nullptr,
                const TiledTensor* b_scales = nullptr, const TiledTensor* b_stats = nullptr,
                Quant quant_b = Quant::None) {
  int m_ndim = A.ndim() - batch_ndim - ndim;
  int n_ndim = B.ndim() - batch_ndim - ndim;
  if (m_ndim < 0 || n_ndim < 0 || C.ndim() != batch_ndim + m_ndim + n_ndim)
    throw std::invalid_argument("gemm: axis counts do not fit (ndim=" + std::to_string(ndim) + ", batch_ndim=" +
                                std::to_string(batch_ndim) + "): " + A.describe() + ", " + B.describe() + ", " +
                                C.describe());
  Operand a = split(A, batch_ndim, trans_a ? ndim : m_ndim, "A");
  Operand b = split(B, batch_ndim, trans_b ? n_ndim : ndim, "B");
  Operand c = split(C, batch_ndim, m_ndim, "C");
  const Index &a_m = trans_a ? a.cols : a.rows, &a_k = trans_a ? a.rows : a.cols;
  const Index &a_mt = trans_a ? a.cols_tiles : a.rows_tiles, &a_kt = trans_a ? a.rows_tiles : a.cols_tiles;
  const Index &b_k = trans_b ? b.cols : b.rows, &b_n = trans_b ? b.rows : b.cols;
  const Index &b_kt = trans_b ? b.cols_tiles : b.rows_tiles, &b_nt = trans_b ? b.rows_tiles : b.cols_tiles;
  require_match(a_k, a_kt, b_k, b_kt, "contraction axes of A and B", A, B);
  require_match(a_m, a_mt, c.rows, c.rows_tiles, "row axes of A and C", A, C);
  require_match(b_n, b_nt, c.cols, c.cols_tiles, "column axes of B and C", B, C);
  require_match(a.batch, a.batch_tiles, c.batch, c.batch_tiles, "batch axes of A and C", A, C);
  require_match(b.batch, b.batch_tiles, c.batch, c.batch_tiles, "batch axes of B and C", B, C);
  // A bias and a bias gradient: float32 (a float32 master's), with the shape and tiles of C's columns (rows).
  auto require_bias = [&](const TiledTensor& b, bool rows, const std::string& what) {
    require_match(b.shape, b.tile_shape, rows ? c.rows : c.cols, rows ? c.rows_tiles : c.cols_tiles,
                  what + " and the feature axes of C", b, C);
    if (b.dtype != DType::F32)
      throw std::invalid_argument("gemm: the " + what + " must be float32 (a float32 master's): " + b.describe());
  };
  if (bias != nullptr) require_bias(*bias, false, "bias");
  if (residual != nullptr && (residual->dtype != C.dtype || residual->shape != C.shape ||
                              residual->tile_shape != C.tile_shape))
    throw std::invalid_argument("gemm: the residual must have the product's dtype, shape and tiles: " +
                                residual->describe() + " vs " + C.describe());
  const bool grad_from_a = bias_grad != nullptr && bias_grad->from == BiasGradFrom::A;
  if (bias_grad != nullptr) {
    if (batch_ndim != 0 || (grad_from_a ? !trans_a : trans_b))
      throw std::invalid_argument("gemm: a bias gradient is summed from dy stored (rows, features) in a product "
                                  "without batch axes: " + A.describe() + ", " + B.describe());
    require_bias(*bias_grad->db, grad_from_a, "bias gradient");
  }

  static starpu_codelet* cl = JNNTILE_CODELET(GemmArgs, gemm_kernel, "gemm");
  GemmTypes types{float_type(A, "gemm"), float_type(B, "gemm"), float_type(C, "gemm")};
  if (types.a != types.b)  // cuBLAS multiplies two float32 or two bfloat16 matrices, not one of each
    throw std::invalid_argument("gemm: A and B differ in dtype: " + A.describe() + " vs " + B.describe());
  Index k_grid = slice(A.grid, batch_ndim + (trans_a ? 0 : m_ndim), ndim);
  const int64_t k_tiles = product(k_grid);
  const int64_t bytes_limit = task_group_bytes_limit();
  for (int64_t linear = 0; linear < C.num_tiles(); ++linear) {
    Index c_coord = C.tile_coord(linear);
    Index c_ext = C.tile_extent(c_coord);
    Index bat = slice(c_coord, 0, batch_ndim), mc = slice(c_coord, batch_ndim, m_ndim),
          nc = slice(c_coord, batch_ndim + m_ndim, n_ndim);
    int64_t batch = product(slice(c_ext, 0, batch_ndim));
    int64_t m = product(slice(c_ext, batch_ndim, m_ndim)), n = product(slice(c_ext, batch_ndim + m_ndim, n_ndim));
    // The K tiles, in order, cut into tasks of consecutive tiles as small tiles are (tile_groups, with no bound on
    // elements): one task where they fit task_group_bytes_limit() together beside the C tile, so a C tile's
    // products are one task and no chain of dependent tasks (3 per layer of GPT-2's fused q, k, v projection in
    // its backward; on a GPU, each a launch and a wait).
    struct KTile {
      Index a_coord, b_coord;
      int64_t k;
    };
    std::vector<KTile> ks;
    std::vector<int64_t> ks_numel, ks_bytes;
    Index kc(ndim, 0);
    for (int64_t kt = 0; kt < k_tiles; ++kt) {
      Index a_coord = trans_a ? concat({bat, kc, mc}) : concat({bat, mc, kc});
      Index b_coord = trans_b ? concat({bat, nc, kc}) : concat({bat, kc, nc});
      int64_t k = product(slice(A.tile_extent(a_coord), batch_ndim + (trans_a ? 0 : m_ndim), ndim));
      ks.push_back({a_coord, b_coord, k});
      ks_numel.push_back(batch * k * (m + n));
      ks_bytes.push_back(int64_t(dtype_size(A.dtype)) * ks_numel.back());
      for (int ax = ndim - 1; ax >= 0; --ax) {  // next K tile
        if (++kc[ax] < k_grid[ax]) break;
        kc[ax] = 0;
      }
    }
    const int64_t c_bytes = int64_t(dtype_size(C.dtype) + sizeof(float)) * batch * m * n;
    const std::vector<std::vector<size_t>> groups =
        tile_groups(ks_numel, ks_bytes, std::numeric_limits<int64_t>::max(), bytes_limit - c_bytes);
    // A bfloat16 C summed over several tasks is summed in a float32 tile and rounded once at the end, as a
    // single product would be (rounding after each K tile loses a bit per tile); within a task, in its scratch.
    starpu_data_handle_t c_tile = C.tiles[linear];
    GemmTypes tile_types = types;
    const bool float32_sum = types.c == FloatType::BF16 && groups.size() > 1;
    if (float32_sum) {
      c_tile = temporary_vector(batch * m * n, sizeof(float));
      tile_types.c = FloatType::F32;
    }
    // The C tiles of the first row (column, from A) of tiles read every dy tile once: they sum the bias
    // gradient, one chain per db tile over the rows of dy in order.
    const Index& other = grad_from_a ? nc : mc;
    const bool sums_bias =
        bias_grad != nullptr && std::all_of(other.begin(), other.end(), [](int64_t i) { return i == 0; });
    starpu_data_handle_t db_tile = sums_bias ? bias_grad->db->tile(grad_from_a ? mc : nc) : nullptr;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const std::vector<size_t>& group = groups[gi];
      const bool first = gi == 0, last = gi == groups.size() - 1, last_with_bias = bias != nullptr && last;
      const bool from_residual = residual != nullptr && first;
      const bool widen = float32_sum && first && beta != 0.0f && !from_residual, round = float32_sum && last;
      float tile_beta = first && !from_residual ? beta : 1.0f;
      starpu_data_access_mode c_mode = (first && (beta == 0.0f || widen || from_residual)) ? STARPU_W : STARPU_RW;
      const bool db_overwrite = sums_bias && bias_grad->fresh && first;
      GemmArgs args{tile_types, trans_a, trans_b, batch, m, n, int32_t(group.size()), {}, alpha, tile_beta,
                    last_with_bias, from_residual, types.c, widen, round,
                    sums_bias ? bias_grad->from : BiasGradFrom::None, db_overwrite, quant_b, {}};
      std::vector<Buffer> buffers;
      double flops = 0.0;
      for (size_t t = 0; t < group.size(); ++t) {
        const KTile& kt = ks[group[t]];
        buffers.push_back({A.tile(kt.a_coord), STARPU_R});
        args.k[t] = kt.k;
        flops += 2.0 * batch * m * n * kt.k;
      }
      for (size_t t : group) buffers.push_back({B.tile(ks[t].b_coord), STARPU_R});
      buffers.push_back({c_tile, c_mode});
      if (last_with_bias) buffers.push_back({bias->tile(nc), STARPU_R});
      if (widen) buffers.push_back({C.tiles[linear], STARPU_R});
      if (round) buffers.push_back({C.tiles[linear], STARPU_W});
      if (sums_bias) buffers.push_back({db_tile, db_overwrite ? STARPU_W : STARPU_RW});
      if (from_residual) buffers.push_back({residual->tiles[linear], STARPU_R});
      if (quant_b != Quant::None)
        for (size_t t = 0; t < group.size(); ++t) {
          buffers.push_back({b_scales->tile(ks[group[t]].b_coord), STARPU_R});
          args.b_cols[t] = B.tile_extent(ks[group[t]].b_coord).back();
        }
      if (quant_b == Quant::NF4Double)
        for (size_t t : group) buffers.push_back({stats_tile(*b_stats, ks[t].b_coord), STARPU_R});
      starpu_data_handle_t scratch = nullptr;
      if (has_scratch(args)) {
        // Sized before StarPU picks the worker; cuBLAS writes a bfloat16 C itself, so on the GPU alone none
        // (the float32 sum of GPT-2's 8192 x 16384 logits tile would be 512 MB of GPU memory per task) but
        // the float32 sum of several K tiles. An emulated GPU runs the CPU kernel, which needs it.
        const bool cublas = kernels_run_on_gpu() && !emulated_gpu();
        const bool summed = sums_in_scratch(args);
        GemmTypes product_types = tile_types;
        if (summed) product_types.c = FloatType::F32;
        const int64_t k_max = *std::max_element(args.k, args.k + group.size());
        const int64_t floats = (summed ? batch * m * n : 0) +
                               (quant_b != Quant::None ? dequantized_floats(types.a, k_max * n) : 0) +
                               (cublas ? 0 : gemm_scratch_floats(product_types, batch, m, n, k_max));
        scratch = temporary_vector(floats, sizeof(float));
        buffers.push_back({scratch, STARPU_SCRATCH});
      }
      submit_task(cl, buffers, args, flops);
      if (scratch != nullptr) starpu_data_unregister_submit(scratch);
    }
    if (float32_sum) starpu_data_unregister_submit(c_tile);
  }
}

namespace {

// A product's B: the tensor at ids[1], or with attr quant_b (a Quant) the float view of those codes and the
// scales at ids[at] (and under NF4Double their statistics at ids[at + 1]). A quantized B is a frozen weight's:
// B without batch axes.
struct OperandB {
  TiledTensor view;
  const TiledTensor* scales = nullptr;
  const TiledTensor* stats = nullptr;
  Quant quant = Quant::None;
  const TiledTensor& tensor(const OpCall& call) const { return scales != nullptr ? view : call.tensor(1); }
};

OperandB operand_b(const OpCall& call, size_t at, DType dtype, const char* op) {
  OperandB b;
  auto quant = call.attrs.get<int64_t>("quant_b");  // absent: B is a float tensor
  b.quant = quant.has_error() ? Quant::None : Quant(quant.value());
  if (b.quant == Quant::None) return b;
  b.scales = &call.tensor(at);
  if (b.quant == Quant::NF4Double) b.stats = &call.tensor(at + 1);
  b.view = quantized_view(call.tensor(1), *b.scales, b.stats, b.quant, dtype, op);
  if (attr<int64_t>(call.attrs, "batch_ndim") != 0)
    throw std::invalid_argument(std::string(op) + ": a quantized B is a weight, without batch axes");
  return b;
}

// ids [A, B, C], then optionally the bias (or -1), then optionally the residual (or -1), then B's scales when
// B is quantized (attr quant_b), then their statistics under NF4Double
void gemm_submit(const OpCall& call) {
  auto optional = [&](size_t i) { return call.ids.size() > i && call.ids[i] >= 0 ? &call.tensor(i) : nullptr; };
  const OperandB b = operand_b(call, 5, call.tensor(0).dtype, "gemm");
  gemm_tiles(call.tensor(0), b.tensor(call), call.tensor(2), attr<int64_t>(call.attrs, "trans_a") != 0,
             attr<int64_t>(call.attrs, "trans_b") != 0, float(attr<double>(call.attrs, "alpha")),
             float(attr<double>(call.attrs, "beta")), int(attr<int64_t>(call.attrs, "ndim")),
             int(attr<int64_t>(call.attrs, "batch_ndim")), optional(3), nullptr, optional(4), b.scales, b.stats,
             b.quant);
}
JNNTILE_OP(gemm, gemm_submit);

// Backward of C = alpha op(A) op(B): ids [A, B, gA or -1, gB or -1, gC], and for a linear layer whose bias
// gradient is summed in gB's tasks, the bias gradient; accumulates into the gradients that are given, or
// writes one whose attribute fresh_a / fresh_b / fresh_bias says it holds nothing yet (its zero-fill was
// pending: the product's first K tile then writes its tiles). A quantized B (attr quant_b) is frozen: its
// scales follow at ids[5] (their statistics at ids[6] under NF4Double) and only A's gradient is taken.
void gemm_backward_submit(const OpCall& call) {
  const OperandB quantized = operand_b(call, 5, call.tensor(4).dtype, "gemm backward");
  const TiledTensor &A = call.tensor(0), &B = quantized.tensor(call), &gC = call.tensor(4);
  if (quantized.scales != nullptr && call.ids[3] >= 0)
    throw std::invalid_argument("gemm backward: a quantized weight is frozen and gets no gradient: " +
                                call.tensor(1).describe());
  if (quantized.scales != nullptr && attr<int64_t>(call.attrs, "trans_a") != 0)
    throw std::invalid_argument("gemm backward: a product on a quantized weight takes A untransposed");
  bool ta = attr<int64_t>(call.attrs, "trans_a") != 0, tb = attr<int64_t>(call.attrs, "trans_b") != 0;
  float beta_a = attr<int64_t>(call.attrs, "fresh_a") != 0 ? 0.0f : 1.0f;
  float beta_b = attr<int64_t>(call.attrs, "fresh_b") != 0 ? 0.0f : 1.0f;
  float alpha = float(attr<double>(call.attrs, "alpha"));
  int ndim = int(attr<int64_t>(call.attrs, "ndim")), batch_ndim = int(attr<int64_t>(call.attrs, "batch_ndim"));
  int m_ndim = A.ndim() - batch_ndim - ndim, n_ndim = B.ndim() - batch_ndim - ndim;
  if (call.ids[2] >= 0) {
    const TiledTensor& gA = call.tensor(2);
    if (!ta)  // dA = dC op(B)^T
      gemm_tiles(gC, B, gA, false, !tb, alpha, beta_a, n_ndim, batch_ndim, nullptr, nullptr, nullptr,
                 quantized.scales, quantized.stats, quantized.quant);
    else gemm_tiles(B, gC, gA, tb, true, alpha, beta_a, n_ndim, batch_ndim);       // dA^T = op(B) dC^T
  }
  const bool with_bias_grad = call.ids.size() > 5 && quantized.scales == nullptr;
  if (with_bias_grad && call.ids[3] < 0)
    throw std::invalid_argument("gemm backward: a bias gradient is summed in the weight gradient's tasks: it "
                                "needs the weight gradient too");
  if (call.ids[3] >= 0) {
    const TiledTensor& gB = call.tensor(3);
    BiasGrad bias_grad{with_bias_grad ? &call.tensor(5) : nullptr, tb ? BiasGradFrom::A : BiasGradFrom::B,
                       with_bias_grad && attr<int64_t>(call.attrs, "fresh_bias") != 0};
    const BiasGrad* summed = with_bias_grad ? &bias_grad : nullptr;
    if (!tb) gemm_tiles(A, gC, gB, !ta, false, alpha, beta_b, m_ndim, batch_ndim, nullptr, summed);  // dB = op(A)^T dC
    else gemm_tiles(gC, A, gB, true, ta, alpha, beta_b, m_ndim, batch_ndim, nullptr, summed);  // dB^T = dC^T op(A)
  }
}
JNNTILE_OP(gemm_backward, gemm_backward_submit);

}  // namespace
}  // namespace jnntile
