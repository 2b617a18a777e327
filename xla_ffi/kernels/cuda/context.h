// What the CUDA kernels need from StarPU: the stream and the cuBLAS handle of
// the calling CUDA worker (implemented in context.cc, the only CUDA file that
// sees StarPU), launch helpers, and the runtime's set-up of the CUDA workers.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jnntile::cuda {

// StarPU's stream of the calling worker: codelets are STARPU_CUDA_ASYNC, so
// kernels launch on it and return; StarPU waits for the stream.
cudaStream_t stream();
// StarPU's cuBLAS handle of the calling worker, bound to stream().
cublasHandle_t cublas();

// Aborts naming `what` when a launch or a cuBLAS call failed: a kernel cannot
// report an error through StarPU, and a wrong result must not pass silently.
void check(cudaError_t status, const char* what);
void check(cublasStatus_t status, const char* what);
// Checks the launch that just happened.
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

// Blocks for a grid-stride loop over n items.
constexpr int kThreads = 256;
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  int64_t blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : (blocks > 65535 * 16 ? 65535 * 16 : blocks));
}

// Up to kSize tile pointers passed to a kernel by value: kernel parameters need
// no device allocation and no copy. Entry points that take a host array of tile
// pointers (the partial results a combine task reads) launch once per chunk.
template <class T>
struct PointerChunk {
  static constexpr int kSize = 64;
  const T* ptr[kSize];
  int count;
};

// Called by the runtime after starpu_init: cuBLAS handles on every CUDA worker,
// with TF32 tensor-core math allowed or not; and before starpu_shutdown.
void start_workers(bool tf32);
void stop_workers();
// GPUs the CUDA runtime sees (0 without a driver).
int device_count();

}  // namespace jnntile::cuda
