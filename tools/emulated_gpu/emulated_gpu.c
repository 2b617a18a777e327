// An emulated GPU for the CUDA build on a machine without one: preloaded (LD_PRELOAD) into a process of
// .venv-cuda, it answers the CUDA runtime and cuBLAS calls StarPU and jnntile make, with "device memory" that
// is host memory, copies that are memcpy and streams and events that are always done. StarPU then runs a CUDA
// worker, GPU memory limits, eviction to RAM and disk swap, transfers and pinning through its real CUDA driver;
// jnntile sees the library (jnntile_emulated_gpu below) and gives its codelets' CUDA slot the CPU kernels,
// which read and write the "device" pointers directly. What it tests is StarPU's and jnntile's handling of a
// GPU's memory and tasks, not the CUDA kernels (those need a GPU): `make test-emulated-gpu`.
//
// EMULATED_GPU_MB sets the device memory (default 1024). Calls outside this list reach the real CUDA runtime,
// which finds no GPU and fails: a new call StarPU or jnntile makes shows up as that failure.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Found by jnntile (dlsym): the CUDA slot of its codelets then runs the CPU kernels.
int jnntile_emulated_gpu = 1;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t allocated;  // bytes of device memory in use

static size_t total_bytes(void) {
  const char* mb = getenv("EMULATED_GPU_MB");
  return (size_t)(mb != NULL && atoll(mb) > 0 ? atoll(mb) : 1024) << 20;
}

// Each allocation is preceded by its size, so that cudaFree can count it back.
enum { kHeader = 256 };  // cudaMalloc's alignment

cudaError_t cudaMalloc(void** ptr, size_t size) {
  pthread_mutex_lock(&lock);
  const int fits = allocated + size <= total_bytes();
  if (fits) allocated += size;
  pthread_mutex_unlock(&lock);
  *ptr = NULL;
  if (!fits) return cudaErrorMemoryAllocation;
  char* block = aligned_alloc(kHeader, kHeader + ((size + kHeader - 1) / kHeader) * kHeader);
  if (block == NULL) {
    pthread_mutex_lock(&lock);
    allocated -= size;
    pthread_mutex_unlock(&lock);
    return cudaErrorMemoryAllocation;
  }
  memcpy(block, &size, sizeof size);
  *ptr = block + kHeader;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == NULL) return cudaSuccess;  // StarPU's cudaFree(0) initialises the context
  char* block = (char*)ptr - kHeader;
  size_t size;
  memcpy(&size, block, sizeof size);
  pthread_mutex_lock(&lock);
  allocated -= size;
  pthread_mutex_unlock(&lock);
  free(block);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  pthread_mutex_lock(&lock);
  *total = total_bytes();
  *free_bytes = *total - allocated;
  pthread_mutex_unlock(&lock);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "emulated GPU");
  prop->totalGlobalMem = total_bytes();
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->concurrentKernels = 1;
  prop->unifiedAddressing = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  (void)device;
  *value = attr == cudaDevAttrComputeMode ? cudaComputeModeDefault : 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  (void)device, (void)peer;
  *can = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) { (void)peer, (void)flags; return cudaSuccess; }
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t error) { return error == cudaSuccess ? "no error" : "emulated GPU error"; }
cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  (void)func, (void)attr, (void)value;
  return cudaSuccess;
}

// Host memory: page-locked in name only.
cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int flags) {
  (void)flags;
  *ptr = aligned_alloc(kHeader, ((size + kHeader - 1) / kHeader) * kHeader);
  return *ptr != NULL ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* ptr) {
  free(ptr);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
  (void)ptr, (void)size, (void)flags;
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* ptr) { (void)ptr; return cudaSuccess; }
cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned int flags) {
  (void)flags;
  *device = host;
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr) {
  memset(attributes, 0, sizeof *attributes);
  attributes->type = cudaMemoryTypeHost;
  attributes->hostPointer = (void*)ptr;
  attributes->devicePointer = (void*)ptr;
  return cudaSuccess;
}

// Streams and events: every operation completes before its call returns.
static int stream_token;
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  (void)flags;
  *stream = (cudaStream_t)&stream_token;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) { (void)stream; return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t stream) { (void)stream; return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t stream) { (void)stream; return cudaSuccess; }
static int event_token;
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  (void)flags;
  *event = (cudaEvent_t)&event_token;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) { (void)event; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) { (void)event, (void)stream; return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t event) { (void)event; return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t event) { (void)event; return cudaSuccess; }

// Copies and fills.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  (void)kind;
  memmove(dst, src, count);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t s) {
  (void)s;
  return cudaMemcpy(dst, src, count, kind);
}
cudaError_t cudaMemcpyPeer(void* dst, int dst_device, const void* src, int src_device, size_t count) {
  (void)dst_device, (void)src_device;
  memmove(dst, src, count);
  return cudaSuccess;
}
cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                                cudaStream_t s) {
  (void)s;
  return cudaMemcpyPeer(dst, dst_device, src, src_device, count);
}
cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         enum cudaMemcpyKind kind) {
  (void)kind;
  for (size_t row = 0; row < height; ++row) memmove((char*)dst + row * dpitch, (const char*)src + row * spitch, width);
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
  (void)s;
  return cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind);
}
// Linear memory only (StarPU copies pitched blocks of bytes this way, never arrays).
cudaError_t cudaMemcpy3DPeer(const struct cudaMemcpy3DPeerParms* p) {
  if (p->srcArray != NULL || p->dstArray != NULL) return cudaErrorInvalidValue;
  for (size_t z = 0; z < p->extent.depth; ++z)
    for (size_t y = 0; y < p->extent.height; ++y) {
      const char* src = (const char*)p->srcPtr.ptr + p->srcPos.x +
                        ((p->srcPos.z + z) * p->srcPtr.ysize + p->srcPos.y + y) * p->srcPtr.pitch;
      char* dst = (char*)p->dstPtr.ptr + p->dstPos.x +
                  ((p->dstPos.z + z) * p->dstPtr.ysize + p->dstPos.y + y) * p->dstPtr.pitch;
      memmove(dst, src, p->extent.width);
    }
  return cudaSuccess;
}
cudaError_t cudaMemcpy3DPeerAsync(const struct cudaMemcpy3DPeerParms* p, cudaStream_t s) {
  (void)s;
  return cudaMemcpy3DPeer(p);
}
cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  memset(ptr, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void* ptr, size_t pitch, int value, size_t width, size_t height, cudaStream_t s) {
  (void)s;
  for (size_t row = 0; row < height; ++row) memset((char*)ptr + row * pitch, value, width);
  return cudaSuccess;
}

// cuBLAS: handles only. jnntile's products run its CPU kernels here, so no cuBLAS product is ever called.
static int handle_token;
cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = (cublasHandle_t)&handle_token;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) { (void)handle; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  (void)handle, (void)stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  (void)handle, (void)mode;
  return CUBLAS_STATUS_SUCCESS;
}
// The legacy API StarPU's starpu_cublas_init calls too.
cublasStatus_t cublasInit(void) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasShutdown(void) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetKernelStream(cudaStream_t stream) { (void)stream; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = (cublasLtHandle_t)&handle_token;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) { (void)handle; return CUBLAS_STATUS_SUCCESS; }
