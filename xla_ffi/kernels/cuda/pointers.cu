// The pointer tables of combine tasks, stored on the GPU through kernel
// parameters (see cuda::device_pointers in context.h).
#include "kernels/cuda/context.h"

namespace jnntile::cuda {
namespace {

// 256 pointers (2 KB) per launch: within the 4 KB of kernel parameters every
// architecture accepts.
constexpr int kPointersPerLaunch = 256;

struct PointerChunk {
  const void* pointers[kPointersPerLaunch];
};

__global__ void store_kernel(PointerChunk chunk, int count, const void** table) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) table[i] = chunk.pointers[i];
}

}  // namespace

void store_pointers(const void* const* host, int64_t count, void* scratch, const char* what) {
  const void** table = static_cast<const void**>(scratch);
  for (int64_t start = 0; start < count; start += kPointersPerLaunch) {
    int n = int(count - start < kPointersPerLaunch ? count - start : kPointersPerLaunch);
    PointerChunk chunk;
    for (int i = 0; i < n; ++i) chunk.pointers[i] = host[start + i];
    store_kernel<<<1, kPointersPerLaunch, 0, stream()>>>(chunk, n, table + start);
    check_launch(what);
  }
}

}  // namespace jnntile::cuda
