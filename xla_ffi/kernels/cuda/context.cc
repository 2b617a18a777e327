#include "kernels/cuda/context.h"

#include <starpu.h>
#include <starpu_cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace jnntile::cuda {

cudaStream_t stream() { return starpu_cuda_get_local_stream(); }

cublasHandle_t cublas() { return starpu_cublas_get_local_handle(); }

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  std::fprintf(stderr, "jnntile: CUDA kernel %s failed: %s\n", what, cudaGetErrorString(status));
  std::abort();
}

void check(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "jnntile: cuBLAS call in %s failed with status %d\n", what, int(status));
  std::abort();
}

const char* take_last_error() { return cudaGetErrorString(cudaGetLastError()); }

namespace {
void set_math_mode(void* tf32) {
  cublasMath_t mode = *static_cast<bool*>(tf32) ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
  check(cublasSetMathMode(starpu_cublas_get_local_handle(), mode), "cublasSetMathMode");
}
}  // namespace

namespace {
bool fused_attention_enabled = false;  // set while no task runs: before the runtime's first task
}  // namespace

bool fused_attention() { return fused_attention_enabled; }

void start_workers(bool tf32, bool fused_attention) {
  fused_attention_enabled = fused_attention;
  if (starpu_cuda_worker_get_count() == 0) return;
  starpu_cublas_init();
  starpu_execute_on_each_worker(set_math_mode, &tf32, STARPU_CUDA);
}

void stop_workers() {
  if (starpu_cuda_worker_get_count() > 0) starpu_cublas_shutdown();
}

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

int64_t device_free_bytes(int devices) {
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) return 0;
  const int count = devices < 0 ? device_count() : std::min(devices, device_count());
  int64_t least = -1;
  for (int device = 0; device < count; ++device) {
    size_t free = 0, total = 0;
    if (cudaSetDevice(device) == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess)
      least = least < 0 ? int64_t(free) : std::min(least, int64_t(free));
  }
  cudaSetDevice(current);
  return least < 0 ? 0 : least;
}

}  // namespace jnntile::cuda
