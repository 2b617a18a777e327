// An emulated GPU for the CUDA build on a machine without one: preloaded (LD_PRELOAD) into a process of
// .venv-cuda, it answers the CUDA runtime and cuBLAS calls StarPU and jnntile make, with "device memory" that
// is host memory and copies that are memcpy, done at once or, below, later. StarPU then runs a CUDA
// worker, GPU memory limits, eviction to RAM and disk swap, transfers and pinning through its real CUDA driver;
// jnntile sees the library (jnntile_emulated_gpu below) and gives its codelets' CUDA slot the CPU kernels,
// which read and write the "device" pointers directly. What it tests is StarPU's and jnntile's handling of a
// GPU's memory and tasks, not the CUDA kernels (those need a GPU): `make test-emulated-gpu`.
//
// EMULATED_GPU_MB sets each device's memory (default 1024; "1024,512": device 0's, then 1's, the last for the
// rest), EMULATED_GPU_COUNT the number of devices (default 1, at most kMaxDevices), and EMULATED_GPU_PEER=1 lets
// them copy to each other directly (StarPU's peer copies) rather than through host memory. Calls outside this
// list reach the real CUDA runtime, which finds no GPU and fails: a new call StarPU or jnntile makes shows up as
// that failure.
//
// EMULATED_GPU_ASYNC_US=N: the asynchronous copies and fills complete later than their call, as on a GPU. A copy
// thread runs them in the order they were queued, N microseconds after the one before, and a stream or event
// is done only once its operations are. Code that reads a copy's destination, or reuses its source, before the
// copy's event says it is done then sees stale bytes, as it could on a GPU. Unset, every call completes before it
// returns.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// Found by jnntile (dlsym): the CUDA slot of its codelets then runs the CPU kernels.
int jnntile_emulated_gpu = 1;

enum { kMaxDevices = 8 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t allocated[kMaxDevices];  // bytes of each device's memory in use
static __thread int current_device;    // cudaSetDevice's, per thread as in the CUDA runtime

static size_t total_bytes(int device) {
  const char* mb = getenv("EMULATED_GPU_MB");
  long long megabytes = 1024;
  for (int d = 0; mb != NULL && *mb != '\0' && d <= device; ++d) {
    char* end;
    const long long value = strtoll(mb, &end, 10);
    if (value > 0) megabytes = value;
    mb = *end == ',' ? end + 1 : end;
  }
  return (size_t)megabytes << 20;
}

static int device_count(void) {
  const char* count = getenv("EMULATED_GPU_COUNT");
  const long n = count != NULL ? atol(count) : 1;
  return n < 1 ? 1 : (n > kMaxDevices ? kMaxDevices : (int)n);
}

static void wait_for_every_stream(void);  // as cudaFree, cudaFreeHost and the synchronous copies do on a GPU

// Each allocation is preceded by its size and device, so that cudaFree can count it back.
enum { kHeader = 256 };  // cudaMalloc's alignment

cudaError_t cudaMalloc(void** ptr, size_t size) {
  const int device = current_device;
  pthread_mutex_lock(&lock);
  const int fits = allocated[device] + size <= total_bytes(device);
  if (fits) allocated[device] += size;
  pthread_mutex_unlock(&lock);
  *ptr = NULL;
  if (!fits) return cudaErrorMemoryAllocation;
  char* block = aligned_alloc(kHeader, kHeader + ((size + kHeader - 1) / kHeader) * kHeader);
  if (block == NULL) {
    pthread_mutex_lock(&lock);
    allocated[device] -= size;
    pthread_mutex_unlock(&lock);
    return cudaErrorMemoryAllocation;
  }
  memcpy(block, &size, sizeof size);
  memcpy(block + sizeof size, &device, sizeof device);
  *ptr = block + kHeader;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == NULL) return cudaSuccess;  // StarPU's cudaFree(0) initialises the context
  wait_for_every_stream();
  char* block = (char*)ptr - kHeader;
  size_t size;
  int device;
  memcpy(&size, block, sizeof size);
  memcpy(&device, block + sizeof size, sizeof device);
  pthread_mutex_lock(&lock);
  allocated[device] -= size;
  pthread_mutex_unlock(&lock);
  free(block);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  pthread_mutex_lock(&lock);
  *total = total_bytes(current_device);
  *free_bytes = *total - allocated[current_device];
  pthread_mutex_unlock(&lock);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "emulated GPU");
  prop->totalGlobalMem = total_bytes(device);
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

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  const char* peer_copies = getenv("EMULATED_GPU_PEER");
  *can = device != peer && peer_copies != NULL && atoi(peer_copies) == 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) { (void)peer, (void)flags; return cudaSuccess; }
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) {
  wait_for_every_stream();
  return cudaSuccess;
}
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
  wait_for_every_stream();
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

