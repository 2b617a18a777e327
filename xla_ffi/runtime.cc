// starpu_disk.h lacks the extern "C" guard the other StarPU headers have.
extern "C" {
#include <starpu_disk.h>
}
#include "runtime.h"

#include "distributed.h"
#include "task.h"
#include "tensor.h"

#if JNNTILE_CUDA
#include "kernels/cuda/context.h"
#endif

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <unordered_map>

namespace jnntile {
namespace {

using Clock = std::chrono::steady_clock;

// Workers keep spinning this long after the last task before they are paused:
// a blocking read followed by the next submission then costs no wake-up.
constexpr auto kPauseGrace = std::chrono::milliseconds(2);
// How long a stop after a watchdog failure waits for the stuck tasks to drain.
constexpr double kDrainAfterFailureS = 10.0;

struct RuntimeState {
  std::mutex mutex;
  std::condition_variable progress;  // signalled when a group finishes or nothing is pending
  std::condition_variable idle;      // wakes the pauser thread
  std::thread pauser;
  bool stopping = false;
  bool running = false;
  bool paused = false;
  bool failed = false;  // a watchdog fired: tasks are stuck, refuse new work
  std::atomic<bool> skip_kernels{false};  // = failed, read by every task without the mutex
  std::string failure;
  // Set when a failed runtime stops: its stuck tasks still hold StarPU, which can
  // neither shut down nor start afresh in this process (a second starpu_init
  // only counts a reference and keeps the old instance with its settings).
  std::string abandoned;
  RuntimeConfig config;
  // Where tasks of kernels with a CPU and a CUDA version run: STARPU_CPU, STARPU_CUDA, or 0 for wherever the
  // scheduler chooses (config.placement, resolved at start).
  uint32_t where_both_versions = 0;
  std::string swap_subdir;  // created by us, removed at stop
  int64_t pending = 0;
  int64_t submitted = 0;
  std::atomic<int64_t> completed{0};
  Clock::time_point last_progress = Clock::now();
  std::map<std::string, int64_t> bytes_moved;
  std::vector<double> worker_busy_s;
  std::vector<int64_t> worker_tasks;
  // Per codelet name (codelets live as long as the process, so their names do).
  std::map<const char*, CodeletStats> codelets;
  // Task durations: bucket b counts durations in [2^(b/8), 2^((b+1)/8)) microseconds.
  static constexpr int kDurationBuckets = 8 * 32;
  int64_t duration_histogram[kDurationBuckets] = {};
  // Peak bytes used per memory node, sampled at every task completion (a
  // task's buffers are all allocated while it runs, so this sees the peaks).
  static constexpr int kMaxNodes = 8;
  std::atomic<int64_t> peak_used[kMaxNodes];
};

RuntimeState& state() {
  static RuntimeState* s = new RuntimeState();  // never destroyed: callbacks may outlive statics
  return *s;
}

// Callers hold state().mutex.
void wake_locked(RuntimeState& s) {
  if (s.paused) {
    starpu_resume();
    s.paused = false;
  }
}

void finish_one_locked(RuntimeState& s) {
  s.pending -= 1;
  s.last_progress = Clock::now();
  if (s.pending == 0) s.idle.notify_all();
}

// Pauses the workers once nothing has been pending for kPauseGrace.
void pauser_loop() {
  RuntimeState& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  while (!s.stopping) {
    s.idle.wait(lock, [&] { return s.stopping || (s.pending == 0 && !s.paused); });
    if (s.stopping) break;
    bool busy_again = s.idle.wait_for(lock, kPauseGrace, [&] { return s.stopping || s.pending > 0; });
    if (!busy_again && s.pending == 0 && !s.paused) {
      starpu_pause();
      s.paused = true;
    }
  }
}

int64_t node_used(unsigned node) {
  int64_t total = starpu_memory_get_total(node);
  return total >= 0 ? total - starpu_memory_get_available(node) : -1;
}

void sample_peaks(RuntimeState& s) {
  unsigned nnodes = std::min<unsigned>(starpu_memory_nodes_get_count(), RuntimeState::kMaxNodes);
  for (unsigned node = 0; node < nnodes; ++node) {
    int64_t used = node_used(node);
    int64_t peak = s.peak_used[node].load(std::memory_order_relaxed);
    while (used > peak && !s.peak_used[node].compare_exchange_weak(peak, used)) {
    }
  }
}

// Records how long the finished `task` ran (profiling is on), by codelet.
void record_duration_locked(RuntimeState& s, const starpu_task* task) {
  if (task == nullptr || task->cl == nullptr || task->profiling_info == nullptr) return;
  double seconds = starpu_timing_timespec_delay_us(&task->profiling_info->start_time,
                                                   &task->profiling_info->end_time) * 1e-6;
  CodeletStats& c = s.codelets[task->cl->name];
  c.tasks += 1;
  c.seconds += seconds;
  if (starpu_worker_get_type(task->profiling_info->workerid) == STARPU_CUDA_WORKER) {
    c.cuda_tasks += 1;
    c.cuda_seconds += seconds;
  }
  int bucket = seconds > 1e-6 ? int(8.0 * std::log2(seconds * 1e6)) : 0;
  s.duration_histogram[std::clamp(bucket, 0, RuntimeState::kDurationBuckets - 1)] += 1;
}

// Waiters wait for a group to finish or for nothing to be pending (and wake every 50 ms for the watchdog), so
// only those completions wake them: a wake at every completion cost the worker that ran the task (the GPU's,
// between its launches) a futex call, and the waiting thread a round on the mutex, per task.
void on_task_done(void* arg) {
  RuntimeState& s = state();
  sample_peaks(s);
  s.completed.fetch_add(1, std::memory_order_relaxed);
  bool wake = arg != nullptr && static_cast<TaskGroup*>(arg)->remaining.fetch_sub(1) == 1;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    // In a callback, StarPU's current task is the one that finished.
    record_duration_locked(s, starpu_task_get_current());
    finish_one_locked(s);
    wake = wake || s.pending == 0;
  }
  if (wake) s.progress.notify_all();
}

std::string node_kind_name(int node) {
  switch (starpu_node_get_kind(node)) {
    case STARPU_CPU_RAM: return "RAM";
    case STARPU_CUDA_RAM: return "CUDA";
    case STARPU_DISK_RAM: return "DISK";
    default: return "OTHER";
  }
}

void remove_tree(const std::string& path) {
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    std::string child = path + "/" + name;
    struct stat st;
    if (lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_tree(child);
    else unlink(child.c_str());
  }
  closedir(dir);
  rmdir(path.c_str());
}

// Swap subdirectories are named jnntile-swap-<pid>-XXXXXX (jnntile.runtime removes those of dead processes).
constexpr const char* kSwapPrefix = "jnntile-swap-";

// The disk swap's space is reserved when the runtime starts: a file of swap_size_mb in the swap subdirectory
// (kSwapReserve), which gives each tile file StarPU creates its blocks (alloc) and takes them back (free). StarPU's
// unistd backends create sparse files and write them asynchronously; a write that met a full disk (another
// process filled it) ended in StarPU's assertion on aio_error 28 and SIGABRT. Blocks allocated up front cannot run
// out: a tile file gets all its blocks when it is created, or the allocation fails here, where the runtime is
// marked failed with a message (waits then raise it) instead of aborting.
constexpr const char* kSwapReserve = "reserve";

// StarPU's unistd backends' object (src/core/disk_ops/unistd/disk_unistd_global.h, the same in StarPU 1.3.10 and
// 1.4): the file of one allocation, open (descriptor) or closed (-1) when too many are.
struct UnistdFile {
  int descriptor;
  char* path;
};

struct SwapSpace {
  std::mutex mutex;
  starpu_disk_ops ops;           // StarPU's backend with alloc and free wrapped; lives as long as the process
  const starpu_disk_ops* inner;  // StarPU's backend
  std::string dir;               // the swap subdirectory
  int reserve_fd = -1;
  int64_t reserved = 0;  // bytes the reserve file holds
  std::string failure;   // why a tile could not be allocated (swap_failure)
};

SwapSpace& swap_space() {
  static SwapSpace* s = new SwapSpace();
  return *s;
}

// The blocks a file of `size` bytes takes.
int64_t blocks_bytes(size_t size) {
  constexpr int64_t kBlock = 4096;
  return (int64_t(size) + kBlock - 1) / kBlock * kBlock;
}

int64_t free_bytes(const std::string& path) {
  struct statvfs fs;
  return statvfs(path.c_str(), &fs) == 0 ? int64_t(fs.f_bavail) * int64_t(fs.f_frsize) : -1;
}

// Callers hold swap_space().mutex. Moves `bytes` between the reserve file and the disk's free space.
void resize_reserve_locked(SwapSpace& sw, int64_t bytes) {
  int64_t target = std::max<int64_t>(0, sw.reserved + bytes);
  if (target < sw.reserved) {
    if (ftruncate(sw.reserve_fd, target) == 0) sw.reserved = target;
  } else if (target > sw.reserved && posix_fallocate(sw.reserve_fd, 0, target) == 0) {
    sw.reserved = target;  // else the reserve stays smaller: a later tile file takes its blocks from the disk
  }
}

void* swap_alloc(void* base, size_t size) {
  SwapSpace& sw = swap_space();
  const int64_t need = blocks_bytes(size);
  {
    std::lock_guard<std::mutex> lock(sw.mutex);
    resize_reserve_locked(sw, -need);
  }
  void* obj = sw.inner->alloc(base, size);
  int error = obj == nullptr ? errno : 0;
  if (obj != nullptr) {
    auto* file = static_cast<UnistdFile*>(obj);
    int fd = file->descriptor >= 0 ? file->descriptor : open(file->path, O_WRONLY);
    error = fd < 0 ? errno : posix_fallocate(fd, 0, off_t(size));
    if (fd >= 0 && file->descriptor < 0) close(fd);
    if (error != 0) {
      sw.inner->free(base, obj, size);
      obj = nullptr;
    }
  }
  if (obj != nullptr) return obj;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(sw.mutex);
    resize_reserve_locked(sw, need);
    if (sw.failure.empty()) {
      int64_t available = std::max<int64_t>(free_bytes(sw.dir), 0);
      sw.failure = "disk swap in " + sw.dir + " could not take a tile of " + std::to_string(size) + " bytes (" +
                   std::strerror(error ? error : EIO) + "; " + std::to_string(available) +
                   " bytes free there): another process took the disk space reserved for swap when the run started. "
                   "Free space there, or choose another --swap-dir (swap_dir)";
    }
    failure = sw.failure;
  }
  runtime_fail(failure);  // outside the swap's lock: runtime_stop holds the runtime's while StarPU frees tiles
  return nullptr;
}

