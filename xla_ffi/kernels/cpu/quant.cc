#include "kernels/quant.h"

#include <cmath>

namespace jnntile {

template <>
void quantize<Device::Cpu>(Quant q, FloatType type, int64_t rows, int64_t cols, const void* x, uint8_t* codes,
                           float* scales) {
  const int64_t block = quant_block(q, cols), n = rows * cols;
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T* xt = static_cast<const T*>(x);
    for (int64_t start = 0; start < n; start += block) {
      float absmax = 0.0f;
      for (int64_t i = start; i < start + block; ++i) absmax = std::fmax(absmax, std::fabs(to_float(xt[i])));
      scales[start / block] = absmax;
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
}

template <>
void dequantize<Device::Cpu>(Quant q, int64_t rows, int64_t cols, const uint8_t* codes, const float* scales,
                             FloatType type, void* out) {
  const int64_t n = rows * cols;
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    T* o = static_cast<T*>(out);
    if (q == Quant::NF4)
      for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(nf4_dequantized(codes, scales, i));
    else
      for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(float(int8_t(codes[i])) * (scales[i / cols] / 127.0f));
  });
}

}  // namespace jnntile