// Streams and events. A stream counts the operations queued on it and those done; an event records a stream
// and its count when recorded. Without EMULATED_GPU_ASYNC_US every operation is done when its call returns.
struct emulated_stream {
  unsigned long long queued, done;
};
struct emulated_event {
  struct emulated_stream* stream;
  unsigned long long count;
};
struct queued_op {
  struct queued_op* next;
  struct emulated_stream* stream;
  void (*run)(const void* args);
  char args[];
};
static struct emulated_stream default_stream, every_stream;  // every_stream: all operations, whatever their stream
static pthread_mutex_t queue_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t queue_changed = PTHREAD_COND_INITIALIZER;
static struct queued_op *queue_head, *queue_tail;
static pthread_once_t async_once = PTHREAD_ONCE_INIT;
static long async_delay_us = -1;  // -1: synchronous

static struct emulated_stream* stream_of(cudaStream_t stream) {
  return stream != NULL ? (struct emulated_stream*)stream : &default_stream;
}

static void* copy_thread(void* unused) {
  (void)unused;
  pthread_mutex_lock(&queue_lock);
  for (;;) {
    while (queue_head == NULL) pthread_cond_wait(&queue_changed, &queue_lock);
    struct queued_op* op = queue_head;
    pthread_mutex_unlock(&queue_lock);
    struct timespec delay = {async_delay_us / 1000000, (async_delay_us % 1000000) * 1000};
    nanosleep(&delay, NULL);
    op->run(op->args);
    pthread_mutex_lock(&queue_lock);
    queue_head = op->next;
    if (queue_head == NULL) queue_tail = NULL;
    op->stream->done++;
    every_stream.done++;
    pthread_cond_broadcast(&queue_changed);
    free(op);
  }
  return NULL;
}

static void start_async(void) {
  const char* us = getenv("EMULATED_GPU_ASYNC_US");
  if (us == NULL || *us == '\0') return;
  async_delay_us = atol(us) > 0 ? atol(us) : 0;
  pthread_t thread;
  pthread_create(&thread, NULL, copy_thread, NULL);
  pthread_detach(thread);
}

// Runs `run` on a copy of `args` now, or queues it on `stream` behind everything queued before.
static cudaError_t submit_op(cudaStream_t stream, void (*run)(const void*), const void* args, size_t size) {
  pthread_once(&async_once, start_async);
  if (async_delay_us < 0) {
    run(args);
    return cudaSuccess;
  }
  struct queued_op* op = malloc(sizeof *op + size);
  if (op == NULL) return cudaErrorMemoryAllocation;
  op->next = NULL;
  op->stream = stream_of(stream);
  op->run = run;
  memcpy(op->args, args, size);
  pthread_mutex_lock(&queue_lock);
  op->stream->queued++;
  every_stream.queued++;
  if (queue_tail != NULL) queue_tail->next = op;
  else queue_head = op;
  queue_tail = op;
  pthread_cond_broadcast(&queue_changed);
  pthread_mutex_unlock(&queue_lock);
  return cudaSuccess;
}

// Waits until `stream` has done what was queued on it before this call.
static void wait_for(struct emulated_stream* stream) {
  pthread_mutex_lock(&queue_lock);
  const unsigned long long queued = stream->queued;
  while (stream->done < queued) pthread_cond_wait(&queue_changed, &queue_lock);
  pthread_mutex_unlock(&queue_lock);
}

