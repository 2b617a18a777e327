// A quantized tensor as ops see it: uint8 codes and float32 scales (kernels/quant.h) standing for a float one.
#pragma once
#include "kernels/quant.h"
#include "tensor.h"

namespace jnntile {

// The float tensor (of `dtype`) that `codes` and `scales` stand for under `q`: the codes' layout with the
// contiguous axis at its full length, whose tiles are the codes' (a product looks its operand's tiles up in
// it; each task then reads the scales tile of the same coordinates). Throws naming the tensors when the codes
// are not uint8, the scales not float32 of the codes' grid with one value per block of every tile, or an NF4
// tile's contiguous extent not a multiple of 64.
TiledTensor quantized_view(const TiledTensor& codes, const TiledTensor& scales, Quant q, DType dtype,
                           const char* op);

}  // namespace jnntile
