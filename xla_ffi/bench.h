// Measures of the runtime for bench/overhead.py (and tests/test_runtime.py), not used in training.
#pragma once

namespace jnntile {

// The mean seconds per task of `count` empty tasks on CPU or CUDA workers: the
// runtime's own cost of a task. RoundTrip submits one at a time and waits for
// each (submission to completion, as a blocking read pays); Chain submits all
// at once on one tile, each depending on the one before (what a chain of ops
// pays between kernels); Independent submits all at once on tiles of their own
// (the workers' task throughput).
enum class EmptyTasks { RoundTrip, Chain, Independent };
double measure_empty_tasks(int count, EmptyTasks kind, bool on_cuda);

}  // namespace jnntile
