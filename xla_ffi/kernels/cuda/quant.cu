#include "kernels/cuda/context.h"
#include "kernels/quant.h"

namespace jnntile {
namespace {

// One thread per block of values (grid-stride): its absmax, then its codes; an NF4 block is whole bytes (64
// values), so no two threads write one byte.
template <class T>
__global__ void quantize_kernel(Quant q, int64_t n, int64_t block, const T* x, uint8_t* codes, float* scales) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < n / block;
       b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t start = b * block;
    float absmax = 0.0f;
    for (int64_t i = start; i < start + block; ++i) absmax = fmaxf(absmax, fabsf(to_float(x[i])));
    scales[b] = absmax;
    for (int64_t i = start; i < start + block; i += 2) {
      const float v0 = to_float(x[i]), v1 = i + 1 < start + block ? to_float(x[i + 1]) : 0.0f;
      if (q == Quant::Int8) {
        codes[i] = uint8_t(int8_t(int8_code(v0, absmax)));
        if (i + 1 < start + block) codes[i + 1] = uint8_t(int8_t(int8_code(v1, absmax)));
      } else {
        const float inv0 = absmax == 0.0f ? 0.0f : v0 / absmax, inv1 = absmax == 0.0f ? 0.0f : v1 / absmax;
        codes[i / 2] = uint8_t((nf4_code(inv0) << 4) | nf4_code(inv1));
      }
    }
  }
}

// One thread per value (grid-stride).
template <class T>
__global__ void dequantize_kernel(Quant q, int64_t n, int64_t cols, const uint8_t* codes, const float* scales,
                                  T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(q == Quant::NF4 ? nf4_dequantized(codes, scales, i)
                                           : float(int8_t(codes[i])) * (scales[i / cols] / 127.0f));
}

}  // namespace

template <>
void quantize<Device::Cuda>(Quant q, FloatType type, int64_t rows, int64_t cols, const void* x, uint8_t* codes,
                            float* scales) {
  const int64_t n = rows * cols, block = quant_block(q, cols);
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    quantize_kernel<<<cuda::blocks_for(n / block), cuda::kThreads, 0, cuda::stream()>>>(
        q, n, block, static_cast<const T*>(x), codes, scales);
  });
  cuda::check_launch("quantize");
}

template <>
void dequantize<Device::Cuda>(Quant q, int64_t rows, int64_t cols, const uint8_t* codes, const float* scales,
                              FloatType type, void* out) {
  const int64_t n = rows * cols;
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    dequantize_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(q, n, cols, codes, scales,
                                                                                 static_cast<T*>(out));
  });
  cuda::check_launch("dequantize");
}

}  // namespace jnntile