void swap_free(void* base, void* obj, size_t size) {
  SwapSpace& sw = swap_space();
  sw.inner->free(base, obj, size);
  std::lock_guard<std::mutex> lock(sw.mutex);
  resize_reserve_locked(sw, blocks_bytes(size));
}

// Reserves `bytes` in `dir` for swap; returns StarPU's backend `inner` with its allocations drawn from the
// reserve, or nullptr (errno set) when the disk cannot hold them.
starpu_disk_ops* reserve_swap(const std::string& dir, int64_t bytes, const starpu_disk_ops* inner) {
  SwapSpace& sw = swap_space();
  std::lock_guard<std::mutex> lock(sw.mutex);
  if (sw.reserve_fd >= 0) close(sw.reserve_fd);
  sw.dir = dir;
  sw.reserved = 0;
  sw.failure.clear();
  sw.reserve_fd = open((dir + "/" + kSwapReserve).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (sw.reserve_fd < 0) return nullptr;
  if (int error = posix_fallocate(sw.reserve_fd, 0, bytes); error != 0) {
    errno = error;
    return nullptr;
  }
  sw.reserved = bytes;
  sw.inner = inner;
  sw.ops = *inner;
  sw.ops.alloc = swap_alloc;
  sw.ops.free = swap_free;
  return &sw.ops;
}

void release_swap() {
  SwapSpace& sw = swap_space();
  std::lock_guard<std::mutex> lock(sw.mutex);
  if (sw.reserve_fd >= 0) close(sw.reserve_fd);
  sw.reserve_fd = -1;
  sw.reserved = 0;
}

// Tile memory comes straight from mmap and goes back to the system on free.
// With malloc, freed tiles stayed in glibc's arenas (one per thread, with a
// free threshold that grows with the largest chunk freed), so the process held
// hundreds of MB more than the memory limit: a 1.6 GB limit peaked at 2.3 GB
// of RSS, 2.0 GB with this. Small allocations keep using malloc. A pointer
// registry, not the size StarPU passes to free (starpu_free passes 0), tells
// which is which.
constexpr size_t kMmapThreshold = size_t(64) << 10;

// Page-locked tiles (runtime_config().pin_host_memory with a CUDA worker):
// StarPU's copies to and from the GPU are then asynchronous DMA.
std::atomic<bool> pin_tiles{false};

// swap_io_alignment(): the page size with the direct-I/O swap backend, whose
// reads and writes StarPU 1.3 asserts to be page-aligned and page multiples
// (disk_unistd_o_direct.c); its plug asks starpu_malloc for page alignment,
// which these hooks must honour themselves.
std::atomic<size_t> io_alignment{1};

struct MappedRegion {
  size_t size;
  bool pinned;  // only pinned regions are unpinned: a failed unpin would leave a CUDA error behind
};

struct MappedRegions {
  std::mutex mutex;
  std::unordered_map<void*, MappedRegion> regions;
};

// Page-locks a tile. A failure (the system's limit on locked memory, say) leaves the
// tile pageable, slower to copy but correct; CUDA keeps the error of a failed
// cudaHostRegister as the thread's last error, which the next kernel launch check
// would report as its own failure, so it is cleared here and reported once.
bool pin_tile(void* p, size_t size) {
  if (starpu_memory_pin(p, size) == 0) return true;
#if JNNTILE_CUDA
  const char* error = cuda::take_last_error();
#else
  const char* error = "unknown error";
#endif
  static std::atomic<bool> reported{false};
  if (!reported.exchange(true))
    std::fprintf(stderr,
                 "jnntile: could not page-lock a %zu-byte tile in RAM (%s); such tiles stay pageable, so their "
                 "copies to and from the GPU are synchronous. Raise the locked-memory limit (ulimit -l) or set "
                 "pin_host_memory=False.\n",
                 size, error);
  return false;
}

MappedRegions& mapped() {
  static MappedRegions* m = new MappedRegions();
  return *m;
}

int tile_malloc(unsigned, void** out, size_t size, int) {
  if (size >= kMmapThreshold) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return -ENOMEM;
    bool pinned = pin_tiles && pin_tile(p, size);
    MappedRegions& m = mapped();
    std::lock_guard<std::mutex> lock(m.mutex);
    m.regions.emplace(p, MappedRegion{size, pinned});
    *out = p;
    return 0;
  }
  void* p = nullptr;
  if (posix_memalign(&p, std::max<size_t>(64, io_alignment), size > 0 ? size : 1) != 0) return -ENOMEM;
  *out = p;
  return 0;
}

