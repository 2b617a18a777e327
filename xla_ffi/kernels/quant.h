// Quantized storage of a frozen weight: 4-bit NormalFloat (QLoRA's NF4) or 8-bit integers, each with float32
// absmax scales over blocks of the contiguous axis.
//
// A tile is (rows, cols), cols its contiguous extent, cut into blocks of `quant_block` values along each row:
// 64 for NF4 (QLoRA's blocksize), the whole row of the tile for int8 (a scale per output row of a weight
// stored (out, in) when its input axis is one tile). A block's scale is its absmax; NF4 codes index the 16
// values below after x / absmax is rounded to the nearest (ties to the lower one, as bitsandbytes' decision
// tree compares x > midpoint), two codes a byte, the first in the high nibble (bitsandbytes' order); int8
// codes are rint(x / (absmax / 127)). Dequantized: value[code] * absmax, code * (absmax / 127).
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/device.h"

namespace jnntile {

enum class Quant : int { None = 0, NF4 = 1, Int8 = 2 };

constexpr int64_t kNf4Block = 64;

inline int64_t quant_block(Quant q, int64_t cols) { return q == Quant::NF4 ? kNf4Block : cols; }
// Bytes of codes for `n` values.
inline int64_t quant_code_bytes(Quant q, int64_t n) { return q == Quant::NF4 ? n / 2 : n; }

// The NF4 code: bitsandbytes' `nf4_data` (csrc/kernels.cu), the quantiles of N(0, 1) scaled to [-1, 1] with an
// exact zero (QLoRA, Dettmers et al. 2023, appendix E).
JNNTILE_HD float nf4_value(int code) {
  constexpr float values[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                                -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                                0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                                0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                                0.7229568362236023f, 1.0f};
  return values[code];
}

// The code of x / absmax: how many midpoints between consecutive values (rounded to float) it exceeds.
JNNTILE_HD int nf4_code(float normalized) {
  int code = 0;
  for (int i = 0; i < 15; ++i) code += normalized > (nf4_value(i) + nf4_value(i + 1)) * 0.5f;
  return code;
}

JNNTILE_HD int int8_code(float x, float absmax) {
  if (absmax == 0.0f) return 0;
  float q = rintf(x / (absmax / 127.0f));
  return int(q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q));
}

JNNTILE_HD float nf4_dequantized(const uint8_t* codes, const float* scales, int64_t i) {
  uint8_t byte = codes[i / 2];
  return nf4_value(i % 2 == 0 ? byte >> 4 : byte & 15) * scales[i / kNf4Block];
}

// x: (rows, cols) of `type`; codes: quant_code_bytes(q, rows * cols); scales: rows * cols / quant_block(q, cols).
// cols is a multiple of kNf4Block for NF4.
template <Device D>
void quantize(Quant q, FloatType type, int64_t rows, int64_t cols, const void* x, uint8_t* codes, float* scales);
// out (rows, cols) of `type` = the dequantized values.
template <Device D>
void dequantize(Quant q, int64_t rows, int64_t cols, const uint8_t* codes, const float* scales, FloatType type,
                void* out);

}  // namespace jnntile