static void wait_for_every_stream(void) { wait_for(&every_stream); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  (void)flags;
  *stream = (cudaStream_t)calloc(1, sizeof(struct emulated_stream));
  return *stream != NULL ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  wait_for(stream_of(stream));  // a GPU finishes the stream's work first; events may still name it: kept
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  wait_for(stream_of(stream));
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  pthread_mutex_lock(&queue_lock);
  const int done = stream_of(stream)->done == stream_of(stream)->queued;
  pthread_mutex_unlock(&queue_lock);
  return done ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  (void)flags;
  *event = (cudaEvent_t)calloc(1, sizeof(struct emulated_event));
  return *event != NULL ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  free(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  struct emulated_event* e = (struct emulated_event*)event;
  pthread_mutex_lock(&queue_lock);
  e->stream = stream_of(stream);
  e->count = e->stream->queued;
  pthread_mutex_unlock(&queue_lock);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  const struct emulated_event* e = (const struct emulated_event*)event;
  pthread_mutex_lock(&queue_lock);
  const int done = e->stream == NULL || e->stream->done >= e->count;
  pthread_mutex_unlock(&queue_lock);
  return done ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  const struct emulated_event* e = (const struct emulated_event*)event;
  pthread_mutex_lock(&queue_lock);
  while (e->stream != NULL && e->stream->done < e->count) pthread_cond_wait(&queue_changed, &queue_lock);
  pthread_mutex_unlock(&queue_lock);
  return cudaSuccess;
}

// Copies and fills: the asynchronous ones go through submit_op; a synchronous one queues as the asynchronous one
// on the default stream, behind everything queued before, and returns once every stream is done (completed).
struct linear_copy {
  void* dst;
  const void* src;
  size_t count;
};
static void run_linear_copy(const void* args) {
  const struct linear_copy* c = args;
  memmove(c->dst, c->src, c->count);
}
struct pitched_copy {
  void* dst;
  size_t dpitch;
  const void* src;
  size_t spitch, width, height;
};
static void run_pitched_copy(const void* args) {
  const struct pitched_copy* c = args;
  for (size_t row = 0; row < c->height; ++row)
    memmove((char*)c->dst + row * c->dpitch, (const char*)c->src + row * c->spitch, c->width);
}
// Linear memory only (StarPU copies pitched blocks of bytes this way, never arrays).
static void run_copy_3d(const void* args) {
  const struct cudaMemcpy3DPeerParms* p = args;
  for (size_t z = 0; z < p->extent.depth; ++z)
    for (size_t y = 0; y < p->extent.height; ++y) {
      const char* src = (const char*)p->srcPtr.ptr + p->srcPos.x +
                        ((p->srcPos.z + z) * p->srcPtr.ysize + p->srcPos.y + y) * p->srcPtr.pitch;
      char* dst = (char*)p->dstPtr.ptr + p->dstPos.x +
                  ((p->dstPos.z + z) * p->dstPtr.ysize + p->dstPos.y + y) * p->dstPtr.pitch;
      memmove(dst, src, p->extent.width);
    }
}
struct pitched_fill {
  void* ptr;
  size_t pitch;
  int value;
  size_t width, height;
};
static void run_pitched_fill(const void* args) {
  const struct pitched_fill* f = args;
  for (size_t row = 0; row < f->height; ++row) memset((char*)f->ptr + row * f->pitch, f->value, f->width);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t s) {
  (void)kind;
  const struct linear_copy c = {dst, src, count};
  return submit_op(s, run_linear_copy, &c, sizeof c);
}
static cudaError_t completed(cudaError_t queued) {
  wait_for_every_stream();
  return queued;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  return completed(cudaMemcpyAsync(dst, src, count, kind, NULL));
}
cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                                cudaStream_t s) {
  (void)dst_device, (void)src_device;
  return cudaMemcpyAsync(dst, src, count, cudaMemcpyDefault, s);
}
cudaError_t cudaMemcpyPeer(void* dst, int dst_device, const void* src, int src_device, size_t count) {
  (void)dst_device, (void)src_device;
  return cudaMemcpy(dst, src, count, cudaMemcpyDefault);
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
  (void)kind;
  const struct pitched_copy c = {dst, dpitch, src, spitch, width, height};
  return submit_op(s, run_pitched_copy, &c, sizeof c);
}
cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         enum cudaMemcpyKind kind) {
  return completed(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, NULL));
}
cudaError_t cudaMemcpy3DPeerAsync(const struct cudaMemcpy3DPeerParms* p, cudaStream_t s) {
  if (p->srcArray != NULL || p->dstArray != NULL) return cudaErrorInvalidValue;
  return submit_op(s, run_copy_3d, p, sizeof *p);
}
cudaError_t cudaMemcpy3DPeer(const struct cudaMemcpy3DPeerParms* p) {
  return completed(cudaMemcpy3DPeerAsync(p, NULL));
}
cudaError_t cudaMemset2DAsync(void* ptr, size_t pitch, int value, size_t width, size_t height, cudaStream_t s) {
  const struct pitched_fill f = {ptr, pitch, value, width, height};
  return submit_op(s, run_pitched_fill, &f, sizeof f);
}
cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  return completed(cudaMemset2DAsync(ptr, count, value, count, 1, NULL));
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