int tile_free(unsigned, void* ptr, size_t, int) {
  if (ptr == nullptr) return 0;
  MappedRegion region{0, false};
  {
    MappedRegions& m = mapped();
    std::lock_guard<std::mutex> lock(m.mutex);
    auto it = m.regions.find(ptr);
    if (it != m.regions.end()) {
      region = it->second;
      m.regions.erase(it);
    }
  }
  if (region.size > 0) {
    if (region.pinned && starpu_memory_unpin(ptr, region.size) != 0) {
#if JNNTILE_CUDA
      std::fprintf(stderr, "jnntile: could not unpin a %zu-byte tile (%s)\n", region.size, cuda::take_last_error());
#endif
    }
    munmap(ptr, region.size);
  } else {
    free(ptr);
  }
  return 0;
}

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
  if (config.distributed) distributed_abandon();
  else starpu_shutdown();
}

void collect_profiling_locked(RuntimeState& s) {
  int nbus = starpu_bus_get_count();
  for (int bus = 0; bus < nbus; ++bus) {
    starpu_profiling_bus_info info;
    if (starpu_bus_get_profiling_info(bus, &info) != 0) continue;  // resets the counters
    if (info.transferred_bytes == 0) continue;
    std::string key = node_kind_name(starpu_bus_get_src(bus)) + "->" +
                      node_kind_name(starpu_bus_get_dst(bus));
    s.bytes_moved[key] += info.transferred_bytes;
  }
  unsigned nworkers = starpu_worker_get_count();
  s.worker_busy_s.resize(nworkers, 0.0);
  s.worker_tasks.resize(nworkers, 0);
  for (unsigned w = 0; w < nworkers; ++w) {
    starpu_profiling_worker_info info;
    if (starpu_profiling_worker_get_info(w, &info) != 0) continue;  // resets the counters
    s.worker_busy_s[w] += starpu_timing_timespec_to_us(&info.executing_time) * 1e-6;
    s.worker_tasks[w] += info.executed_tasks;
  }
}

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
struct sigaction previous_action[NSIG];

