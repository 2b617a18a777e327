#include "kernels/cuda/warp.h"
#include "kernels/layernorm.h"

namespace jnntile {
namespace {

using cuda::kWarp;

// A warp per row: each lane the moments of every 32nd element, merged across the warp.
__global__ void partial_kernel(int64_t rows, int64_t n, bool centered, const float* x, double* partial) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    layernorm::Moments m = layernorm::strided_moments(x + r * n, cuda::lane(), n, kWarp, centered);
    m = cuda::warp_reduce(m, [](layernorm::Moments a, layernorm::Moments b) { return layernorm::merge(a, b); });
    if (cuda::lane() == 0) {
      partial[2 * r] = m.mean;
      partial[2 * r + 1] = m.m2;
    }
  }
}

// A thread per row: it merges the few partials of the row's C tiles.
__global__ void stats_kernel(int64_t rows, int64_t count, const double* const* partials, int64_t tile_c, int64_t c,
                             double eps, float* stats) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x)
    layernorm::row_stats(r, count, partials, tile_c, c, eps, stats);
}

// A warp per row, its lanes on every 32nd element.
__global__ void normalize_kernel(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                                 const float* b, float* y) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    for (int64_t j = cuda::lane(); j < n; j += kWarp) y[r * n + j] = layernorm::y(x[r * n + j], mean, rstd, w[j], b, j);
  }
}

// A warp per row, as partial_kernel.
__global__ void backward_partial_kernel(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                                        const float* dy, double* partial) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    layernorm::GradSums s =
        layernorm::strided_grad_sums(x + r * n, dy + r * n, w, stats[2 * r], stats[2 * r + 1], cuda::lane(), n, kWarp);
    s = cuda::warp_reduce(s, [](layernorm::GradSums a, layernorm::GradSums b) { return layernorm::add(a, b); });
    if (cuda::lane() == 0) {
      partial[2 * r] = s.g;
      partial[2 * r + 1] = s.gx;
    }
  }
}

// A thread per element of sums.
__global__ void backward_combine_kernel(int64_t rows, int64_t count, const double* const* partials, double* sums) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < 2 * rows; i += int64_t(gridDim.x) * blockDim.x)
    sums[i] = layernorm::sum_partials(count, partials, i);
}

// A warp per row, as normalize_kernel.
__global__ void backward_dx_kernel(int64_t rows, int64_t n, int64_t c, bool centered, const float* x,
                                   const float* stats, const float* w, const float* dy, const double* sums, float* dx) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    float mean_g = centered ? float(sums[2 * r] / double(c)) : 0.0f, mean_gx = float(sums[2 * r + 1] / double(c));
    for (int64_t j = cuda::lane(); j < n; j += kWarp)
      dx[r * n + j] += layernorm::dx(x[r * n + j], dy[r * n + j], w[j], mean, rstd, mean_g, mean_gx);
  }
}

// A thread per column, summing its rows in order (reads coalesced across columns).
__global__ void backward_params_kernel(int64_t rows, int64_t n, const float* x, const float* stats, const float* dy,
                                       float* dw, float* db) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    double sum_dw = 0.0, sum_db = 0.0;
    for (int64_t r = 0; r < rows; ++r)
      layernorm::add_param_terms(x[r * n + j], dy[r * n + j], stats[2 * r], stats[2 * r + 1], sum_dw, sum_db);
    if (dw) dw[j] += float(sum_dw);
    if (db) db[j] += float(sum_db);
  }
}

}  // namespace

template <>
void layernorm_partial<Device::Cuda>(int64_t rows, int64_t n, bool centered, const float* x, double* partial) {
  partial_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(rows, n, centered, x, partial);
  cuda::check_launch("layernorm_partial");
}

template <>
void layernorm_stats<Device::Cuda>(int64_t rows, int64_t count, const double* const* partials, int64_t tile_c,
                                   int64_t c, double eps, float* stats, void* scratch) {
  const double* const* device = cuda::device_pointers(partials, count, scratch, "layernorm_stats");
  stats_kernel<<<cuda::blocks_for(rows), cuda::kThreads, 0, cuda::stream()>>>(rows, count, device, tile_c, c, eps,
                                                                               stats);
  cuda::check_launch("layernorm_stats");
}

template <>
void layernorm_normalize<Device::Cuda>(int64_t rows, int64_t n, const float* x, const float* stats, const float* w,
                                       const float* b, float* y) {
  normalize_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(rows, n, x, stats, w, b, y);
  cuda::check_launch("layernorm_normalize");
}

template <>
void layernorm_backward_partial<Device::Cuda>(int64_t rows, int64_t n, const float* x, const float* stats,
                                              const float* w, const float* dy, double* partial) {
  backward_partial_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(rows, n, x, stats, w,
                                                                                              dy, partial);
  cuda::check_launch("layernorm_backward_partial");
}

template <>
void layernorm_backward_combine<Device::Cuda>(int64_t rows, int64_t count, const double* const* partials,
                                              double* sums, void* scratch) {
  const double* const* device = cuda::device_pointers(partials, count, scratch, "layernorm_backward_combine");
  backward_combine_kernel<<<cuda::blocks_for(2 * rows), cuda::kThreads, 0, cuda::stream()>>>(rows, count, device,
                                                                                             sums);
  cuda::check_launch("layernorm_backward_combine");
}

template <>
void layernorm_backward_dx<Device::Cuda>(int64_t rows, int64_t n, int64_t c, bool centered, const float* x,
                                         const float* stats, const float* w, const float* dy, const double* sums,
                                         float* dx) {
  backward_dx_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(rows, n, c, centered, x,
                                                                                        stats, w, dy, sums, dx);
  cuda::check_launch("layernorm_backward_dx");
}

template <>
void layernorm_backward_params<Device::Cuda>(int64_t rows, int64_t n, const float* x, const float* stats,
                                             const float* dy, float* dw, float* db) {
  backward_params_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream()>>>(rows, n, x, stats, dy, dw, db);
  cuda::check_launch("layernorm_backward_params");
}

}  // namespace jnntile
