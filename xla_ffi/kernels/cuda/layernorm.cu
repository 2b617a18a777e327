#include "kernels/cuda/warp.h"
#include "kernels/layernorm.h"

namespace jnntile {
namespace {

using cuda::kWarp;

// A warp per row: each lane the moments of every 32nd element, merged across the warp.
template <class T>
__global__ void partial_kernel(int64_t rows, int64_t n, bool centered, const T* x, double* partial) {
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
template <class T>
__global__ void normalize_kernel(int64_t rows, int64_t n, const T* x, const float* stats, const float* w,
                                 const float* b, T* y) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    for (int64_t j = cuda::lane(); j < n; j += kWarp)
      y[r * n + j] = from_float<T>(layernorm::y(to_float(x[r * n + j]), mean, rstd, w[j], b, j));
  }
}

// A warp per row, as partial_kernel.
template <class T>
__global__ void backward_partial_kernel(int64_t rows, int64_t n, const T* x, const float* stats, const float* w,
                                        const T* dy, double* partial) {
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
template <class T>
__global__ void backward_dx_kernel(int64_t rows, int64_t n, int64_t c, bool centered, const T* x, const float* stats,
                                   const float* w, const T* dy, const double* sums, T* dx) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    float mean = stats[2 * r], rstd = stats[2 * r + 1];
    float mean_g = centered ? float(sums[2 * r] / double(c)) : 0.0f, mean_gx = float(sums[2 * r + 1] / double(c));
    for (int64_t j = cuda::lane(); j < n; j += kWarp) {
      int64_t i = r * n + j;
      dx[i] = from_float<T>(to_float(dx[i]) +
                            layernorm::dx(to_float(x[i]), to_float(dy[i]), w[j], mean, rstd, mean_g, mean_gx));
    }
  }
}

// Blocks of 4 warps for backward_rows_kernel: a lane holds 3 * kPerLane floats (over 128 registers at 24), and
// 8 warps would leave one block per SM.
constexpr int kRowsThreads = 4 * kWarp;

// A warp per row whose whole normalized axis (n <= kPerLane * kWarp) is in the tile: backward_partial_kernel's
// sums, in its lanes' order (the same bits), then backward_dx_kernel's dx, in one pass. Every lane loads its
// x, dy and dx elements first, all loads in flight at once, and keeps them in registers. The two kernels above
// took 256 us per GPT-2 124M tile of 8192 x 768 bfloat16 rows on an H200 (6.4 ms per step), where its 50 MB
// of reads and writes need about 15 us: a lane's loop there most likely waits on one element's loads at a
// time (it is not unrolled), with 2 bytes per lane in flight.
template <class T, int kPerLane>
__global__ void __launch_bounds__(kRowsThreads)
    backward_rows_kernel(int64_t rows, int64_t n, bool centered, const T* __restrict__ x,
                         const float* __restrict__ stats, const float* __restrict__ w, const T* __restrict__ dy,
                         T* __restrict__ dx) {
  for (int64_t r = cuda::warp_index(); r < rows; r += cuda::warp_count()) {
    const T *x_row = x + r * n, *dy_row = dy + r * n;
    T* dx_row = dx + r * n;
    float xs[kPerLane], dys[kPerLane], dxs[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int j = cuda::lane() + k * kWarp;
      xs[k] = j < n ? to_float(x_row[j]) : 0.0f;
      dys[k] = j < n ? to_float(dy_row[j]) : 0.0f;
      dxs[k] = j < n ? to_float(dx_row[j]) : 0.0f;
    }
    const float mean = stats[2 * r], rstd = stats[2 * r + 1];
    layernorm::GradSums s;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int j = cuda::lane() + k * kWarp;
      if (j < n) s.add_element(xs[k], dys[k], w[j], mean, rstd);  // in layernorm::strided_grad_sums's order
    }
    s = cuda::warp_reduce(s, [](layernorm::GradSums a, layernorm::GradSums b) { return layernorm::add(a, b); });
    const float mean_g = centered ? float(s.g / double(n)) : 0.0f, mean_gx = float(s.gx / double(n));
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int j = cuda::lane() + k * kWarp;
      if (j < n)
        dx_row[j] = from_float<T>(dxs[k] + layernorm::dx(xs[k], dys[k], w[j], mean, rstd, mean_g, mean_gx));
    }
  }
}

constexpr int kParamWarps = 32;

// A block per kWarp columns, the lanes of a warp on adjacent columns (coalesced)
// and its kParamWarps warps on every kParamWarps-th row; then warp 0 adds the
// warps' sums in order. A thread per column alone (n = 768: 3 blocks on an
// H100's 132 SMs) took 1 ms per 4096-row tile. With n = 768 the kernel still
// has 24 blocks, so each warp keeps kRowsInFlight rows' loads in flight
// (unrolled; the sums keep their order) rather than waiting on every row's.
constexpr int kRowsInFlight = 4;

