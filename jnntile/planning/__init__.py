"""Memory planner: what a training step of a model (GPT-2, the Llama family) needs, before anything is allocated.

`plan(config, batch_size, seq_len, optimizer="adamw")` records the forward of the very
model of `config`'s family the step runs (`record_step`: the op layer submits nothing while it records), with
the tile sizes `jnntile.models.resolve_tiles` picks, then follows the step (forward,
backward, optimizer) and what the runtime does with memory (DESIGN invariant 7,
jnntile/ops/_ffi.py); `plan_model` does the same for any model built from jnntile's modules:

* parameters, optimizer state and the token ids live all the time;
* the forward pass creates activations and scratch residuals (layer-norm
  statistics, attention and cross-entropy logsumexp) that live until the
  backward rule of the op that made them has run;
* gradients start at zero right before their first backward use: an
  activation's gradient lives from the backward of its last consumer to the
  backward of its producer, a parameter's until the optimizer consumed it.

The peak of that timeline is the memory StarPU must hold at once: with less
RAM (the memory limit) it needs disk swap, as large as the whole peak, because
StarPU keeps disk copies of the tiles it reads back (RAM caches the swap). Independently, every
task needs all its tiles in RAM while it runs, and each worker runs one task
at a time, so `workers x` the largest task must fit under the limit whatever
the swap (a measured fact: two 7.3 MB tasks under a 10 MB limit hang, and the
watchdog reports it). `fit_tiles` shrinks the automatic tile sizes until
that holds (and, with a GPU, until a CUDA worker's tasks fit its memory);
`python -m jnntile.train` and `python -m jnntile.memory` use it.

One concept a file: spec.py says what is planned (StepSpec) and under what (Limits), record.py records a step,
timeline.py simulates its memory over time, swap.py models StarPU's swap eviction and traffic, sharding.py a rank's
part of a state sharded across ranks, plan.py makes the plan (the table and the verdict), search.py chooses
recomputation and tiles (`fit`).
"""

from jnntile.planning.plan import MB, MemoryPlan, MemoryPlanError, plan, plan_model
from jnntile.planning.record import record_step
from jnntile.planning.search import choose_remat, fit, fit_tiles
from jnntile.planning.spec import Limits, StepSpec

__all__ = ["MB", "Limits", "MemoryPlan", "MemoryPlanError", "StepSpec", "choose_remat", "fit", "fit_tiles", "plan",
           "plan_model", "record_step"]
