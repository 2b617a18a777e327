#include "kernels/cuda/context.h"
#include "kernels/dropout.h"

namespace jnntile {
namespace {

// One thread per element of the tile (grid-stride), which finds its global index itself.
__global__ void dropout_kernel(TileGeometry g, int64_t n, uint64_t seed, double rate, float scale, bool accumulate,
                               const float* in, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float value = dropout_value(seed, g.global_index(i), rate, scale, in[i]);
    out[i] = accumulate ? out[i] + value : value;
  }
}

}  // namespace

template <>
void dropout<Device::Cuda>(const TileGeometry& g, uint64_t seed, double rate, bool accumulate, const float* in,
                           float* out) {
  int64_t n = g.numel();
  dropout_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(g, n, seed, rate, dropout_scale(rate),
                                                                             accumulate, in, out);
  cuda::check_launch("dropout");
}

}  // namespace jnntile