template <class T>
__global__ void backward_params_kernel(int64_t rows, int64_t n, bool overwrite, const T* __restrict__ x,
                                       const float* __restrict__ stats, const T* __restrict__ dy,
                                       float* dw, float* db) {
  __shared__ double warp_dw[kParamWarps][kWarp], warp_db[kParamWarps][kWarp];
  const int lane = cuda::lane(), warp = int(threadIdx.x) / kWarp;
  for (int64_t j0 = blockIdx.x * int64_t(kWarp); j0 < n; j0 += int64_t(gridDim.x) * kWarp) {
    const int64_t j = j0 + lane;
    double sum_dw = 0.0, sum_db = 0.0;
    if (j < n)
#pragma unroll kRowsInFlight
      for (int64_t r = warp; r < rows; r += kParamWarps)
        layernorm::add_param_terms(to_float(x[r * n + j]), to_float(dy[r * n + j]), stats[2 * r], stats[2 * r + 1],
                                   sum_dw, sum_db);
    warp_dw[warp][lane] = sum_dw;
    warp_db[warp][lane] = sum_db;
    __syncthreads();
    if (warp == 0 && j < n) {
      for (int w = 1; w < kParamWarps; ++w) {
        sum_dw += warp_dw[w][lane];
        sum_db += warp_db[w][lane];
      }
      if (dw) dw[j] = (overwrite ? 0.0f : dw[j]) + float(sum_dw);
      if (db) db[j] = (overwrite ? 0.0f : db[j]) + float(sum_db);
    }
    __syncthreads();  // before the next columns overwrite the sums
  }
}

}  // namespace

template <>
void layernorm_partial<Device::Cuda>(FloatType type, int64_t rows, int64_t n, bool centered, const void* x,
                                     double* partial) {
  visit_float(type, [&](auto t) {
    partial_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(
        rows, n, centered, static_cast<const decltype(t)*>(x), partial);
  });
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
void layernorm_normalize<Device::Cuda>(FloatType type, int64_t rows, int64_t n, const void* x, const float* stats,
                                       const float* w, const float* b, void* y) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    normalize_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(
        rows, n, static_cast<const T*>(x), stats, w, b, static_cast<T*>(y));
  });
  cuda::check_launch("layernorm_normalize");
}

template <>
void layernorm_backward_partial<Device::Cuda>(FloatType type, int64_t rows, int64_t n, const void* x,
                                              const float* stats, const float* w, const void* dy, double* partial) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    backward_partial_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(
        rows, n, static_cast<const T*>(x), stats, w, static_cast<const T*>(dy), partial);
  });
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
void layernorm_backward_dx<Device::Cuda>(FloatType type, int64_t rows, int64_t n, int64_t c, bool centered,
                                         const void* x, const float* stats, const float* w, const void* dy,
                                         const double* sums, void* dx) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    backward_dx_kernel<<<cuda::blocks_for_rows(rows), cuda::kThreads, 0, cuda::stream()>>>(
        rows, n, c, centered, static_cast<const T*>(x), stats, w, static_cast<const T*>(dy), sums, static_cast<T*>(dx));
  });
  cuda::check_launch("layernorm_backward_dx");
}

template <>
void layernorm_backward_rows<Device::Cuda>(FloatType type, int64_t rows, int64_t n, bool centered, const void* x,
                                           const float* stats, const float* w, const void* dy, double* partial,
                                           void* dx) {
  if (n > 32 * kWarp) {  // beyond the registers a lane keeps: two passes
    layernorm_backward_partial<Device::Cuda>(type, rows, n, x, stats, w, dy, partial);
    layernorm_backward_dx<Device::Cuda>(type, rows, n, n, centered, x, stats, w, dy, partial, dx);
    return;
  }
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    auto launch = [&](auto kernel) {
      kernel<<<cuda::blocks_for(rows * kWarp, kRowsThreads), kRowsThreads, 0, cuda::stream()>>>(
          rows, n, centered, static_cast<const T*>(x), stats, w, static_cast<const T*>(dy), static_cast<T*>(dx));
    };
    if (n <= 8 * kWarp)
      launch(backward_rows_kernel<T, 8>);
    else if (n <= 16 * kWarp)
      launch(backward_rows_kernel<T, 16>);
    else if (n <= 24 * kWarp)  // GPT-2 124M's 768
      launch(backward_rows_kernel<T, 24>);
    else
      launch(backward_rows_kernel<T, 32>);
  });
  cuda::check_launch("layernorm_backward_rows");
}

template <>
void layernorm_backward_params<Device::Cuda>(FloatType type, int64_t rows, int64_t n, bool overwrite, const void* x,
                                             const float* stats, const void* dy, float* dw, float* db) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    backward_params_kernel<<<cuda::blocks_for(n, kWarp), kParamWarps * kWarp, 0, cuda::stream()>>>(
        rows, n, overwrite, static_cast<const T*>(x), stats, static_cast<const T*>(dy), dw, db);
  });
  cuda::check_launch("layernorm_backward_params");
}

}  // namespace jnntile
