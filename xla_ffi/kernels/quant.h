// Quantized storage of a frozen weight: 4-bit NormalFloat (QLoRA's NF4) or 8-bit integers, each with float32
// absmax scales over blocks of the contiguous axis.
//
// A tile is (rows, cols), cols its contiguous extent, cut into blocks of `quant_block` values along each row:
// 64 for NF4 (QLoRA's blocksize), the whole row of the tile for int8 (a scale per output row of a weight
// stored (out, in) when its input axis is one tile). A block's scale is its absmax; NF4 codes index the 16
// values below after x / absmax is rounded to the nearest (ties to the lower one, as bitsandbytes' decision
// tree compares x > midpoint), two codes a byte, the first in the high nibble (bitsandbytes' order); int8
// codes are rint(x / (absmax / 127)). Dequantized: value[code] * absmax, code * (absmax / 127).
//
// NF4Double is NF4 with QLoRA's double quantization, as bitsandbytes' quantize_4bit(compress_statistics=True)
// does it, per tile: the tile's absmax scales less their mean (the offset) in blocks of 256 consecutive scales
// (row-major in the tile), each block as 8-bit codes of bitsandbytes' signed dynamic map (create_dynamic_map)
// and its own float32 absmax (quantize_blockwise: x * (1 / absmax) clamped to [-1, 1], to the nearest map
// value, ties to the lower). A tile's statistics are its offset, then the absmax of each block. A scale
// dequantized is map[code] * block absmax + offset, each operation rounded (no multiply-add contraction: this
// file's kernels are compiled without it), then a value nf4[code] * scale.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/device.h"

