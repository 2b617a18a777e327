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
// Checks the launch that just happened. CUDA reports an earlier failure of the
// same thread here too, so host-side CUDA calls that may fail without aborting
// (page-locking tiles) clear theirs with take_last_error.
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }
// The name of the thread's last CUDA error, which this clears.
const char* take_last_error();

// Blocks for a grid-stride loop over n items.
constexpr int kThreads = 256;
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  int64_t blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : (blocks > 65535 * 16 ? 65535 * 16 : blocks));
}

// Entry points that read many partial tiles (combine tasks) get a host array of
// their pointers and a STARPU_SCRATCH buffer of as many pointers on the GPU:
// this stores the array there and returns it. The pointers travel as kernel
// parameters (pointers.cu), which CUDA copies at launch: a cudaMemcpyAsync from
// the caller's pageable array would make the stream wait at every combine task,
// and one from pinned memory would need that memory to outlive the copy.
void store_pointers(const void* const* host, int64_t count, void* scratch, const char* what);
template <class T>
const T* const* device_pointers(const T* const* host, int64_t count, void* scratch, const char* what) {
  store_pointers(reinterpret_cast<const void* const*>(host), count, scratch, what);
  return static_cast<const T* const*>(scratch);
}

// Called by the runtime after starpu_init: cuBLAS handles on every CUDA worker,
// with TF32 tensor-core math allowed or not, and whether bfloat16 attention
// steps run fused (attention.cu); and before starpu_shutdown.
void start_workers(bool tf32, bool fused_attention);
bool fused_attention();
void stop_workers();
// GPUs the CUDA runtime sees (0 without a driver).
int device_count();
// Memory free now on the one of the first `devices` GPUs (every GPU where `devices` is negative) that has the
// least of it (another library or process may hold some): a GPU memory limit is one for every GPU StarPU uses,
// so the default must fit the fullest.
int64_t device_free_bytes(int devices);

}  // namespace jnntile::cuda
