#include "kernels/cuda/context.h"
#include "kernels/values.h"

namespace jnntile {
namespace {

template <class T>
__global__ void fill_kernel(int64_t n, T value, T* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = value;
}

template <class T>
void launch_fill(int64_t n, T value, T* dst) {
  fill_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, value, dst);
  cuda::check_launch("fill");
}

template <class S, class T>
__global__ void convert_kernel(int64_t n, const S* src, T* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_float<T>(to_float(src[i]));
}

// One thread per element of the tile (grid-stride), which finds its global index itself.
__global__ void random_kernel(TileGeometry g, int64_t n, uint64_t seed, bool normal, float a, float b, float* tile) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    tile[i] = random_value(seed, g.global_index(i), normal, a, b);
}

}  // namespace

template <>
void fill<Device::Cuda>(int64_t n, float value, float* dst) { launch_fill(n, value, dst); }
template <>
void fill<Device::Cuda>(int64_t n, int32_t value, int32_t* dst) { launch_fill(n, value, dst); }
template <>
void fill<Device::Cuda>(int64_t n, int64_t value, int64_t* dst) { launch_fill(n, value, dst); }
template <>
void fill<Device::Cuda>(int64_t n, bfloat16 value, bfloat16* dst) { launch_fill(n, value, dst); }
template <>
void fill<Device::Cuda>(int64_t n, uint8_t value, uint8_t* dst) { launch_fill(n, value, dst); }

template <>
void convert<Device::Cuda>(int64_t n, FloatType from, const void* src, FloatType to, void* dst) {
  visit_float(from, [&](auto source_type) {
    visit_float(to, [&](auto target_type) {
      using S = decltype(source_type);
      using T = decltype(target_type);
      convert_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, static_cast<const S*>(src),
                                                                                 static_cast<T*>(dst));
      cuda::check_launch("convert");
    });
  });
}

template <>
void fill_random<Device::Cuda>(const TileGeometry& g, uint64_t seed, bool normal, float a, float b, float* tile) {
  int64_t n = g.numel();
  random_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(g, n, seed, normal, a, b, tile);
  cuda::check_launch("random");
}

}  // namespace jnntile
