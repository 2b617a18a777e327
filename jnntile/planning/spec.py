"""What the planner plans and under what: the step (`StepSpec`) and the memory limits (`Limits`).

`jnntile.flags.step_spec` and `jnntile.flags.limits` build them from the command-line flags, once, for `train` and
`memory`; `generate` plans its decoding as a training step with SGD (see jnntile/generate.py).
"""

from __future__ import annotations

import dataclasses

from jnntile.core import runtime


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One training step: the model config of a registered family, with its execution fields (tile_*, dtype,
    remat), `batch_size` sequences per micro-batch (on this rank) of `seq_len` tokens, `grad_accum_steps`
    micro-batches per step, the optimizer (a key of jnntile.optim.OPTIMIZER_STATES), what trains (`finetune`,
    a jnntile.lora.FineTune; None: everything), how the update meets the backward (`update`, one of
    jnntile.optim.UPDATE_MODES) and the ranks the training state is sharded across (`shards`, 1: this process
    holds all of it; docs/distributed.md, "Sharded state"), keeping the parameters a rank fetches until they are
    written with `keep_fetched` (the runtime's shard_keep_fetched)."""

    config: object
    batch_size: int
    seq_len: int
    grad_accum_steps: int = 1
    optimizer: str = "adamw"
    finetune: object = None
    update: str = "after"
    shards: int = 1
    keep_fetched: bool = False

    def with_config(self, **fields) -> StepSpec:
        """The same step with the config's `fields` replaced (the tiles or the recomputation the search chose)."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **fields))


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a step runs under: RAM for tiles (`memory_limit_mb`), disk swap (`swap_mb`, 0: none), GPU memory per
    GPU (`gpu_mb`, 0: no GPU), whether CPU workers run kernels beside the GPU (`cpu_kernels`: what they write
    stays in RAM, see `MemoryPlan.verdict`), and the CPU workers (`workers`, None: the runtime's)."""

    memory_limit_mb: float
    swap_mb: float = 0
    gpu_mb: float = 0
    cpu_kernels: bool = False
    workers: int | None = None

    @classmethod
    def of(cls, config: runtime.RuntimeConfig) -> Limits:
        """The limits a runtime started with `config` works under."""
        return cls(config.memory_limit_mb, config.swap_size_mb if config.swap_dir else 0, runtime.gpu_memory_mb(config),
                   runtime.cpu_kernels_beside_gpu(config), config.workers)
