// The runtime's lifecycle: starting StarPU with a RuntimeConfig, stopping it, failing it.

// starpu_disk.h lacks the extern "C" guard the other StarPU headers have.
extern "C" {
#include <starpu_disk.h>
}
#include "runtime_state.h"

#if JNNTILE_CUDA
#include "kernels/cuda/context.h"
#endif

#include <dlfcn.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

namespace jnntile {
namespace {

// How long a stop after a watchdog failure waits for the stuck tasks to drain.
constexpr double kDrainAfterFailureS = 10.0;

// On a CPU worker: denormal results flush to zero and denormal operands read as zero, as in XLA's CPU
// runtime (under jax.jit, float32 2e-38 * 0.5 is 0), so the kernels keep JAX's own CPU arithmetic there. A
// vectorised loop also computes branches it then discards, and a denormal in one cost a microcode assist per
// element: GELU's forward divides every x by 1 + exp(88.4) for the lanes that clamp, 3.0 ns per element
// against 1.1 with the flush (one core of an AMD EPYC).
void flush_denormals(void*) {
#if defined(__SSE__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
#endif
}

// After a failed start: StarPU started through StarPU-MPI stops collectively,
// so a rank that fails alone leaves it running; its process is expected to exit.
void shutdown_after_failed_start(const RuntimeConfig& config) {
  if (config.distributed) state().distributed.abandon();
  else starpu_shutdown();
}

// config.placement as the `where` of tasks whose kernel has both versions (0: the scheduler chooses).
uint32_t where_both_versions(const RuntimeConfig& config) {
  switch (config.placement) {
    case Placement::Cpu: return STARPU_CPU;
    case Placement::Cuda: return STARPU_CUDA;
    case Placement::Any: return 0;
  }
  return 0;
}
}  // namespace

RuntimeState& state() {
  static RuntimeState* s = new RuntimeState();  // never destroyed: callbacks may outlive statics
  return *s;
}

void set_distributed_hooks(const DistributedHooks& hooks) { state().distributed = hooks; }

void runtime_start(const RuntimeConfig& config) {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.running) throw std::runtime_error("jnntile runtime is already running; call stop() first");
  if (!s.abandoned.empty())
    throw std::runtime_error("StarPU cannot start again in this process: tasks of its earlier run are stuck (" +
                             s.abandoned + "). Start a new process.");
  if (config.workers < 1)
    throw std::invalid_argument("workers must be >= 1, got " + std::to_string(config.workers));
  if (config.memory_limit_mb <= 0)
    throw std::invalid_argument("memory_limit_mb must be > 0 (StarPU's own guess is wrong on VMs)");
#if !JNNTILE_CUDA
  if (config.cuda_workers != 0 || config.placement == Placement::Cuda)
    throw std::invalid_argument(
        "CUDA workers were asked for, but this jnntile is built against a StarPU without CUDA (Debian's StarPU "
        "has none): build the CUDA version with `make cuda` and use its environment (.venv-cuda)");
#endif
  // starpu_disk_register aborts the process below its minimum size.
  if (!config.swap_dir.empty() && config.swap_size_mb * (int64_t(1) << 20) < int64_t(STARPU_DISK_SIZE_MIN))
    throw std::invalid_argument("swap_size_mb=" + std::to_string(config.swap_size_mb) + " is below StarPU's minimum of " +
                                std::to_string(int64_t(STARPU_DISK_SIZE_MIN) >> 20) + " MB");

  // StarPU reads its settings from the environment at starpu_init.
  setenv("STARPU_LIMIT_CPU_MEM", std::to_string(config.memory_limit_mb).c_str(), 1);
  if (config.gpu_memory_limit_mb > 0)
    setenv("STARPU_LIMIT_CUDA_MEM", std::to_string(config.gpu_memory_limit_mb).c_str(), 1);
  // StarPU 1.4 serves buffers of at most 4 MiB from 32 MiB chunks on the GPU, and in
  // RAM when pinned (_starpu_malloc_should_suballoc, src/datawizard/malloc.c), and
  // charges whole chunks against the limits: under a limit below 32 MB nothing could
  // be allocated, and the planner's per-tile accounting would be off. Every tile is
  // allocated on its own instead (through tile_malloc in RAM). StarPU 1.3 does not
  // read the variable; its sub-allocator serves only GPU memory and pinned RAM, which
  // Debian's build without CUDA never uses.
  setenv("STARPU_SUBALLOCATOR", "0", 1);
  // A GPU in front of RAM and disk swap: StarPU 1.4 issues a task's prefetches when dmdas queues it, long before
  // it runs, and under all three limits they hold the memory the evictions need: a 42 MB GPT-2 under GPU/RAM
  // limits of 8/8 MB (tools/emulated_gpu) stopped making progress in every run with them, and completed in every
  // run without them (with tools/starpu-patches/bounded-nested-writebacks.patch; docs/design.md, "GPU, RAM and
  // disk limits together"). Tiles are then fetched when their task starts; the user's own STARPU_PREFETCH is kept.
  static const bool user_prefetch = std::getenv("STARPU_PREFETCH") != nullptr;
  if (!user_prefetch) {
    if (config.cuda_workers != 0 && cuda_device_count() > 0 && !config.swap_dir.empty())
      setenv("STARPU_PREFETCH", "0", 1);
    else
      unsetenv("STARPU_PREFETCH");
  }
  setenv("STARPU_SILENT", "1", 0);
  setenv("STARPU_NOPENCL", "0", 0);

