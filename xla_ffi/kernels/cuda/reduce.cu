#include "kernels/cuda/groups.h"
#include "kernels/reduce.h"

namespace jnntile {
namespace {

constexpr int kReduceThreads = 256;

// Block b sums the squares of its grid-stride share of x into partials[b]; the
// shared-memory tree has a fixed shape, so the result is the same every run. A
// thread loads kPerThread of its elements before it adds them, in its order (its
// loads all in flight; one at a time, 28 tasks took 2.4 ms per GPT-2 124M step on
// an H200).
__global__ void sumsq_blocks_kernel(int64_t n, const float* x, double* partials) {
  constexpr int kPerThread = cuda::kPerThread;
  __shared__ double acc[kReduceThreads];
  double sum = 0.0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i0 < n; i0 += kPerThread * stride) {
    float xs[kPerThread];
    cuda::load(n, i0, stride, x, xs);
    cuda::for_each_element(n, i0, stride, [&](int k, int64_t) { sum += double(xs[k]) * double(xs[k]); });
  }
  acc[threadIdx.x] = sum;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) acc[threadIdx.x] += acc[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = acc[0];
}

// One block adds the partials: thread t sums partials t, t + blockDim, ... in
// order, then the same fixed tree. (A single thread walking them in a row waited
// on one global load after another: ~60 us per tile, most of the gradient norm.)
__global__ void sum_blocks_kernel(int blocks, const double* partials, double* out) {
  __shared__ double acc[kReduceThreads];
  double sum = 0.0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) sum += partials[b];
  acc[threadIdx.x] = sum;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) acc[threadIdx.x] += acc[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = acc[0];
}

__global__ void combine_kernel(int64_t count, const double* const* partials, bool take_sqrt, float* out) {
  CompensatedSum total;
  for (int64_t i = 0; i < count; ++i) total.add(*partials[i]);
  *out = float(take_sqrt ? sqrt(total.sum) : total.sum);
}

__global__ void backward_kernel(int64_t n, bool take_sqrt, const float* x, const float* out, const float* dout,
                                float* dx) {
  float c = sumsq_backward_scale(take_sqrt, *out, *dout);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dx[i] += c * x[i];
}

}  // namespace

template <>
void sumsq<Device::Cuda>(int64_t n, const float* x, double* out, double* scratch) {
  unsigned blocks = cuda::blocks_for(n, kReduceThreads);
  if (blocks > unsigned(kSumsqBlocks)) blocks = kSumsqBlocks;
  sumsq_blocks_kernel<<<blocks, kReduceThreads, 0, cuda::stream()>>>(n, x, scratch);
  cuda::check_launch("sumsq");
  sum_blocks_kernel<<<1, kReduceThreads, 0, cuda::stream()>>>(int(blocks), scratch, out);
  cuda::check_launch("sumsq");
}

template <>
void sumsq_combine<Device::Cuda>(int64_t count, const double* const* partials, bool take_sqrt, float* out,
                                 void* scratch) {
  const double* const* device = cuda::device_pointers(partials, count, scratch, "sumsq_combine");
  combine_kernel<<<1, 1, 0, cuda::stream()>>>(count, device, take_sqrt, out);
  cuda::check_launch("sumsq_combine");
}

template <>
void sumsq_backward<Device::Cuda>(int64_t n, bool take_sqrt, const float* x, const float* out, const float* dout,
                                  float* dx) {
  backward_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(n, take_sqrt, x, out, dout, dx);
  cuda::check_launch("sumsq_backward");
}

}  // namespace jnntile
