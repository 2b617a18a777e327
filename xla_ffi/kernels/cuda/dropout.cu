#include "kernels/cuda/context.h"
#include "kernels/dropout.h"

namespace jnntile {
namespace {

// One thread per element of the tile (grid-stride), which finds its global index itself.
template <class T>
__global__ void dropout_kernel(TileGeometry g, int64_t n, uint64_t seed, double rate, float scale, bool accumulate,
                               const T* in, T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float value = dropout_value(seed, g.global_index(i), rate, scale, to_float(in[i]));
    out[i] = from_float<T>(accumulate ? to_float(out[i]) + value : value);
  }
}

}  // namespace

template <>
void dropout<Device::Cuda>(FloatType type, const TileGeometry& g, uint64_t seed, double rate, bool accumulate,
                           const void* in, void* out) {
  int64_t n = g.numel();
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    dropout_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(
        g, n, seed, rate, dropout_scale(rate), accumulate, static_cast<const T*>(in), static_cast<T*>(out));
  });
  cuda::check_launch("dropout");
}

}  // namespace jnntile
