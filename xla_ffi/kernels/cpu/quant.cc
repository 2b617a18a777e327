#include "kernels/quant.h"

#include <algorithm>
#include <cmath>

namespace jnntile {

template <>
void quantize<Device::Cpu>(Quant q, FloatType type, int64_t rows, int64_t cols, const void* x, uint8_t* codes,
                           void* scales, float* stats, int64_t n_stats, float* scratch) {
  const int64_t block = quant_block(q, cols), n = rows * cols, n_scales = n / block;
  float* absmaxes = q == Quant::NF4Double ? scratch : static_cast<float*>(scales);
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T* xt = static_cast<const T*>(x);
    for (int64_t start = 0; start < n; start += block) {
      float absmax = 0.0f;
      for (int64_t i = start; i < start + block; ++i) absmax = std::fmax(absmax, std::fabs(to_float(xt[i])));
      absmaxes[start / block] = absmax;
      for (int64_t i = start; i < start + block; ++i) {
        const float v = to_float(xt[i]);
        if (q == Quant::Int8) {
          codes[i] = uint8_t(int8_t(int8_code(v, absmax)));
        } else {
          const int code = nf4_code(absmax == 0.0f ? 0.0f : v / absmax);
          codes[i / 2] = i % 2 == 0 ? uint8_t(code << 4) : uint8_t(codes[i / 2] | code);
        }
      }
    }
  });
  if (q != Quant::NF4Double) return;
  double sum = 0.0;  // the mean in double, in order: the same bits on every device
  for (int64_t i = 0; i < n_scales; ++i) sum += absmaxes[i];
  const float offset = float(sum / double(n_scales));
  stats[0] = offset;
  for (int64_t b = 0; b * kScaleBlock < n_scales; ++b) {
    const int64_t start = b * kScaleBlock, stop = std::min(start + kScaleBlock, n_scales);
    float absmax = 0.0f;
    for (int64_t i = start; i < stop; ++i) absmax = std::fmax(absmax, std::fabs(absmaxes[i] - offset));
    stats[1 + b] = absmax;
    for (int64_t i = start; i < stop; ++i) static_cast<uint8_t*>(scales)[i] = scale_code(absmaxes[i], offset, absmax);
  }
  for (int64_t i = scale_stats(n_scales); i < n_stats; ++i) stats[i] = 0.0f;
}

template <>
void dequantize<Device::Cpu>(Quant q, int64_t rows, int64_t cols, const uint8_t* codes, const void* scales,
                             const float* stats, FloatType type, void* out) {
  const int64_t n = rows * cols;
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    T* o = static_cast<T*>(out);
    if (is_nf4(q)) {
      for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(nf4_dequantized(codes, scales, stats, i));
    } else {
      const float* s = static_cast<const float*>(scales);
      for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(float(int8_t(codes[i])) * (s[i / cols] / 127.0f));
    }
  });
}

}  // namespace jnntile