void print_native_stack(int sig, siginfo_t*, void*) {
  static const char header[] = "\njnntile: fatal signal; native stack (innermost first):\n";
  void* frames[64];
  int depth = backtrace(frames, 64);
  if (write(STDERR_FILENO, header, sizeof header - 1) > 0) backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  // The signal stays blocked while this handler runs: raised again, it reaches the previous handler once this
  // one returns (a fault would also repeat by itself).
  sigaction(sig, &previous_action[sig], nullptr);
  raise(sig);
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

void report_native_stack_on_crash() {
  void* warm_up[1];
  backtrace(warm_up, 1);  // loads the unwinder now: its first call allocates, which a signal handler must not
  struct sigaction action {};
  action.sa_sigaction = print_native_stack;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (int sig : kFatalSignals) sigaction(sig, &action, &previous_action[sig]);
}

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

  io_alignment = config.swap_dir.empty() || config.swap_backend == SwapBackend::Unistd ? 1 : size_t(getpagesize());
  starpu_malloc_set_hooks(tile_malloc, tile_free);
  starpu_conf conf;
  starpu_conf_init(&conf);
  conf.ncpus = config.workers;
  conf.ncuda = config.cuda_workers;
  conf.sched_policy_name = config.scheduler.c_str();
  int ret = config.distributed ? distributed_starpu_init(&conf) : starpu_init(&conf);
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
  pin_tiles = config.pin_host_memory && starpu_cuda_worker_get_count() > 0;

  if (!config.swap_dir.empty()) {
    std::string pattern = config.swap_dir + "/" + kSwapPrefix + std::to_string(getpid()) + "-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (mkdir(config.swap_dir.c_str(), 0700) != 0 && errno != EEXIST) {
      shutdown_after_failed_start(config);
      throw std::runtime_error("cannot create swap directory '" + config.swap_dir + "'");
    }
    if (mkdtemp(buf.data()) == nullptr) {
      shutdown_after_failed_start(config);
      throw std::runtime_error("cannot create a swap subdirectory in '" + config.swap_dir +
                               "': check that it is writable");
    }
    s.swap_subdir = buf.data();
    int64_t bytes = config.swap_size_mb * (int64_t(1) << 20);
    bool direct = config.swap_backend == SwapBackend::UnistdODirect;
    starpu_disk_ops* ops = reserve_swap(s.swap_subdir, bytes, direct ? &starpu_disk_unistd_o_direct_ops
                                                                     : &starpu_disk_unistd_ops);
    if (ops == nullptr) {
      std::string why = std::strerror(errno);
      shutdown_after_failed_start(config);
      release_swap();
      remove_tree(s.swap_subdir);
      s.swap_subdir.clear();
      throw std::runtime_error("cannot reserve " + std::to_string(config.swap_size_mb) + " MB of swap in '" +
                               config.swap_dir + "' (" + why + "; " +
                               std::to_string(free_bytes(config.swap_dir) >> 20) +
                               " MB free there): free space there, lower swap_size_mb or choose another swap_dir");
    }
    int node = starpu_disk_register(ops, (void*)s.swap_subdir.c_str(), bytes);
    if (node < 0) {
      shutdown_after_failed_start(config);
      release_swap();
      remove_tree(s.swap_subdir);
      throw std::runtime_error("StarPU could not register disk swap in '" + config.swap_dir + "' of " +
                               std::to_string(config.swap_size_mb) + " MB" +
                               (direct ? " with direct I/O: its file system may not allow O_DIRECT; use "
                                         "swap_backend='unistd' or a directory on another file system"
                                       : ""));
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
  s.bytes_moved.clear();
  s.worker_busy_s.clear();
  s.worker_tasks.clear();
  s.codelets.clear();
  std::fill(std::begin(s.duration_histogram), std::end(s.duration_histogram), 0);
  for (auto& peak : s.peak_used) peak = 0;
  s.last_progress = Clock::now();
}

void reset_peaks() {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.running) return;
  unsigned nnodes = std::min<unsigned>(starpu_memory_nodes_get_count(), RuntimeState::kMaxNodes);
  for (unsigned node = 0; node < nnodes; ++node) s.peak_used[node] = node_used(node);
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
  std::string peer_failure;  // the other ranks did not come to stop with this one
  if (drained) {
#if JNNTILE_CUDA
    cuda::stop_workers();
#endif
    if (!s.config.distributed) {
      starpu_shutdown();
    } else {
      try {
        distributed_starpu_shutdown(s.config.watchdog_s);
      } catch (const std::exception& e) {
        peer_failure = e.what();
      }
    }
  } else {
    s.abandoned = s.failure;
    if (s.config.distributed) distributed_abandon();
  }
  if (!s.swap_subdir.empty()) {
    release_swap();
    remove_tree(s.swap_subdir);
    s.swap_subdir.clear();
  }
  if (!peer_failure.empty()) throw std::runtime_error(peer_failure);
}

