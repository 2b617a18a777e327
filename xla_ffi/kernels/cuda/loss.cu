#include <algorithm>

#include "kernels/cuda/warp.h"
#include "kernels/loss.h"

namespace jnntile {
namespace {

using cuda::kWarp;

// A warp per row, its lanes on every 32nd logit: the max over the warp gives
// every lane the same new running max m, then the lanes' sums of exp(x - m)
// add up over the warp and lane 0 updates the row.
template <class T>
__global__ void stats_kernel(bool first, int64_t rows, int64_t nv, int64_t v0, const T* logits,
                             const int32_t* targets, double* stats) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    const T* x = logits + r * nv;
    cross_entropy::Row row = cross_entropy::load(first, stats + r * kCrossEntropyStats);
    float tile_max = cuda::warp_reduce(cross_entropy::strided_max(x, cuda::lane(), nv, kWarp),
                                       [](float a, float b) { return fmaxf(a, b); });
    double m = cross_entropy::new_max(row, tile_max);
    double tile_sum = cuda::warp_reduce(cross_entropy::strided_sum_exp(x, cuda::lane(), nv, kWarp, float(m)),
                                        [](double a, double b) { return a + b; });
    if (cuda::lane() == 0) {
      cross_entropy::add_tile(row, m, tile_sum);
      int64_t t = cross_entropy::target_column(targets[r], v0, nv);
      if (t >= 0) row.target = to_float(x[t]);
      cross_entropy::store(row, stats + r * kCrossEntropyStats);
    }
  }
}

constexpr int kFinishThreads = 256;

// One block: each thread its share of the rows, then a shared-memory tree of
// fixed shape over the threads' sums and counts.
__global__ void finish_kernel(int64_t rows, const double* stats, const int32_t* targets, int32_t ignore_index,
                              float* lse, double* partial) {
  __shared__ double sums[kFinishThreads], counts[kFinishThreads];
  double sum = 0.0, count = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
    cross_entropy::finish_row(r, stats, targets, ignore_index, lse, sum, count);
  sums[threadIdx.x] = sum;
  counts[threadIdx.x] = count;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      sums[threadIdx.x] += sums[threadIdx.x + half];
      counts[threadIdx.x] += counts[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[0] = sums[0];
    partial[1] = counts[0];
  }
}

__global__ void combine_kernel(int64_t count, const double* const* partials, float* loss, float* inv_count) {
  cross_entropy::mean(count, partials, loss, inv_count);
}

// Logits per thread of the backward: all of a thread's loads are in flight at once. With one logit per
// thread (a thread per logit, grid y over the rows) it took 850 us per GPT-2 124M tile of 8192 x 16384
// bfloat16 logits on an H200 (3.4 ms per step), where its 537 MB of reads and writes need about 130 us.
// (A warp per row, 128 blocks for a 1024-row tile, took 1.8 ms per tile of 50257 logits on an H100.)
constexpr int kLogitsPerThread = 8;

// Grid y over the rows, grid x over the logits of a row: a block takes kLogitsPerThread * blockDim.x of
// them, a warp's lanes adjacent logits (coalesced). cross_entropy::grad_term, less scale at the target, dx read
// as 0 with `overwrite`, as cross_entropy::strided_grad.
template <class T>
__global__ void backward_kernel(int64_t rows, int64_t nv, int64_t v0, bool overwrite, const T* __restrict__ logits,
                                const int32_t* targets, const float* lse, int32_t ignore_index,
                                const float* inv_count, const float* dloss, T* __restrict__ dlogits) {
  const float scale = cross_entropy::grad_scale(inv_count, dloss);
  const int64_t first = blockIdx.x * int64_t(blockDim.x) * kLogitsPerThread + threadIdx.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* x = logits + r * nv;
    T* dx = dlogits + r * nv;
    const bool ignored = targets[r] == ignore_index;
    if (ignored && !overwrite) continue;  // nothing to add
    const int64_t t = cross_entropy::target_column(targets[r], v0, nv);
    const float row_lse = lse[r];
    float xs[kLogitsPerThread], old[kLogitsPerThread];
#pragma unroll
    for (int k = 0; k < kLogitsPerThread; ++k) {
      const int64_t j = first + k * int64_t(blockDim.x);
      xs[k] = j < nv && !ignored ? to_float(x[j]) : 0.0f;
      old[k] = j < nv && !overwrite ? to_float(dx[j]) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kLogitsPerThread; ++k) {
      const int64_t j = first + k * int64_t(blockDim.x);
      if (j >= nv) continue;
      if (ignored) {  // with overwrite: zeros where dx holds nothing yet
        dx[j] = from_float<T>(0.0f);
        continue;
      }
      const float term = cross_entropy::grad_term(old[k], xs[k], row_lse, scale);
      dx[j] = from_float<T>(j == t ? term - scale : term);
    }
  }
}

}  // namespace

template <>
void cross_entropy_stats<Device::Cuda>(FloatType type, bool first, int64_t rows, int64_t nv, int64_t v0,
                                       const void* logits, const int32_t* targets, double* stats) {
  visit_float(type, [&](auto t) {
    stats_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(
        first, rows, nv, v0, static_cast<const decltype(t)*>(logits), targets, stats);
  });
  cuda::check_launch("cross_entropy_stats");
}

template <>
void cross_entropy_finish<Device::Cuda>(int64_t rows, const double* stats, const int32_t* targets,
                                        int32_t ignore_index, float* lse, double* partial) {
  finish_kernel<<<1, kFinishThreads, 0, cuda::stream()>>>(rows, stats, targets, ignore_index, lse, partial);
  cuda::check_launch("cross_entropy_finish");
}

template <>
void cross_entropy_combine<Device::Cuda>(int64_t count, const double* const* partials, float* loss,
                                         float* inv_count, void* scratch) {
  const double* const* device = cuda::device_pointers(partials, count, scratch, "cross_entropy_combine");
  combine_kernel<<<1, 1, 0, cuda::stream()>>>(count, device, loss, inv_count);
  cuda::check_launch("cross_entropy_combine");
}

template <>
void cross_entropy_backward<Device::Cuda>(FloatType type, int64_t rows, int64_t nv, int64_t v0, bool overwrite,
                                          const void* logits, const int32_t* targets, const float* lse,
                                          int32_t ignore_index, const float* inv_count, const float* dloss,
                                          void* dlogits) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const dim3 grid(cuda::blocks_for(nv, cuda::kThreads * kLogitsPerThread),
                    unsigned(std::clamp<int64_t>(rows, 1, 65535)));
    backward_kernel<<<grid, cuda::kThreads, 0, cuda::stream()>>>(
        rows, nv, v0, overwrite, static_cast<const T*>(logits), targets, lse, ignore_index, inv_count, dloss,
        static_cast<T*>(dlogits));
  });
  cuda::check_launch("cross_entropy_backward");
}

}  // namespace jnntile
