#include "kernels/bias.h"
#include "kernels/cuda/context.h"

namespace jnntile {
namespace {

// One thread per element (grid-stride); consecutive threads read consecutive x and b.
template <class T>
__global__ void add_bias_kernel(int64_t total, int64_t n, const T* x, const float* b, T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(to_float(x[i]) + b[i % n]);
}

constexpr int kGradColumns = 32, kGradRowLanes = 16;

// A block of 32 columns x 16 row lanes: lane k sums rows k, k + 16, ... of its
// column in double (a warp reads 32 consecutive floats of a row), then the
// lanes' sums are added in lane order, so no float atomics and the same bits
// every run; 16 lanes give a tile of few columns 16 times more warps.
template <class T>
__global__ void bias_grad_kernel(int64_t rows, int64_t n, bool overwrite, const T* dy, float* db) {
  __shared__ double lane_sums[kGradRowLanes][kGradColumns];
  int64_t j = blockIdx.x * int64_t(kGradColumns) + threadIdx.x;
  double sum = 0.0;
  if (j < n)
    for (int64_t r = threadIdx.y; r < rows; r += kGradRowLanes) sum += to_float(dy[r * n + j]);
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && j < n) {
    double total = 0.0;
    for (int k = 0; k < kGradRowLanes; ++k) total += lane_sums[k][threadIdx.x];
    db[j] = (overwrite ? 0.0f : db[j]) + float(total);
  }
}

}  // namespace

template <>
void add_bias<Device::Cuda>(FloatType type, int64_t rows, int64_t n, const void* x, const float* b, void* out) {
  int64_t total = rows * n;
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    add_bias_kernel<<<cuda::blocks_for(total), cuda::kThreads, 0, cuda::stream()>>>(
        total, n, static_cast<const T*>(x), b, static_cast<T*>(out));
  });
  cuda::check_launch("add_bias");
}

template <>
void bias_grad<Device::Cuda>(FloatType type, int64_t rows, int64_t n, bool overwrite, const void* dy, float* db) {
  unsigned blocks = unsigned((n + kGradColumns - 1) / kGradColumns);
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    bias_grad_kernel<<<blocks, dim3(kGradColumns, kGradRowLanes), 0, cuda::stream()>>>(
        rows, n, overwrite, static_cast<const T*>(dy), db);
  });
  cuda::check_launch("add_bias_db");
}

}  // namespace jnntile
