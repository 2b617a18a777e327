#include "kernels/cuda/warp.h"
#include "kernels/embedding.h"

namespace jnntile {
namespace {

using cuda::kThreads;
using cuda::kWarp;

// A warp per position, its lanes on every 32nd column.
template <class T>
__global__ void forward_kernel(int64_t n, int64_t c, int64_t v0, int64_t vlen, const int32_t* ids,
                               const float* table, bool first, T* out) {
  for (int64_t p = cuda::warp_index(); p < n; p += cuda::warp_count()) {
    int64_t row = embedding::row(ids[p], v0, vlen);
    if (row < 0 && !first) continue;
    for (int64_t j = cuda::lane(); j < c; j += kWarp) out[p * c + j] = from_float<T>(row >= 0 ? table[row * c + j] : 0.0f);
  }
}

// The backward splits the table tile into this many groups of rows: with the
// blocks over columns (3 for GPT-2's 768) a few hundred blocks, two or more per
// SM of an H100, where 32 groups left most SMs idle (7 ms per GPT-2 124M step).
constexpr int64_t kRowGroups = 96;

// A thread per (column, group of rows_per_group table rows): blockIdx.y is the
// group. Each element of dtable belongs to one thread, which goes through the
// ids in order and adds the dout rows of those in its group: no atomics, and
// the terms arrive in the CPU's order. The block stages kThreads ids at a time
// in shared memory as rows of its group (or -1), so the scan reads shared
// memory, the same entry on every thread; reads of dout and dtable are
// coalesced across columns. Every thread reaches every __syncthreads: the
// grid covers the columns exactly once and threads past the last column only
// stage ids.
template <class T>
__global__ void backward_kernel(int64_t n, int64_t c, int64_t v0, int64_t vlen, int64_t rows_per_group,
                                const int32_t* ids, const T* dout, float* dtable) {
  __shared__ int64_t rows[kThreads];
  const int64_t first_row = blockIdx.y * rows_per_group;
  const int64_t group_rows = vlen - first_row < rows_per_group ? vlen - first_row : rows_per_group;
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  float* column = dtable + first_row * c + j;
  for (int64_t base = 0; base < n; base += kThreads) {
    const int64_t staged = n - base < kThreads ? n - base : kThreads;
    if (threadIdx.x < staged) rows[threadIdx.x] = embedding::row(ids[base + threadIdx.x], v0 + first_row, group_rows);
    __syncthreads();
    if (j < c)
      for (int64_t i = 0; i < staged; ++i)
        if (rows[i] >= 0) column[rows[i] * c] += to_float(dout[(base + i) * c + j]);
    __syncthreads();
  }
}

}  // namespace

template <>
void embedding_forward<Device::Cuda>(FloatType type, int64_t n, int64_t c, int64_t v0, int64_t vlen,
                                     const int32_t* ids, const float* table, bool first, void* out) {
  visit_float(type, [&](auto t) {
    forward_kernel<<<cuda::blocks_for_rows(n), cuda::kThreads, 0, cuda::stream()>>>(
        n, c, v0, vlen, ids, table, first, static_cast<decltype(t)*>(out));
  });
  cuda::check_launch("embedding_forward");
}

template <>
void embedding_backward<Device::Cuda>(FloatType type, int64_t n, int64_t c, int64_t v0, int64_t vlen,
                                      const int32_t* ids, const void* dout, float* dtable) {
  // Groups of equal size, each starting inside the tile.
  int64_t rows_per_group = (vlen + kRowGroups - 1) / kRowGroups;
  int64_t groups = (vlen + rows_per_group - 1) / rows_per_group;
  dim3 grid(unsigned((c + cuda::kThreads - 1) / cuda::kThreads), unsigned(groups));
  visit_float(type, [&](auto t) {
    backward_kernel<<<grid, cuda::kThreads, 0, cuda::stream()>>>(n, c, v0, vlen, rows_per_group, ids,
                                                                 static_cast<const decltype(t)*>(dout), dtable);
  });
  cuda::check_launch("embedding_backward");
}

}  // namespace jnntile
