// A quantized tensor as ops see it: uint8 codes and float32 scales (kernels/quant.h) standing for a float one;
// under NF4Double the scales are uint8 codes too, with a float32 tensor of statistics: grid + (S,) tiled
// (1, .., 1, S), one tile of S = scale_stats(scales per tile) floats per tile of the codes.
#pragma once
#include "kernels/quant.h"
#include "tensor.h"

namespace jnntile {

// The float tensor (of `dtype`) that `codes` and `scales` stand for under `q`: the codes' layout with the
// contiguous axis at its full length, whose tiles are the codes' (a product looks its operand's tiles up in
// it; each task then reads the scales tile of the same coordinates, and `stats_tile`'s). Throws naming the
// tensors when the codes are not uint8, the scales not float32 (uint8 under NF4Double) of the codes' grid with
// one value per block of every tile, the statistics not as above (given under NF4Double alone), or an NF4
// tile's contiguous extent not a multiple of 64.
TiledTensor quantized_view(const TiledTensor& codes, const TiledTensor& scales, const TiledTensor* stats, Quant q,
                           DType dtype, const char* op);

// The statistics tile of the codes tile at `coord`.
inline starpu_data_handle_t stats_tile(const TiledTensor& stats, Index coord) {
  coord.push_back(0);
  return stats.tile(coord);
}

}  // namespace jnntile