  use_tile_allocator(config);
  starpu_conf conf;
  starpu_conf_init(&conf);
  conf.ncpus = config.workers;
  conf.ncuda = config.cuda_workers;
  conf.sched_policy_name = config.scheduler.c_str();
  int ret = config.distributed ? s.distributed.starpu_init(&conf) : starpu_init(&conf);
  const char* ncpu_env = getenv("STARPU_NCPU");
  if (ret == -ENODEV || (ret == 0 && starpu_cpu_worker_get_count() == 0)) {
    // Host copies (reading and writing arrays) run on CPU workers only.
    if (ret == 0) shutdown_after_failed_start(config);
    throw std::runtime_error(std::string("StarPU started without CPU workers (STARPU_NCPU=") +
                             (ncpu_env ? ncpu_env : "unset") +
                             " in the environment overrides the configuration); jnntile needs at least one: "
                             "unset STARPU_NCPU");
  }
  if (ret != 0) {
    throw std::runtime_error("StarPU failed to start (starpu_init returned " + std::to_string(ret) +
                             ") with workers=" + std::to_string(config.workers) + " cuda_workers=" +
                             std::to_string(config.cuda_workers) + " scheduler='" + config.scheduler +
                             "'. The StarPU in use allows at most " + std::to_string(max_cpu_workers()) +
                             " CPU workers; check the scheduler name.");
  }
  if (config.placement == Placement::Cuda && starpu_cuda_worker_get_count() == 0) {
    shutdown_after_failed_start(config);
    throw std::runtime_error("placement='cuda' needs a CUDA worker, and StarPU found no usable GPU (" +
                             std::to_string(cuda_device_count()) + " visible to the CUDA runtime; STARPU_NCUDA=" +
                             (getenv("STARPU_NCUDA") ? getenv("STARPU_NCUDA") : "unset") + ")");
  }
  starpu_profiling_status_set(STARPU_PROFILING_ENABLE);
  starpu_execute_on_each_worker(flush_denormals, nullptr, STARPU_CPU);
#if JNNTILE_CUDA
  cuda::start_workers(config.tf32, config.fused_attention);
#endif
  pin_new_tiles(config.pin_host_memory && starpu_cuda_worker_get_count() > 0);

  if (!config.swap_dir.empty()) {
    try {
      open_swap(config);
    } catch (...) {
      shutdown_after_failed_start(config);
      close_swap();
      throw;
    }
  }
  starpu_pause();  // nothing to do yet: do not spin
  s.paused = true;
  s.running = true;
  s.stopping = false;
  s.pauser = std::thread(pauser_loop);
  s.failed = false;
  s.skip_kernels = false;
  s.failure.clear();
  s.config = config;
  s.where_both_versions = where_both_versions(config);
  s.pending = 0;
  s.submitted = 0;
  s.completed = 0;
  s.stats.clear();
  s.last_progress = Clock::now();
}

