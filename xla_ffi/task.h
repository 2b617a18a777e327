// What every op file needs: building StarPU tasks, declaring codelets, and
// exposing a submit function as an XLA FFI target.
#pragma once

#include <starpu.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/device.h"
#include "runtime.h"
#include "sharding.h"
#include "tensor.h"
#include "xla/ffi/api/ffi.h"

namespace jnntile {

namespace ffi = xla::ffi;

struct Buffer {
  starpu_data_handle_t handle;
  starpu_data_access_mode mode;
};

// The element type of a floating tensor (float32 or bfloat16); throws naming the op and the tensor otherwise.
inline FloatType float_type(const TiledTensor& t, const char* op) {
  if (t.dtype == DType::F32) return FloatType::F32;
  if (t.dtype == DType::BF16) return FloatType::BF16;
  throw std::invalid_argument(std::string(op) + " needs float32 or bfloat16: " + t.describe());
}

template <class T>
T* tile_ptr(void* buffer) {
  return reinterpret_cast<T*>(STARPU_VECTOR_GET_PTR(buffer));
}

// ---- codelets ---------------------------------------------------------------
//
// A kernel adaptor `void kernel(void** buffers, const Args& args)` unpacks the
// task's tiles and calls a kernel entry point (kernels/<family>.h). Adaptors of
// kernels that exist for both devices are templates over Device; declare their
// codelet with JNNTILE_CODELET, which adds the CUDA instance where StarPU has
// CUDA. CUDA instances launch asynchronously on StarPU's stream of the worker.

template <class Args, void (*Kernel)(void** buffers, const Args& args)>
void codelet_entry(void* buffers[], void* cl_arg) {
  if (kernels_skipped()) return;
  Kernel(buffers, *static_cast<const Args*>(cl_arg));
}

using KernelEntry = void (*)(void* buffers[], void* cl_arg);

// A codelet with a history-based performance model named after it: the
// model-based schedulers (dmda family, used when a GPU is present) learn from
// it which worker runs a kernel fastest; the others never consult it.
starpu_codelet make_codelet(const char* name, KernelEntry cpu, KernelEntry cuda);

// Declares a codelet once: `static starpu_codelet* cl = codelet<Args, kernel>("name");`
// (CPU only), or `codelet<Args, cpu_kernel, cuda_kernel>("name")`.
template <class Args, void (*CpuKernel)(void**, const Args&), void (*CudaKernel)(void**, const Args&) = nullptr>
starpu_codelet* codelet(const char* name) {
  KernelEntry cuda = nullptr;
  if constexpr (CudaKernel != nullptr) cuda = codelet_entry<Args, CudaKernel>;
  static starpu_codelet cl = make_codelet(name, codelet_entry<Args, CpuKernel>, cuda);
  return &cl;
}

#if JNNTILE_CUDA
#define JNNTILE_CODELET(Args, kernel, name) \
  (::jnntile::codelet<Args, kernel<::jnntile::Device::Cpu>, kernel<::jnntile::Device::Cuda>>(name))
#else
#define JNNTILE_CODELET(Args, kernel, name) (::jnntile::codelet<Args, kernel<::jnntile::Device::Cpu>>(name))
#endif

// A temporary vector of n elements with no home: StarPU allocates it where a
// task first writes it, or, accessed as STARPU_SCRATCH, on the memory node of
// each task (a kernel's working memory, on the GPU too). Unregister it with
// starpu_data_unregister_submit after its last task.
inline starpu_data_handle_t temporary_vector(int64_t n, size_t elem_size) {
  starpu_data_handle_t handle;
  const int64_t count = n > 0 ? n : 1;
  starpu_vector_data_register(&handle, -1, 0, count, elem_size);
  // Direct-I/O swap moves whole pages: tensor tiles are padded to them, a
  // temporary of another size stays off disks (StarPU would abort writing it;
  // tools/starpu-patches/temporaries-stay-off-disk.patch makes GPU evictions honour this too).
  if ((count * elem_size) % swap_io_alignment() != 0) starpu_data_set_ooc_flag(handle, 0);
  return handle;
}

// Builds and submits the task, past the tiles' bookkeeping: `submit_task` below for every op's tasks;
// alone only for tasks that move or order a tile's values without changing them (sharding.cc).
template <class Args>
void submit_task_unchecked(starpu_codelet* cl, const std::vector<Buffer>& buffers, const Args& args,
                           double flops = 0.0, TaskGroup* group = nullptr) {
  starpu_task* task = starpu_task_create();
  task->cl = cl;
  task->nbuffers = int(buffers.size());
  starpu_data_handle_t* handles = task->handles;
  starpu_data_access_mode* modes = task->modes;
  if (buffers.size() > STARPU_NMAXBUFS) {
    // StarPU frees dyn_handles/dyn_modes with the task.
    task->dyn_handles = static_cast<starpu_data_handle_t*>(malloc(buffers.size() * sizeof(*handles)));
    task->dyn_modes = static_cast<starpu_data_access_mode*>(malloc(buffers.size() * sizeof(*modes)));
    handles = task->dyn_handles;
    modes = task->dyn_modes;
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    handles[i] = buffers[i].handle;
    // Scratch buffers are temporary_vector handles of one task each: write-only
    // access gives the task the same fresh buffer on its node. StarPU 1.3's
    // eviction of STARPU_SCRATCH chunks races with their unregistration and
    // aborts (memalloc.c: try_to_throw_mem_chunk, "mc->replicate") under a memory limit.
    modes[i] = buffers[i].mode == STARPU_SCRATCH ? STARPU_W : buffers[i].mode;
  }
  void* arg = malloc(sizeof(Args));
  std::memcpy(arg, &args, sizeof(Args));
  task->cl_arg = arg;
  task->cl_arg_size = sizeof(Args);
  task->cl_arg_free = 1;
  task->flops = flops;
  submit(task, group);
}

template <class Args>
void submit_task(starpu_codelet* cl, const std::vector<Buffer>& buffers, const Args& args,
                 double flops = 0.0, TaskGroup* group = nullptr) {
  // With sharded state, a task that writes another rank's shard runs there: this rank only counts its writes.
  const bool runs_here = !sharding_in_use() || shard_admit(buffers);
  // Before anything is submitted: a read of a tile that holds nothing is an error.
  for (const Buffer& b : buffers)
    if (runs_here && (b.mode & STARPU_R)) check_readable(b.handle);
  for (const Buffer& b : buffers) {
    if (!(b.mode & STARPU_R)) mark_written(b.handle);
    if (b.mode & STARPU_W) count_write(b.handle);
  }
  if (runs_here) submit_task_unchecked(cl, buffers, args, flops, group);
}

// ---- small tiles, several to a task ------------------------------------------
//
// Each task costs StarPU's bookkeeping (tens of microseconds, and on a CUDA worker a launch on its stream),
// more than the work of a tile of a few thousand elements: a bias, a norm's scale. Ops that touch each tile
// on its own (optimizer updates, partial sums of squares) take such tiles several to a task, each tile's
// arithmetic unchanged (the same bits). On CPU workers a tile is small under 32768 elements (a few
// microseconds of work); when the GPU runs these tasks (placement cuda) under 4M: an AdamW step on a tile of
// 4M float32 elements moves about 120 MB, some 40 us of an H100's memory bandwidth, while on an H200 a task
// cost the CUDA worker about 36 us (GPT-2 124M's step: 40 ms of GPU idle time over 1,114 tasks).
constexpr int kTilesPerTask = 16;
constexpr int64_t kSmallTileNumel = int64_t(1) << 15;
constexpr int64_t kGpuSmallTileNumel = int64_t(1) << 22;
inline int64_t small_tile_numel() {
  return kernels_run_on_gpu() ? kGpuSmallTileNumel : kSmallTileNumel;
}

// The tiles one task takes: how many, and each one's elements.
struct TaskTiles {
  int count = 0;
  int64_t numel[kTilesPerTask];

