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

// NF4Double, one thread: the offset, the mean of the tile's absmax scales summed in double in order (the bits
// of the CPU kernel's), and the statistics past the tile's blocks zeroed.
__global__ void scale_offset_kernel(int64_t n_scales, const float* absmaxes, float* stats, int64_t n_stats) {
  double sum = 0.0;
  for (int64_t i = 0; i < n_scales; ++i) sum += absmaxes[i];
  stats[0] = float(sum / double(n_scales));
  for (int64_t i = scale_stats(n_scales); i < n_stats; ++i) stats[i] = 0.0f;
}

// NF4Double, one thread per block of 256 scales (grid-stride): its absmax less the offset, then its 8-bit codes.
__global__ void scale_codes_kernel(int64_t n_scales, const float* absmaxes, uint8_t* codes, float* stats) {
  const float offset = stats[0];
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b * kScaleBlock < n_scales;
       b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t start = b * kScaleBlock, stop = min(start + kScaleBlock, n_scales);
    float absmax = 0.0f;
    for (int64_t i = start; i < stop; ++i) absmax = fmaxf(absmax, fabsf(absmaxes[i] - offset));
    stats[1 + b] = absmax;
    for (int64_t i = start; i < stop; ++i) codes[i] = scale_code(absmaxes[i], offset, absmax);
  }
}

// One thread per value (grid-stride).
template <class T>
__global__ void dequantize_kernel(Quant q, int64_t n, int64_t cols, const uint8_t* codes, const void* scales,
                                  const float* stats, T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(is_nf4(q) ? nf4_dequantized(codes, scales, stats, i)
                                     : float(int8_t(codes[i])) *
                                           (static_cast<const float*>(scales)[i / cols] / 127.0f));
}

}  // namespace

template <>
void quantize<Device::Cuda>(Quant q, FloatType type, int64_t rows, int64_t cols, const void* x, uint8_t* codes,
                            void* scales, float* stats, int64_t n_stats, float* scratch) {
  const int64_t n = rows * cols, block = quant_block(q, cols), n_scales = n / block;
  float* absmaxes = q == Quant::NF4Double ? scratch : static_cast<float*>(scales);
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    quantize_kernel<<<cuda::blocks_for(n_scales), cuda::kThreads, 0, cuda::stream()>>>(
        q, n, block, static_cast<const T*>(x), codes, absmaxes);
  });
  cuda::check_launch("quantize");
  if (q != Quant::NF4Double) return;
  scale_offset_kernel<<<1, 1, 0, cuda::stream()>>>(n_scales, absmaxes, stats, n_stats);
  cuda::check_launch("quantize (scale offset)");
  scale_codes_kernel<<<cuda::blocks_for((n_scales + kScaleBlock - 1) / kScaleBlock), cuda::kThreads, 0,
                       cuda::stream()>>>(n_scales, absmaxes, static_cast<uint8_t*>(scales), stats);
  cuda::check_launch("quantize (scale codes)");
}

template <>
void dequantize<Device::Cuda>(Quant q, int64_t rows, int64_t cols, const uint8_t* codes, const void* scales,
                              const float* stats, FloatType type, void* out) {
  const int64_t n = rows * cols;
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    dequantize_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(q, n, cols, codes, scales, stats,
                                                                                 static_cast<T*>(out));
  });
  cuda::check_launch("dequantize");
}

}  // namespace jnntile