void runtime_stop(const std::function<void(bool ok)>& release_data) {
  RuntimeState& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.running) return;
  }
  if (!s.failed) wait_all("runtime stop");
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stopping = true;
  }
  s.idle.notify_all();
  s.pauser.join();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    wake_locked(s);
  }
  // StarPU's own tasks may still be in flight: a tensor freed just before the stop is unregistered
  // asynchronously (starpu_data_unregister_submit acquires it through internal tasks whose callback
  // unregisters), StarPU ends a task of ours after its callback (which is what wait_all saw), and
  // starpu_shutdown waits only for ready tasks before it stops the workers and frees every buffer. Wait for
  // them, outside the lock their callbacks may need and never longer than the watchdog, before the tiles are
  // unregistered and again after. (Rare aborts at stop with disk swap on StarPU 1.4 had these windows open:
  // in starpu_shutdown, and in unregistering a tile with a task's prefetch still counted on it, whose cause,
  // a count that arrived after its task had run, tools/starpu-patches/prefetch-count-before-the-copy.patch
  // removes.)
  auto wait_for_starpu_tasks = [&] {
    if (s.failed) return;
    auto deadline = Clock::now() + std::chrono::duration<double>(s.config.watchdog_s);
    while (starpu_task_nsubmitted() > 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (int left = starpu_task_nsubmitted(); left > 0)
      std::fprintf(stderr, "jnntile: StarPU still had %d task(s) of its own after %.0f s at stop; stopping anyway\n",
                   left, s.config.watchdog_s);
  };
  wait_for_starpu_tasks();
  // With a disk, StarPU writes dirty tiles back on its own (idle requests that
  // keep some RAM clean); paused workers leave them queued, and StarPU 1.3
  // aborts in starpu_shutdown when a request is still queued (1 run in 3 of a
  // GPT-2 with swap). Awake workers finish them while every tile is
  // unregistered synchronously.
  if (release_data) release_data(!s.failed);
  wait_for_starpu_tasks();
  // A tile the disk could not take leaves StarPU's failed request to it queued, and starpu_shutdown asserts
  // that none is (data_request.h, _starpu_data_request_prio_list_deinit): StarPU is then left as it is, as
  // after tasks that stay stuck, so that the process ends with the failure's message rather than an abort.
  const bool disk_failed = !swap_failure().empty();
  std::unique_lock<std::mutex> lock(s.mutex);
  s.running = false;
  // After a watchdog failure the stuck tasks run as no-ops once they get their
  // memory (codelet_entry), which the data just released may give them: when
  // they all finish, StarPU shuts down cleanly and can start again. Tasks that
  // stay stuck would make starpu_shutdown wait forever: StarPU is then left as
  // it is, and this process cannot start it again (runtime_start says so).
  bool drained = !s.failed;
  if (s.failed && !s.config.distributed) {
    auto deadline = Clock::now() + std::chrono::duration<double>(std::min(s.config.watchdog_s, kDrainAfterFailureS));
    drained = s.progress.wait_until(lock, deadline, [&] { return s.pending == 0; });
  }
  drained = drained && !disk_failed;
  std::string peer_failure;  // the other ranks did not come to stop with this one
  if (drained) {
#if JNNTILE_CUDA
    cuda::stop_workers();
#endif
    if (!s.config.distributed) {
      starpu_shutdown();
    } else {
      try {
        s.distributed.starpu_shutdown(s.config.watchdog_s);
      } catch (const std::exception& e) {
        peer_failure = e.what();
      }
    }
  } else {
    s.abandoned = s.failure;
    if (s.config.distributed) s.distributed.abandon();
  }
  close_swap();
  if (!peer_failure.empty()) throw std::runtime_error(peer_failure);
}

bool runtime_running() { return state().running; }

bool kernels_skipped() { return state().skip_kernels.load(std::memory_order_relaxed); }

void runtime_fail(const std::string& why) {
  RuntimeState& s = state();
  if (!s.running) return;  // stopped, or stopping: runtime_stop holds the mutex while it meets the other ranks
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.failed) return;
  s.failed = true;
  s.skip_kernels = true;
  s.failure = why;
}

int max_cpu_workers() { return STARPU_MAXCPUS; }

bool emulated_gpu() {
  static const bool preloaded = dlsym(RTLD_DEFAULT, "jnntile_emulated_gpu") != nullptr;
  return preloaded;
}

// A task holds every buffer it has fetched until it ends. Under a limit that swaps, tasks of small tiles
// grouped to small_tile_numel() elements each could fill it before any of them had all its buffers: two AdamW
// tasks of 45 and 49 buffers filled a 1 MB limit with disk swap one buffer short each, both waiting for the
// other (StarPU 1.4's CPU workers, 1 run in 8 of tests/test_grad_accumulation.py; no task completed again).
// The tasks that run at once: one per CPU worker, cuda_pipeline_depth() per CUDA worker.
int64_t task_group_bytes_limit() {
  const RuntimeConfig& config = state().config;
  const int64_t cuda_tasks = int64_t(starpu_cuda_worker_get_count()) * cuda_pipeline_depth();
  const int64_t running = int64_t(starpu_cpu_worker_get_count()) + cuda_tasks;
  int64_t limit = (config.memory_limit_mb << 20) / (2 * std::max<int64_t>(1, running));
  if (config.gpu_memory_limit_mb > 0 && cuda_tasks > 0)
    limit = std::min(limit, (config.gpu_memory_limit_mb << 20) / (2 * cuda_tasks));
  return limit;
}

int64_t cuda_pipeline_depth() {
  const char* pipeline_env = std::getenv("STARPU_CUDA_PIPELINE");
  return std::max<int64_t>(1, pipeline_env ? std::atoll(pipeline_env) : 2);
}

int cuda_device_count() {
#if JNNTILE_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

int64_t cuda_device_free_bytes(int devices) {
#if JNNTILE_CUDA
  return cuda::device_free_bytes(devices);
#else
  return 0;
#endif
}
const RuntimeConfig& runtime_config() { return state().config; }

void require_runtime() {
  RuntimeState& s = state();
  if (!s.running)
    throw std::runtime_error("jnntile runtime is not running: call jnntile.runtime.start()");
  if (s.failed) throw std::runtime_error("jnntile runtime failed earlier: " + s.failure);
}

}  // namespace jnntile