bool runtime_running() { return state().running; }

std::string swap_failure() {
  SwapSpace& sw = swap_space();
  std::lock_guard<std::mutex> lock(sw.mutex);
  return sw.failure;
}

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

size_t swap_io_alignment() { return io_alignment; }

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

void submit(starpu_task* task, TaskGroup* group) {
  RuntimeState& s = state();
  const uint32_t both = STARPU_CPU | STARPU_CUDA;
  if (task->cl != nullptr && (task->cl->where & both) == both && s.where_both_versions != 0)
    task->where = s.where_both_versions;
  task->callback_func = on_task_done;
  task->callback_arg = group;
  task->detach = 1;
  task->destroy = 1;
  if (group != nullptr) group->remaining.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    wake_locked(s);
    s.pending += 1;
    s.submitted += 1;
    if (s.pending == 1) s.last_progress = Clock::now();
  }
  int ret = starpu_task_submit(task);
  if (ret != 0) {
    std::string name = task->cl != nullptr && task->cl->name ? task->cl->name : "?";
    on_task_done(group);
    s.completed.fetch_sub(1);
    if (ret == -ENODEV) {
      bool cuda = task->cl != nullptr && (task->cl->where & STARPU_CUDA);
      throw std::runtime_error("no StarPU worker can run task '" + name + "' (error -ENODEV): it runs on " +
                               (cuda ? "CPU or CUDA" : "CPU") + " workers and StarPU has " +
                               std::to_string(starpu_cpu_worker_get_count()) + " CPU and " +
                               std::to_string(starpu_cuda_worker_get_count()) +
                               " CUDA workers. Check STARPU_NCPU / STARPU_NCUDA in the environment");
    }
    throw std::runtime_error("StarPU refused task '" + name + "' (error " + std::to_string(ret) + ")");
  }
}

