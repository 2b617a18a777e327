// Statistics of the runtime since start: tasks per codelet and how long they ran, the workers' busy time, each
// memory node's use and peak, bytes moved between nodes (runtime_stats, jnntile.runtime.stats).
#include "runtime_state.h"

#include <algorithm>
#include <cmath>

namespace jnntile {
namespace {

int64_t node_used(unsigned node) {
  int64_t total = starpu_memory_get_total(node);
  return total >= 0 ? total - starpu_memory_get_available(node) : -1;
}

std::string node_kind_name(int node) {
  switch (starpu_node_get_kind(node)) {
    case STARPU_CPU_RAM: return "RAM";
    case STARPU_CUDA_RAM: return "CUDA";
    case STARPU_DISK_RAM: return "DISK";
    default: return "OTHER";
  }
}

void collect_profiling_locked(Statistics& s) {
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

}  // namespace

void Statistics::clear() {
  bytes_moved.clear();
  worker_busy_s.clear();
  worker_tasks.clear();
  codelets.clear();
  std::fill(std::begin(duration_histogram), std::end(duration_histogram), 0);
  for (auto& peak : peak_used) peak = 0;
}

void Statistics::sample_peaks() {
  unsigned nnodes = std::min<unsigned>(starpu_memory_nodes_get_count(), kMaxNodes);
  for (unsigned node = 0; node < nnodes; ++node) {
    int64_t used = node_used(node);
    int64_t peak = peak_used[node].load(std::memory_order_relaxed);
    while (used > peak && !peak_used[node].compare_exchange_weak(peak, used)) {
    }
  }
}

void Statistics::record_locked(const starpu_task* task) {
  if (task == nullptr || task->cl == nullptr || task->profiling_info == nullptr) return;
  double seconds = starpu_timing_timespec_delay_us(&task->profiling_info->start_time,
                                                   &task->profiling_info->end_time) * 1e-6;
  CodeletStats& c = codelets[task->cl->name];
  c.tasks += 1;
  c.seconds += seconds;
  if (starpu_worker_get_type(task->profiling_info->workerid) == STARPU_CUDA_WORKER) {
    c.cuda_tasks += 1;
    c.cuda_seconds += seconds;
  }
  int bucket = seconds > 1e-6 ? int(8.0 * std::log2(seconds * 1e6)) : 0;
  duration_histogram[std::clamp(bucket, 0, kDurationBuckets - 1)] += 1;
}

void reset_peaks() {
  RuntimeState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.running) return;
  unsigned nnodes = std::min<unsigned>(starpu_memory_nodes_get_count(), Statistics::kMaxNodes);
  for (unsigned node = 0; node < nnodes; ++node) s.stats.peak_used[node] = node_used(node);
}

RuntimeStats runtime_stats() {
  RuntimeState& s = state();
  RuntimeStats out{};
  std::lock_guard<std::mutex> lock(s.mutex);
  out.tasks_submitted = s.submitted;
  out.tasks_completed = s.completed.load();
  out.tasks_pending = s.pending;
  const Statistics& stats = s.stats;
  for (const auto& [name, c] : stats.codelets) out.codelets[name] = c;
  int64_t total = 0, seen = 0;
  for (int64_t n : stats.duration_histogram) total += n;
  out.median_task_s = 0.0;
  for (int b = 0; b < Statistics::kDurationBuckets && total > 0; ++b) {
    seen += stats.duration_histogram[b];
    if (2 * seen >= total) {
      out.median_task_s = std::exp2((b + 0.5) / 8.0) * 1e-6;  // the bucket's middle
      break;
    }
  }
  if (!s.running) return out;
  collect_profiling_locked(s.stats);
  for (size_t w = 0; w < stats.worker_busy_s.size(); ++w) {
    char name[128];
    starpu_worker_get_name(int(w), name, sizeof(name));
    out.workers.push_back({int(w), name, stats.worker_busy_s[w], stats.worker_tasks[w]});
  }
  unsigned nnodes = starpu_memory_nodes_get_count();
  for (unsigned node = 0; node < nnodes; ++node) {
    int64_t total = starpu_memory_get_total(node);
    int64_t available = starpu_memory_get_available(node);
    int64_t used = total >= 0 ? total - available : -1;
    int64_t peak = node < unsigned(Statistics::kMaxNodes) ? stats.peak_used[node].load() : -1;
    out.nodes.push_back({int(node), node_kind_name(node), used, total, std::max(peak, used)});
  }
  out.bytes_moved = stats.bytes_moved;
  return out;
}

}  // namespace jnntile