  int64_t total() const {
    int64_t sum = 0;
    for (int i = 0; i < count; ++i) sum += numel[i];
    return sum;
  }
};

// Cuts tiles 0..numel.size()-1 (their sizes in elements) into tasks, in order: a tile of small_numel_limit
// elements or more alone, smaller ones together, up to kTilesPerTask of them, small_numel_limit elements and
// bytes_limit bytes (bytes[i]: what the task holds for tile i, all its buffers), and of one owner (owners[i],
// when given: with sharded state a task runs on the owner of what it writes). By default the limits of
// small tiles (small_tile_numel) and of the bytes a task may hold (task_group_bytes_limit).
inline std::vector<std::vector<size_t>> tile_groups(const std::vector<int64_t>& numel,
                                                    const std::vector<int64_t>& bytes,
                                                    int64_t small_numel_limit = small_tile_numel(),
                                                    int64_t bytes_limit = task_group_bytes_limit(),
                                                    const std::vector<int>& owners = {}) {
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> small;
  int64_t small_numel = 0, small_bytes = 0;
  for (size_t i = 0; i < numel.size(); ++i) {
    if (numel[i] >= small_numel_limit) {
      groups.push_back({i});
      continue;
    }
    const bool other_owner = !owners.empty() && !small.empty() && owners[i] != owners[small.front()];
    if (!small.empty() && (small.size() == size_t(kTilesPerTask) || small_numel + numel[i] > small_numel_limit ||
                           small_bytes + bytes[i] > bytes_limit || other_owner)) {
      groups.push_back(std::move(small));
      small.clear();
      small_numel = small_bytes = 0;
    }
    small.push_back(i);
    small_numel += numel[i];
    small_bytes += bytes[i];
  }
  if (!small.empty()) groups.push_back(std::move(small));
  return groups;
}

// ---- attributes -----------------------------------------------------------

template <class T>
T attr(const ffi::Dictionary& attrs, const char* name) {
  auto value = attrs.get<T>(name);
  if (value.has_error()) throw std::invalid_argument(std::string("missing or mistyped attribute '") + name + "'");
  return value.value();
}

inline Index attr_index(const ffi::Dictionary& attrs, const char* name) {
  auto value = attrs.get<ffi::Span<const int64_t>>(name);
  if (value.has_error()) throw std::invalid_argument(std::string("missing or mistyped attribute '") + name + "'");
  return Index(value.value().begin(), value.value().end());
}

// ---- FFI targets ----------------------------------------------------------

// An op's FFI target takes an int32 buffer of tensor ids (ids travel as data,
// not attributes, so one compiled call serves every tensor), then the tokens of
// the tensors it touches (only to order the call), and returns a fresh token.
// Parameters that select code (transposes, alpha) are attributes. The target
// submits tasks and returns without waiting.
struct OpCall {
  std::vector<int64_t> ids;
  const ffi::Dictionary& attrs;
  // Extra array operands (per-step values such as a learning rate or a seed:
  // DESIGN invariant 4); they come before the tokens.
  std::vector<ffi::AnyBuffer> inputs;
  // The first element of extra input `i`, converted to double.
  double input_scalar(size_t i) const;
  TiledTensor& tensor(size_t i) const {
    if (i >= ids.size()) throw std::invalid_argument("op got " + std::to_string(ids.size()) + " tensor ids, needs more");
    return tensor_get(ids[i]);
  }
};
using OpSubmit = void (*)(const OpCall& call);

// Zeroes the gradient companions of `ids` with write-only tasks.
void zero_grads(const std::vector<int64_t>& ids);

// The last `zero_grads` attribute entries of the id buffer name tensors whose
// gradients start at zero here: the forward call that creates an activation
// also clears its gradient, so every backward call may accumulate into it.
inline ffi::Error run_op(OpSubmit submit_fn, ffi::Buffer<ffi::S32> id_buffer, const ffi::RemainingArgs& args,
                         ffi::Result<ffi::BufferR0<ffi::F32>> token, const ffi::Dictionary& attrs) {
  try {
    require_runtime();
    std::vector<int64_t> ids(id_buffer.typed_data(), id_buffer.typed_data() + id_buffer.element_count());
    auto n_zero = attrs.get<int64_t>("zero_grads");
    size_t n_zero_grads = n_zero.has_error() ? 0 : size_t(n_zero.value());
    if (n_zero_grads > ids.size()) throw std::invalid_argument("zero_grads exceeds the id count");
    std::vector<int64_t> grad_ids(ids.end() - n_zero_grads, ids.end());
    ids.resize(ids.size() - n_zero_grads);
    auto n_inputs = attrs.get<int64_t>("n_inputs");
    std::vector<ffi::AnyBuffer> inputs;
    for (int64_t i = 0; i < (n_inputs.has_error() ? 0 : n_inputs.value()); ++i) {
      auto buffer = args.get<ffi::AnyBuffer>(size_t(i));
      if (buffer.has_error()) throw std::invalid_argument("missing extra input " + std::to_string(i));
      inputs.push_back(buffer.value());
    }
    ShardedOp op;
    submit_fn(OpCall{std::move(ids), attrs, std::move(inputs)});
    zero_grads(grad_ids);
  } catch (const std::exception& e) {
    return ffi::Error::InvalidArgument(e.what());
  }
  token->typed_data()[0] = 0.0f;
  return ffi::Error::Success();
}

std::vector<std::pair<std::string, void*>>& ffi_targets();

struct RegisterTarget {
  RegisterTarget(const char* name, void* handler) { ffi_targets().emplace_back(name, handler); }
};

#define JNNTILE_CONCAT_(a, b) a##b
#define JNNTILE_CONCAT(a, b) JNNTILE_CONCAT_(a, b)

// Declares the FFI target `jnntile_<name>` that calls `submit_fn(call)`.
#define JNNTILE_OP(name, submit_fn)                                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                               \
      JNNTILE_CONCAT(ffi_handler_, name),                                                      \
      [](ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs args,                                   \
         ffi::Result<ffi::BufferR0<ffi::F32>> token, ffi::Dictionary attrs) {                  \
        return ::jnntile::run_op(submit_fn, ids, args, token, attrs);                          \
      },                                                                                       \
      ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().Ret<ffi::BufferR0<ffi::F32>>().Attrs()); \
  static ::jnntile::RegisterTarget JNNTILE_CONCAT(register_, name)(                            \
      "jnntile_" #name, reinterpret_cast<void*>(JNNTILE_CONCAT(ffi_handler_, name)))

// ---- tile geometry ----------------------------------------------------------

void check_same_tiling(const TiledTensor& a, const TiledTensor& b, const char* op);

}  // namespace jnntile