void begin_pending() {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  wake_locked(s);
  s.pending += 1;
  if (s.pending == 1) s.last_progress = Clock::now();
}

void end_pending() {
  RuntimeState& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    finish_one_locked(s);
  }
  s.progress.notify_all();
}

namespace {
template <class Done>
void wait_until(Done done, const char* what) {
  RuntimeState& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  while (!done()) {
    s.progress.wait_for(lock, std::chrono::milliseconds(50));
    if (done()) break;
    if (s.failed) throw std::runtime_error(s.failure);  // runtime_fail: the tasks waited for will not complete
    double quiet_s = std::chrono::duration<double>(Clock::now() - s.last_progress).count();
    if (s.pending > 0 && quiet_s > s.config.watchdog_s) {
      std::string msg = "no StarPU task completed for " + seconds_str(quiet_s) + " s while waiting for " + what;
      if (std::string stall = distributed_stall(); !stall.empty()) {
        msg += ": " + stall + ".";
      } else {
        msg += " (" + std::to_string(s.pending) + " tasks pending, memory limit " +
               std::to_string(s.config.memory_limit_mb) + " MB, " +
               (s.config.gpu_memory_limit_mb > 0
                    ? "GPU memory limit " + std::to_string(s.config.gpu_memory_limit_mb) + " MB, "
                    : "") +
               (s.swap_subdir.empty() ? "no disk swap" : "disk swap in " + s.config.swap_dir) +
               "). The working set likely exceeds the memory limit: raise memory_limit_mb, "
               "add swap_dir, or use smaller tiles (python -m jnntile.memory with the model's flags "
               "tells what fits). Raise watchdog_s if tasks are just slow.";
      }
      s.failed = true;
      s.skip_kernels = true;
      s.failure = msg;
      throw std::runtime_error(s.failure);
    }
  }
}
}  // namespace

