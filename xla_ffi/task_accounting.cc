// Task accounting: every task is submitted here and counted as pending until its callback; the workers are
// paused while nothing is pending, and waits fail when no task completed for watchdog_s (runtime.h).
#include "format.h"
#include "runtime_state.h"

#include <cerrno>
#include <stdexcept>
#include <string>

namespace jnntile {
namespace {

// Workers keep spinning this long after the last task before they are paused:
// a blocking read followed by the next submission then costs no wake-up.
constexpr auto kPauseGrace = std::chrono::milliseconds(2);

void finish_one_locked(RuntimeState& s) {
  s.pending -= 1;
  s.last_progress = Clock::now();
  if (s.pending == 0) s.idle.notify_all();
}

// Waiters wait for a group to finish or for nothing to be pending (and wake every 50 ms for the watchdog), so
// only those completions wake them: a wake at every completion cost the worker that ran the task (the GPU's,
// between its launches) a futex call, and the waiting thread a round on the mutex, per task.
void on_task_done(void* arg) {
  RuntimeState& s = state();
  s.stats.sample_peaks();
  const int64_t completed = s.completed.fetch_add(1, std::memory_order_relaxed) + 1;
  bool wake = arg != nullptr && static_cast<TaskGroup*>(arg)->remaining.fetch_sub(1) == 1;
  wake = wake || completed >= s.wake_at_completed.load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    // In a callback, StarPU's current task is the one that finished.
    s.stats.record_locked(starpu_task_get_current());
    finish_one_locked(s);
    wake = wake || s.pending == 0;
  }
  if (wake) s.progress.notify_all();
}

}  // namespace

void wake_locked(RuntimeState& s) {
  if (s.paused) {
    starpu_resume();
    s.paused = false;
  }
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
      if (std::string stall = s.distributed.stall ? s.distributed.stall() : ""; !stall.empty()) {
        msg += ": " + stall + ".";
      } else {
        msg += " (" + std::to_string(s.pending) + " tasks pending, memory limit " +
               std::to_string(s.config.memory_limit_mb) + " MB, " +
               (s.config.gpu_memory_limit_mb > 0
                    ? "GPU memory limit " + std::to_string(s.config.gpu_memory_limit_mb) + " MB, "
                    : "") +
               (s.config.swap_dir.empty() ? "no disk swap" : "disk swap in " + s.config.swap_dir) +
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

int64_t tasks_submitted() {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.submitted;
}

void wait_completed(int64_t count, const char* what) {
  RuntimeState& s = state();
  s.wake_at_completed.store(count);
  try {
    wait_until([&] { return s.completed.load() >= count; }, what);
  } catch (...) {
    s.wake_at_completed.store(INT64_MAX);
    throw;
  }
  s.wake_at_completed.store(INT64_MAX);
}

}  // namespace jnntile
