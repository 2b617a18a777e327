#include "kernels/cuda/context.h"
#include "kernels/data.h"

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
void fill_random<Device::Cuda>(const TileGeometry& g, uint64_t seed, bool normal, float a, float b, float* tile) {
  int64_t n = g.numel();
  random_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(g, n, seed, normal, a, b, tile);
  cuda::check_launch("random");
}

}  // namespace jnntile
