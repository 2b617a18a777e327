// The runtime's shared state and the functions its files call in each other (private to these files; the rest
// of jnntile uses runtime.h):
//   runtime.cc          lifecycle: start, stop, failure, configuration
//   task_accounting.cc  submission, pending work, idle pausing, waits and their watchdog
//   stats.cc            statistics: tasks per codelet, their durations, workers, memory peaks, bytes moved
//   host_memory.cc      RAM tiles: the mmap allocator, page-locking
//   swap.cc             disk swap: its subdirectory and the reserve that StarPU's disk backend draws from
#pragma once

#include "runtime.h"

#include <chrono>
#include <cstdint>
#include <thread>

namespace jnntile {

using Clock = std::chrono::steady_clock;

// Statistics of the tasks since start (stats.cc); guarded by RuntimeState::mutex but for peak_used.
struct Statistics {
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

  void clear();
  // Samples every node's use into peak_used; called without the mutex.
  void sample_peaks();
  // Records how long the finished `task` ran (profiling is on), by codelet; callers hold the mutex.
  void record_locked(const starpu_task* task);
};

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
  DistributedHooks distributed{};  // set once at import (distributed.cc)
  int64_t pending = 0;
  int64_t submitted = 0;
  std::atomic<int64_t> completed{0};
  std::atomic<int64_t> wake_at_completed{INT64_MAX};  // wait_completed's target: the completion that wakes it
  Clock::time_point last_progress = Clock::now();
  Statistics stats;
};

RuntimeState& state();

// task_accounting.cc. Pauses the workers once nothing has been pending for a moment; runs on RuntimeState::pauser.
void pauser_loop();
// Callers hold state().mutex.
void wake_locked(RuntimeState& s);

// host_memory.cc. Makes StarPU allocate RAM tiles through the allocator of host_memory.cc, aligned for the
// swap backend `config` asks for (before starpu_init).
void use_tile_allocator(const RuntimeConfig& config);
// Page-locks RAM tiles allocated from now on, or not (after starpu_init: only with a CUDA worker).
void pin_new_tiles(bool pin);

// swap.cc. Creates a swap subdirectory in config.swap_dir, reserves config.swap_size_mb there and registers it
// with StarPU as a disk node; throws std::runtime_error naming the problem (close_swap then cleans up).
void open_swap(const RuntimeConfig& config);
// Gives the reserve back and removes the swap subdirectory, if there is one.
void close_swap();

}  // namespace jnntile