namespace jnntile {

enum class Quant : int { None = 0, NF4 = 1, Int8 = 2, NF4Double = 3 };

constexpr int64_t kNf4Block = 64;
constexpr int64_t kScaleBlock = 256;  // NF4Double: scales per block of their 8-bit codes

JNNTILE_HD bool is_nf4(Quant q) { return q == Quant::NF4 || q == Quant::NF4Double; }
inline int64_t quant_block(Quant q, int64_t cols) { return is_nf4(q) ? kNf4Block : cols; }
// Bytes of codes for `n` values.
inline int64_t quant_code_bytes(Quant q, int64_t n) { return is_nf4(q) ? n / 2 : n; }
// NF4Double: the floats of statistics of a tile of `n_scales` scales (its offset, an absmax per block of 256).
JNNTILE_HD int64_t scale_stats(int64_t n_scales) { return 1 + (n_scales + kScaleBlock - 1) / kScaleBlock; }

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

// bitsandbytes' create_dynamic_map(signed=True) (functional.py), sorted: for each exponent e of 10^-6 .. 10^0, the
// means of consecutive values of torch.linspace(0.1, 1, 2^(e + 6) + 1), times +-10^e, in float32; then 0 and 1.
#define JNNTILE_DYNAMIC_MAP \
  { \
      -9.9296874e-01f, -9.789063e-01f, -9.6484375e-01f, -9.507812e-01f, -9.3671876e-01f, -9.2265624e-01f, \
      -9.085938e-01f, -8.9453125e-01f, -8.804687e-01f, -8.6640626e-01f, -8.5234374e-01f, -8.382813e-01f, \
      -8.2421875e-01f, -8.101562e-01f, -7.9609376e-01f, -7.8203124e-01f, -7.679688e-01f, -7.5390625e-01f, \
      -7.398438e-01f, -7.2578126e-01f, -7.1171874e-01f, -6.976563e-01f, -6.8359375e-01f, -6.695313e-01f, \
      -6.5546876e-01f, -6.4140624e-01f, -6.273438e-01f, -6.1328125e-01f, -5.992188e-01f, -5.8515626e-01f, \
      -5.7109374e-01f, -5.570313e-01f, -5.4296875e-01f, -5.289062e-01f, -5.1484376e-01f, -5.0078124e-01f, \
      -4.867187e-01f, -4.7265625e-01f, -4.5859373e-01f, -4.4453123e-01f, -4.3046874e-01f, -4.164062e-01f, \
      -4.0234375e-01f, -3.8828123e-01f, -3.7421876e-01f, -3.6015624e-01f, -3.460937e-01f, -3.3203125e-01f, \
      -3.1796873e-01f, -3.0390626e-01f, -2.8984374e-01f, -2.7578124e-01f, -2.6171875e-01f, -2.4765624e-01f, \
      -2.3359375e-01f, -2.1953125e-01f, -2.0546874e-01f, -1.9140625e-01f, -1.7734374e-01f, -1.6328125e-01f, \
      -1.4921875e-01f, -1.3515624e-01f, -1.2109375e-01f, -1.07031256e-01f, -9.859375e-02f, -9.578126e-02f, \
      -9.2968754e-02f, -9.015625e-02f, -8.734375e-02f, -8.453125e-02f, -8.171876e-02f, -7.890625e-02f, \
      -7.6093756e-02f, -7.328125e-02f, -7.0468746e-02f, -6.7656256e-02f, -6.484375e-02f, -6.203125e-02f, \
      -5.9218753e-02f, -5.640625e-02f, -5.3593755e-02f, -5.078125e-02f, -4.796875e-02f, -4.5156248e-02f, \
      -4.2343747e-02f, -3.953125e-02f, -3.6718752e-02f, -3.3906247e-02f, -3.109375e-02f, -2.8281247e-02f, \
      -2.546875e-02f, -2.265625e-02f, -1.984375e-02f, -1.703125e-02f, -1.421875e-02f, -1.140625e-02f, \
      -9.71875e-03f, -9.156249e-03f, -8.59375e-03f, -8.03125e-03f, -7.46875e-03f, -6.90625e-03f, \
      -6.3437503e-03f, -5.78125e-03f, -5.2187503e-03f, -4.6562497e-03f, -4.09375e-03f, -3.5312497e-03f, \
      -2.96875e-03f, -2.40625e-03f, -1.84375e-03f, -1.2812499e-03f, -9.437501e-04f, -8.3125e-04f, \
      -7.1875006e-04f, -6.062501e-04f, -4.9375e-04f, -3.8125e-04f, -2.6875004e-04f, -1.5625001e-04f, \
      -8.875e-05f, -6.625e-05f, -4.375e-05f, -2.1249998e-05f, -7.75e-06f, -3.2500002e-06f, \
      -5.5000004e-07f, 0.0f, 5.5000004e-07f, 3.2500002e-06f, 7.75e-06f, 2.1249998e-05f, \
      4.375e-05f, 6.625e-05f, 8.875e-05f, 1.5625001e-04f, 2.6875004e-04f, 3.8125e-04f, \
      4.9375e-04f, 6.062501e-04f, 7.1875006e-04f, 8.3125e-04f, 9.437501e-04f, 1.2812499e-03f, \
      1.84375e-03f, 2.40625e-03f, 2.96875e-03f, 3.5312497e-03f, 4.09375e-03f, 4.6562497e-03f, \
      5.2187503e-03f, 5.78125e-03f, 6.3437503e-03f, 6.90625e-03f, 7.46875e-03f, 8.03125e-03f, \
      8.59375e-03f, 9.156249e-03f, 9.71875e-03f, 1.140625e-02f, 1.421875e-02f, 1.703125e-02f, \
      1.984375e-02f, 2.265625e-02f, 2.546875e-02f, 2.8281247e-02f, 3.109375e-02f, 3.3906247e-02f, \
      3.6718752e-02f, 3.953125e-02f, 4.2343747e-02f, 4.5156248e-02f, 4.796875e-02f, 5.078125e-02f, \
      5.3593755e-02f, 5.640625e-02f, 5.9218753e-02f, 6.203125e-02f, 6.484375e-02f, 6.7656256e-02f, \
      7.0468746e-02f, 7.328125e-02f, 7.6093756e-02f, 7.890625e-02f, 8.171876e-02f, 8.453125e-02f, \
      8.734375e-02f, 9.015625e-02f, 9.2968754e-02f, 9.578126e-02f, 9.859375e-02f, 1.07031256e-01f, \
      1.2109375e-01f, 1.3515624e-01f, 1.4921875e-01f, 1.6328125e-01f, 1.7734374e-01f, 1.9140625e-01f, \
      2.0546874e-01f, 2.1953125e-01f, 2.3359375e-01f, 2.4765624e-01f, 2.6171875e-01f, 2.7578124e-01f, \
      2.8984374e-01f, 3.0390626e-01f, 3.1796873e-01f, 3.3203125e-01f, 3.460937e-01f, 3.6015624e-01f, \
      3.7421876e-01f, 3.8828123e-01f, 4.0234375e-01f, 4.164062e-01f, 4.3046874e-01f, 4.4453123e-01f, \
      4.5859373e-01f, 4.7265625e-01f, 4.867187e-01f, 5.0078124e-01f, 5.1484376e-01f, 5.289062e-01f, \
      5.4296875e-01f, 5.570313e-01f, 5.7109374e-01f, 5.8515626e-01f, 5.992188e-01f, 6.1328125e-01f, \
      6.273438e-01f, 6.4140624e-01f, 6.5546876e-01f, 6.695313e-01f, 6.8359375e-01f, 6.976563e-01f, \
      7.1171874e-01f, 7.2578126e-01f, 7.398438e-01f, 7.5390625e-01f, 7.679688e-01f, 7.8203124e-01f, \
      7.9609376e-01f, 8.101562e-01f, 8.2421875e-01f, 8.382813e-01f, 8.5234374e-01f, 8.6640626e-01f, \
      8.804687e-01f, 8.9453125e-01f, 9.085938e-01f, 9.2265624e-01f, 9.3671876e-01f, 9.507812e-01f, \
      9.6484375e-01f, 9.789063e-01f, 9.9296874e-01f, 1.0f \
  }
inline constexpr float kDynamicMap[256] = JNNTILE_DYNAMIC_MAP;
#ifdef __CUDACC__
// On the GPU a table in global memory (read through the cache): a function's local array of 256 floats would be
// built on each thread's stack.
static __device__ const float kDynamicMapDevice[256] = JNNTILE_DYNAMIC_MAP;
#endif

JNNTILE_HD float dynamic_value(int code) {
#ifdef __CUDA_ARCH__
  return kDynamicMapDevice[code];
#else
  return kDynamicMap[code];
#endif
}

// The code of x in [-1, 1]: how many midpoints between consecutive map values (rounded to float) lie below it
// (torch.bucketize on them, as quantize_blockwise does).
JNNTILE_HD int dynamic_code(float x) {
  int lo = 0, hi = 255;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (x > (dynamic_value(mid) + dynamic_value(mid + 1)) * 0.5f) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

JNNTILE_HD int int8_code(float x, float absmax) {
  if (absmax == 0.0f) return 0;
  float q = rintf(x / (absmax / 127.0f));
  return int(q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q));
}

// Scale `b` of a tile: float32 scales, or with `stats` (NF4Double) the 8-bit codes of them.
JNNTILE_HD float nf4_scale(const void* scales, const float* stats, int64_t b) {
  if (stats == nullptr) return static_cast<const float*>(scales)[b];
  return dynamic_value(static_cast<const uint8_t*>(scales)[b]) * stats[1 + b / kScaleBlock] + stats[0];
}

JNNTILE_HD float nf4_dequantized(const uint8_t* codes, const void* scales, const float* stats, int64_t i) {
  uint8_t byte = codes[i / 2];
  return nf4_value(i % 2 == 0 ? byte >> 4 : byte & 15) * nf4_scale(scales, stats, i / kNf4Block);
}

// The 8-bit code of `scale` in a block whose scales less `offset` have absmax `absmax`.
JNNTILE_HD uint8_t scale_code(float scale, float offset, float absmax) {
  const float x = (scale - offset) * (1.0f / (absmax > 1e-38f ? absmax : 1e-38f));
  return uint8_t(dynamic_code(x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x)));
}

// x: (rows, cols) of `type`; codes: quant_code_bytes(q, rows * cols); scales: rows * cols / quant_block(q, cols)
// float32 values, or for NF4Double their uint8 codes, `stats` (n_stats floats: scale_stats(that many), then
// zeros) and `scratch` (that many floats: the float32 scales before their quantization). cols is a multiple
// of kNf4Block for NF4.
template <Device D>
void quantize(Quant q, FloatType type, int64_t rows, int64_t cols, const void* x, uint8_t* codes, void* scales,
              float* stats, int64_t n_stats, float* scratch);
// out (rows, cols) of `type` = the dequantized values (`stats`: NF4Double's, else null).
template <Device D>
void dequantize(Quant q, int64_t rows, int64_t cols, const uint8_t* codes, const void* scales, const float* stats,
                FloatType type, void* out);

}  // namespace jnntile
