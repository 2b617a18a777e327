// StarPU lifetime, task accounting, idle pausing, watchdog and statistics (runtime_state.h says which file
// holds which).
//
// Every task jnntile submits goes through `submit()`, which keeps a count of
// pending work. Debian's StarPU busy-waits when idle (DESIGN invariant 5), so
// the workers are paused whenever that count drops to zero and resumed on the
// next submission. Blocking waits never hang: they fail when no task has
// completed for `watchdog_s` seconds (DESIGN invariant 6).
#pragma once

#include <starpu.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace jnntile {

// Where tasks of kernels that exist for both devices may run: Any, wherever the
// scheduler chooses; Cpu or Cuda, only there. (jnntile.runtime resolves its
// "auto" into one of these: it knows whether the user limited GPU memory.)
enum class Placement { Any = 0, Cpu = 1, Cuda = 2 };

// StarPU's disk backends for swap: through the page cache, or direct I/O
// (O_DIRECT: no second copy of the swap in the page cache, but every read and
// write must be page-aligned and a whole number of pages).
enum class SwapBackend { Unistd = 0, UnistdODirect = 1 };

// How StarPU runs. The defaults are jnntile.runtime.RuntimeConfig's (Python), the one
// place they are written: Python fills every field of this struct (bound in module.cc).
struct RuntimeConfig {
  int workers{};                 // CPU workers
  int cuda_workers{};            // -1: one per GPU StarPU finds
  std::string scheduler;
  int64_t memory_limit_mb{};     // must be > 0 (StarPU's own guess of RAM is wrong on VMs)
  int64_t gpu_memory_limit_mb{}; // per GPU; 0: StarPU's default (nearly all of it)
  std::string swap_dir;          // empty: no disk swap
  int64_t swap_size_mb{};
  SwapBackend swap_backend{};
  double watchdog_s{};
  Placement placement{};
  bool tf32{};                   // cuBLAS may use TF32 tensor cores for float32 products
  bool fused_attention{};        // bfloat16 attention steps on the GPU run fused (kernels/cuda/attention.cu)
  bool pin_host_memory{};        // page-lock RAM tiles so GPU transfers are asynchronous
  bool distributed{};            // one of several MPI ranks: StarPU through StarPU-MPI (distributed.h)
  bool shard_keep_fetched{};     // sharded state: fetched parameter tiles kept until written (sharding.h)
};

// The most CPU workers the StarPU in use accepts (its STARPU_MAXCPUS).
int max_cpu_workers();
// What the swap backend in use needs of every buffer that may go to disk: its
// address and size a multiple of this many bytes (the page size with direct
// I/O, else 1). Tile registration pads tiles to it; RAM allocations are aligned to it.
size_t swap_io_alignment();
// The most bytes of buffers a task of small tiles may hold (tile_groups in task.h): the tasks running at once
// must fit in each limited memory together, with as much again free.
int64_t task_group_bytes_limit();
// Tasks a CUDA worker keeps in its stream at once: StarPU's STARPU_CUDA_PIPELINE (2 by default; 0, one task
// at a time, counts as 1). jnntile.runtime.gpu_tasks_in_flight reads it from here for the planner.
int64_t cuda_pipeline_depth();
// GPUs the CUDA runtime sees; 0 when StarPU has no CUDA or there is no driver.
int cuda_device_count();
// Memory free on the fullest of the first `devices` GPUs (all where negative): cuda::device_free_bytes.
int64_t cuda_device_free_bytes(int devices);

// A set of tasks a caller waits for. Heap-allocated and shared with the task
// callbacks; a waiter that gives up (watchdog) leaks it on purpose, because the
// stuck tasks may still complete and touch it.
struct TaskGroup {
  std::atomic<int64_t> remaining{0};
};

struct WorkerStats {
  int id;
  std::string name;
  double busy_s;
  int64_t tasks;
};

