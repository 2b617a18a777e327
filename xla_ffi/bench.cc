#include "bench.h"

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "task.h"

namespace jnntile {
namespace {

using Clock = std::chrono::steady_clock;

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

}  // namespace jnntile