void wait(TaskGroup* group, const char* what) {
  wait_until([&] { return group->remaining.load() == 0; }, what);
  delete group;
}

void wait_all(const char* what) {
  wait_until([&] { return state().pending == 0; }, what);
}

namespace {
void empty_kernel(void**, void*) {}

// An empty kernel on a one-float tile, on CPU or CUDA workers, declared as every jnntile codelet is (a
// history-based performance model among the rest), so that a model-based scheduler (dmdas) does the per-task
// work it does in a step. On CUDA workers it launches nothing: StarPU records its stream's event at once.
starpu_codelet empty_codelet(bool on_cuda) {
  starpu_codelet c = make_codelet(on_cuda ? "empty_cuda" : "empty", empty_kernel, empty_kernel);
  c.where = on_cuda ? STARPU_CUDA : STARPU_CPU;
  c.nbuffers = 1;
  c.modes[0] = STARPU_RW;
  return c;
}
}  // namespace

double measure_empty_tasks(int count, EmptyTasks kind, bool on_cuda) {
  require_runtime();
  if (count < 1) throw std::invalid_argument("measure_empty_tasks: count must be positive, got " +
                                             std::to_string(count));
  if (on_cuda && starpu_cuda_worker_get_count() == 0)
    throw std::runtime_error("measure_empty_tasks on CUDA workers: this runtime has none (a GPU, `make cuda` "
                             "and cuda_workers != 0 are needed)");
  static starpu_codelet cpu_cl = empty_codelet(false);
  static starpu_codelet cuda_cl = empty_codelet(true);
  starpu_codelet* cl = on_cuda ? &cuda_cl : &cpu_cl;
  const int tiles = kind == EmptyTasks::Independent ? count : 1;
  std::vector<float> values(tiles, 0.0f);
  std::vector<starpu_data_handle_t> handles(tiles);
  for (int t = 0; t < tiles; ++t)
    starpu_vector_data_register(&handles[t], STARPU_MAIN_RAM, uintptr_t(&values[t]), 1, sizeof(float));
  auto submit_one = [&](int i, TaskGroup* group) {
    starpu_task* task = starpu_task_create();
    task->cl = cl;
    task->handles[0] = handles[i % tiles];
    submit(task, group);
  };
  // One task first, waited for: the tiles reach the workers' memory before the clock starts.
  for (int t = 0; t < tiles; ++t) {
    auto* group = new TaskGroup();
    submit_one(t, group);
    wait(group, "an empty task");
  }
  auto start = Clock::now();
  if (kind == EmptyTasks::RoundTrip) {
    for (int i = 0; i < count; ++i) {
      auto* group = new TaskGroup();
      submit_one(i, group);
      wait(group, "an empty task");
    }
  } else {
    auto* group = new TaskGroup();
    for (int i = 0; i < count; ++i) submit_one(i, group);
    wait(group, "empty tasks");
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count() / count;
  // Unregistering waits for StarPU's own requests on the tiles, which paused workers never serve (the runtime
  // pauses them once nothing is pending): it hung there with tiles on a GPU. The values are never read, so
  // nothing is fetched back.
  begin_pending();
  for (starpu_data_handle_t h : handles) starpu_data_unregister_no_coherency(h);
  end_pending();
  return seconds;
}

RuntimeStats runtime_stats() {
  RuntimeState& s = state();
  RuntimeStats out{};
  std::lock_guard<std::mutex> lock(s.mutex);
  out.tasks_submitted = s.submitted;
  out.tasks_completed = s.completed.load();
  out.tasks_pending = s.pending;
  for (const auto& [name, c] : s.codelets) out.codelets[name] = c;
  int64_t total = 0, seen = 0;
  for (int64_t n : s.duration_histogram) total += n;
  out.median_task_s = 0.0;
  for (int b = 0; b < RuntimeState::kDurationBuckets && total > 0; ++b) {
    seen += s.duration_histogram[b];
    if (2 * seen >= total) {
      out.median_task_s = std::exp2((b + 0.5) / 8.0) * 1e-6;  // the bucket's middle
      break;
    }
  }
  if (!s.running) return out;
  collect_profiling_locked(s);
  for (size_t w = 0; w < s.worker_busy_s.size(); ++w) {
    char name[128];
    starpu_worker_get_name(int(w), name, sizeof(name));
    out.workers.push_back({int(w), name, s.worker_busy_s[w], s.worker_tasks[w]});
  }
  unsigned nnodes = starpu_memory_nodes_get_count();
  for (unsigned node = 0; node < nnodes; ++node) {
    int64_t total = starpu_memory_get_total(node);
    int64_t available = starpu_memory_get_available(node);
    int64_t used = total >= 0 ? total - available : -1;
    int64_t peak = node < unsigned(RuntimeState::kMaxNodes) ? s.peak_used[node].load() : -1;
    out.nodes.push_back({int(node), node_kind_name(node), used, total, std::max(peak, used)});
  }
  out.bytes_moved = s.bytes_moved;
  return out;
}

}  // namespace jnntile