struct NodeStats {
  int node;
  std::string kind;
  int64_t used_bytes;
  int64_t total_bytes;
  int64_t peak_used_bytes;  // highest used_bytes seen at a task completion since start or reset_peaks
};

// Tasks of one codelet since start: how many and how long they ran.
struct CodeletStats {
  int64_t tasks = 0;
  double seconds = 0.0;
  int64_t cuda_tasks = 0;  // of those, run on CUDA workers
  double cuda_seconds = 0.0;
};

struct RuntimeStats {
  int64_t tasks_submitted;
  int64_t tasks_completed;
  int64_t tasks_pending;
  std::map<std::string, CodeletStats> codelets;
  // Median duration of the tasks run since start, from a histogram with 8
  // buckets per power of two (within 9%).
  double median_task_s;
  std::vector<WorkerStats> workers;
  std::vector<NodeStats> nodes;
  // bytes moved, keyed by "src->dst" memory-node kinds, e.g. "RAM->DISK"
  std::map<std::string, int64_t> bytes_moved;
};

// How StarPU starts and stops on one of several MPI ranks (config.distributed): through StarPU-MPI, which
// distributed.cc provides and sets here at import (install_distributed_hooks), the layer above the runtime.
struct DistributedHooks {
  int (*starpu_init)(starpu_conf* conf);
  // Meets the other ranks, then shuts StarPU down; throws naming the ranks that did not come.
  void (*starpu_shutdown)(double timeout_s);
  // After a failure: leaves StarPU-MPI as it is; the process is expected to exit.
  void (*abandon)();
  // For the watchdog's message: which ranks' tiles this one waits for ("" when none).
  std::string (*stall)();
};
void set_distributed_hooks(const DistributedHooks& hooks);

void runtime_start(const RuntimeConfig& config);
// Waits for pending tasks, then runs `release_data(ok)` with the workers awake
// (ok: no watchdog failure, tasks all done), then shuts StarPU down.
void runtime_stop(const std::function<void(bool ok)>& release_data = {});
bool runtime_running();
// Why disk swap could not take a tile since the runtime last started ("" if it always could); the runtime is then
// failed (runtime_fail) with this message.
std::string swap_failure();
// Marks the runtime failed (as the watchdog does): waits and stops no longer
// wait for tasks, which will never complete (e.g. another rank is gone).
void runtime_fail(const std::string& why);
// True after a failure: tasks still queued complete without running their
// kernels, so that a stop can drain them (their host buffers may be gone).
bool kernels_skipped();
const RuntimeConfig& runtime_config();
// Whether the process runs on tools/emulated_gpu (preloaded in place of the CUDA runtime, on a machine without
// a GPU): its CUDA workers then run the CPU kernels, on "device" memory that is host memory.
bool emulated_gpu();
// Whether every kernel with a CUDA version runs on CUDA workers (placement cuda): a GPU task may take more of
// the work than a CPU one, and (on a real GPU) its tasks need no working memory that only a CPU kernel uses.
inline bool kernels_run_on_gpu() { return runtime_config().placement == Placement::Cuda; }
// Throws std::runtime_error naming the problem when the runtime is not usable.
void require_runtime();

// Submits `task`, counting it as pending work; `group` may be null.
void submit(starpu_task* task, TaskGroup* group = nullptr);
// Brackets work that needs the workers awake but is not a task (data acquire).
void begin_pending();
void end_pending();
// Blocks until every task of `group` completed; deletes the group. Throws
// std::runtime_error when no task anywhere completed for watchdog_s.
void wait(TaskGroup* group, const char* what);
// Blocks until nothing is pending.
void wait_all(const char* what);
// Tasks submitted since the runtime started; blocks until that many completed (in any order: a count, not
// particular tasks), with the watchdog of `wait`.
int64_t tasks_submitted();
void wait_completed(int64_t count, const char* what);

RuntimeStats runtime_stats();
// Starts the peak memory use of every node over from its current use.
void reset_peaks();

}  // namespace jnntile
