// Quantize a float tensor into codes and scales, and dequantize them back, one task per tile (kernels/quant.h).
//
// x: (..., C) tiles (..., tc); codes: uint8 (..., C / 2) tiles (..., tc / 2) for NF4, (..., C) tiles (..., tc)
// for int8; scales: float32 (..., C / 64) tiles (..., tc / 64) for NF4, (..., C / tc rounded up) tiles
// (..., 1) for int8 (one scale per row of each tile); under NF4Double the scales are uint8 and the statistics
// follow (ops/quant.h). A block never spans two tiles: an NF4 tile's contiguous extent, the last tile's too, is
// a multiple of 64.
#include "ops/quant.h"

#include "task.h"

namespace jnntile {

TiledTensor quantized_view(const TiledTensor& codes, const TiledTensor& scales, const TiledTensor* stats, Quant q,
                           DType dtype, const char* op) {
  const std::string name(op);
  if (q != Quant::NF4 && q != Quant::Int8 && q != Quant::NF4Double)
    throw std::invalid_argument(name + ": unknown quantization " + std::to_string(int(q)));
  if (codes.dtype != DType::U8 || codes.ndim() < 1)
    throw std::invalid_argument(name + ": the codes of a quantized tensor are uint8 with at least one axis: " +
                                codes.describe());
  TiledTensor view;
  view.id = codes.id;
  view.dtype = dtype;
  view.shape = codes.shape;
  view.tile_shape = codes.tile_shape;
  view.grid = codes.grid;
  view.tiles = codes.tiles;
  const int last = codes.ndim() - 1;
  if (is_nf4(q)) {
    view.shape[last] *= 2;
    view.tile_shape[last] *= 2;
  }
  Index scales_shape = view.shape, scales_tiles = view.tile_shape;
  if (is_nf4(q)) {
    if (view.tile_shape[last] % kNf4Block != 0 || view.shape[last] % kNf4Block != 0)
      throw std::invalid_argument(name + ": an NF4 block of 64 values must not span two tiles: the contiguous axis "
                                  "has length " + std::to_string(view.shape[last]) + " in tiles of " +
                                  std::to_string(view.tile_shape[last]) + "; tile it (and size it) in multiples of 64");
    scales_shape[last] /= kNf4Block;
    scales_tiles[last] /= kNf4Block;
  } else {
    scales_shape[last] = view.grid[last];
    scales_tiles[last] = 1;
  }
  const bool double_quant = q == Quant::NF4Double;
  if (scales.dtype != (double_quant ? DType::U8 : DType::F32) || scales.shape != scales_shape ||
      scales.tile_shape != scales_tiles)
    throw std::invalid_argument(name + ": the scales of " + codes.describe() + " must be " +
                                (double_quant ? "uint8" : "float32") + " with one value per " +
                                (is_nf4(q) ? "64" : "row of a tile") + ": " + scales.describe());
  if ((stats != nullptr) != double_quant)
    throw std::invalid_argument(name + ": statistics of the scales come with double-quantized NF4 alone");
  if (double_quant) {
    Index stats_shape = view.grid, stats_tiles(view.ndim(), 1);
    int64_t tile_scales = 1;
    for (int64_t extent : scales_tiles) tile_scales *= extent;
    stats_shape.push_back(scale_stats(tile_scales));
    stats_tiles.push_back(stats_shape.back());
    if (stats->dtype != DType::F32 || stats->shape != stats_shape || stats->tile_shape != stats_tiles)
      throw std::invalid_argument(name + ": the statistics of " + codes.describe() + "'s scales must be float32, " +
                                  "one tile of " + std::to_string(stats_shape.back()) + " per tile: " +
                                  stats->describe());
  }
  return view;
}

namespace {

struct QuantArgs {
  Quant q;
  FloatType type;  // of the float tensor
  int64_t rows, cols;  // of the tile: cols its contiguous extent
  int64_t n_stats;  // NF4Double: the floats of a statistics tile
};

// buffers: x, codes, scales, and under NF4Double the statistics and scratch
template <Device D>
void quantize_kernel(void** buffers, const QuantArgs& a) {
  const bool double_quant = a.q == Quant::NF4Double;
  quantize<D>(a.q, a.type, a.rows, a.cols, tile_ptr<void>(buffers[0]), tile_ptr<uint8_t>(buffers[1]),
              tile_ptr<void>(buffers[2]), double_quant ? tile_ptr<float>(buffers[3]) : nullptr, a.n_stats,
              double_quant ? tile_ptr<float>(buffers[4]) : nullptr);
}

// buffers: codes, scales, out, and under NF4Double the statistics
template <Device D>
void dequantize_kernel(void** buffers, const QuantArgs& a) {
  dequantize<D>(a.q, a.rows, a.cols, tile_ptr<uint8_t>(buffers[0]), tile_ptr<void>(buffers[1]),
                a.q == Quant::NF4Double ? tile_ptr<float>(buffers[3]) : nullptr, a.type, tile_ptr<void>(buffers[2]));
}

// The float tensor x against codes, scales and (NF4Double) stats; one task per tile, `kernel`'s buffers given
// by `buffers`, then under NF4Double with `scratch` the float32 scales of the tile.
template <class Buffers>
void submit_tiles(const OpCall& call, const TiledTensor& x, const TiledTensor& codes, const TiledTensor& scales,
                  const TiledTensor* stats, bool scratch, starpu_codelet* cl, const char* op, Buffers buffers) {
  const Quant q = Quant(attr<int64_t>(call.attrs, "quant"));
  const FloatType type = float_type(x, op);
  const TiledTensor view = quantized_view(codes, scales, stats, q, x.dtype, op);
  if (view.shape != x.shape || view.tile_shape != x.tile_shape)
    throw std::invalid_argument(std::string(op) + ": the codes " + codes.describe() + " do not fit " + x.describe());
  for (int64_t t = 0; t < x.num_tiles(); ++t) {
    const int64_t cols = x.tile_extent(x.tile_coord(t)).back(), numel = x.tile_numel(t);
    std::vector<Buffer> tile_buffers = buffers(t);
    starpu_data_handle_t floats = nullptr;
    if (scratch && stats != nullptr) {
      floats = temporary_vector(numel / kNf4Block, sizeof(float));
      tile_buffers.push_back({floats, STARPU_SCRATCH});
    }
    submit_task(cl, tile_buffers, QuantArgs{q, type, numel / cols, cols, stats ? stats->tile_shape.back() : 0},
                double(numel));
    if (floats != nullptr) starpu_data_unregister_submit(floats);
  }
}

// ids [x, codes, scales], and under NF4Double the statistics: codes, scales (and statistics) written from x
void quantize_submit(const OpCall& call) {
  const TiledTensor &x = call.tensor(0), &codes = call.tensor(1), &scales = call.tensor(2);
  const TiledTensor* stats = call.ids.size() > 3 ? &call.tensor(3) : nullptr;
  static starpu_codelet* cl = JNNTILE_CODELET(QuantArgs, quantize_kernel, "quantize");
  submit_tiles(call, x, codes, scales, stats, true, cl, "quantize", [&](int64_t t) {
    std::vector<Buffer> buffers{{x.tiles[t], STARPU_R}, {codes.tiles[t], STARPU_W}, {scales.tiles[t], STARPU_W}};
    if (stats != nullptr) buffers.push_back({stats->tiles[t], STARPU_W});
    return buffers;
  });
}
JNNTILE_OP(quantize, quantize_submit);

// ids [codes, scales, out], and under NF4Double the statistics: out written with the dequantized values
void dequantize_submit(const OpCall& call) {
  const TiledTensor &codes = call.tensor(0), &scales = call.tensor(1), &out = call.tensor(2);
  const TiledTensor* stats = call.ids.size() > 3 ? &call.tensor(3) : nullptr;
  static starpu_codelet* cl = JNNTILE_CODELET(QuantArgs, dequantize_kernel, "dequantize");
  submit_tiles(call, out, codes, scales, stats, false, cl, "dequantize", [&](int64_t t) {
    std::vector<Buffer> buffers{{codes.tiles[t], STARPU_R}, {scales.tiles[t], STARPU_R}, {out.tiles[t], STARPU_W}};
    if (stats != nullptr) buffers.push_back({stats->tiles[t], STARPU_R});
    return buffers;
  });
}
JNNTILE_OP(dequantize, dequantize_submit);

}  // namespace
}  // namespace jnntile
