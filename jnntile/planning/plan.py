"""The memory plan of a training step: the bytes it needs (parameters, gradients, optimizer state, activations,
the peak of its timeline, its largest task), the table, and the verdict under a memory limit, swap and a GPU.

`plan(config, batch_size, seq_len, optimizer="adamw")` plans a registered family's step, `plan_model` any model
built from jnntile's modules."""

from __future__ import annotations

import dataclasses
import functools
import math

from jnntile.core import runtime
from jnntile.models import Tiles, resolve_tiles
from jnntile.training.optim import OPTIMIZER_STATES, UPDATE_MODES
from jnntile.planning import record, sharding, swap, timeline
from jnntile.planning.record import RecordedStep, T
from jnntile.planning.spec import Limits, StepSpec

MB = 2 ** 20
F32 = 4
# The tile axes (jnntile.models.TILE_AXES) in the order a suggestion shrinks them, and the smallest tile it
# proposes on each.
SHRINK_ORDER = ("vocab", "hidden", "embd", "seq", "heads", "batch")
_MIN_TILE = {"vocab": 64, "hidden": 64, "embd": 32, "seq": 16, "heads": 1, "batch": 1}


class MemoryPlanError(ValueError):
    """The configuration cannot train under the given memory limit and swap."""


@dataclasses.dataclass
class MemoryPlan:
    """Bytes one training step needs, and whether it can run under a memory limit."""

    optimizer: str
    workers: int
    n_params: int
    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    activations: int  # activations and scratch residuals alive at the end of the forward pass
    activation_gradients: int  # the most activation gradients alive at once in the backward pass
    peak: int  # the most bytes StarPU holds at once in the step (simulated timeline)
    peak_phase: str
    largest_task: int
    largest_task_name: str
    config: object = None  # a registered family's (plan), None for another model (plan_model)
    batch_size: int = 0
    seq_len: int = 0
    tiles: object = None  # jnntile.models.Tiles
    grad_accum_steps: int = 1  # micro-batches of (batch_size, seq_len) per step
    compute_copies: int = 0  # the parameters' bfloat16 copies of a model in bfloat16, kept between steps
    frozen_parameters: int = 0  # bytes of the parameters nobody trains (no gradient, no optimizer state)
    finetune: object = None  # jnntile.lora.FineTune: what trains (None: everything)
    tiles_note: str = ""  # how the tiles were chosen, when not the automatic ones (see fit_tiles)
    update: str = "after"  # how the update meets the backward (jnntile.optim.UPDATE_MODES)
    # With the state sharded across `shards` ranks (sharding.py), the state's bytes are one rank's part of it,
    # beside the parameters it fetches for the ops in flight (`fetched`, at most) and what it sends and
    # receives in a step.
    shards: int = 1
    fetched: int = 0
    keep_fetched: bool = False  # `fetched` then counts the parameters kept all step (sharding.Shard.kept)
    sent: int = 0
    received: int = 0
    step: RecordedStep = dataclasses.field(default=None, repr=False)  # what the numbers come from

    @property
    def state(self) -> int:
        """Parameters (trained and frozen) + gradients + optimizer state + compute copies."""
        return self.parameters + self.frozen_parameters + self.gradients + self.optimizer_state + self.compute_copies

    @property
    def concurrent_tasks(self) -> int:
        """Bytes that the tasks running at once may need in RAM: one largest task per worker."""
        return self.workers * self.largest_task

    def host_bytes(self, gpu_mb: float = 0) -> int:
        """Bytes of the peak that host memory (RAM and swap) must hold: all of it, or what a GPU of gpu_mb cannot."""
        return max(0, self.peak - int(gpu_mb * MB))

    def swap_needed_mb(self, memory_limit_mb: float, gpu_mb: float = 0) -> int:
        """Swap (MB) needed under `memory_limit_mb` (beside `gpu_mb` of GPU memory); 0 when RAM suffices.

        RAM is a cache of the swap, not an extension of it: StarPU keeps the disk
        copy of a tile it brought back, so the swap must hold the whole host part
        of the peak (measured on a 41 MB step under a 16 MB limit: 40 MB of swap
        hangs, 44 MB runs, 16 MB makes StarPU abort). Hence that plus a tenth,
        and never below StarPU's smallest disk. With a GPU, tiles it evicts go
        to RAM: GPU memory and host memory add up.
        """
        host = self.host_bytes(gpu_mb)
        if host <= memory_limit_mb * MB:
            return 0

        return max(runtime.MIN_SWAP_MB, math.ceil(1.1 * host / MB))

    def swap_traffic(self, memory_limit_mb: float, clip: bool = True, update: str | None = None) -> tuple[int, int]:
        """(bytes written to swap, bytes read from it) in one training step under `memory_limit_mb`, in
        steady state (`swap.traffic`), with or without global-norm `clip`ping and the `update` mode
        (default: the plan's; a speculative update clips, a fused one does not)."""
        update = update or self.update
        return swap.traffic(self.step, self.optimizer, int(memory_limit_mb * MB), update,
                             clip and update != "fused", self.grad_accum_steps)

    def _task_reason(self, memory_limit_mb: float) -> str | None:
        """Why the tasks running at once do not fit in RAM, or None when they do."""
        if self.concurrent_tasks <= memory_limit_mb * MB:
            return None
        running = (f" and {self.workers} workers run {self.workers} such tasks at once "
                   f"({self.concurrent_tasks / MB:.1f} MB)" if self.workers > 1 else "")
        return (f"a single task ({self.largest_task_name}) needs {self.largest_task / MB:.1f} MB{running}, more than "
                f"the memory limit of {memory_limit_mb:g} MB")

    def _gpu_task_reason(self, gpu_mb: float) -> str | None:
        """Why one CUDA worker's tasks do not fit in GPU memory, or None when they do (or there is no GPU)."""
        in_flight = runtime.gpu_tasks_in_flight()  # StarPU's pipeline keeps this many tasks' tiles on the GPU
        need = in_flight * self.largest_task
        if not gpu_mb or need <= gpu_mb * MB:
            return None
        return (f"a single task ({self.largest_task_name}) needs {self.largest_task / MB:.1f} MB and a GPU holds "
                f"{in_flight} tasks' tiles at once ({need / MB:.1f} MB), more than the GPU memory limit of "
                f"{gpu_mb:g} MB")

    def task_fit_problem(self, memory_limit_mb: float, gpu_mb: float = 0) -> str | None:
        """Why the largest tasks do not fit under the RAM or GPU limit (None when they do): smaller tiles help."""
        return self._task_reason(memory_limit_mb) or self._gpu_task_reason(gpu_mb)

    def _task_problem(self, memory_limit_mb: float, gpu_mb: float) -> str | None:
        reason = self._task_reason(memory_limit_mb)
        if reason:
            hint = self.suggest_tiles(memory_limit_mb, gpu_mb)
            fewer = " or fewer workers" if self.workers > 1 and self.largest_task <= memory_limit_mb * MB else ""
            return f"cannot run: {reason}; use smaller tiles{', e.g. ' + hint if hint else ''}{fewer}"
        reason = self._gpu_task_reason(gpu_mb)
        if reason:
            hint = self.suggest_tiles(memory_limit_mb, gpu_mb)
            return (f"cannot run: {reason}; use smaller tiles{', e.g. ' + hint if hint else ''} or raise "
                    "--gpu-memory-limit-mb")
        return None

    def verdict(self, limits: Limits) -> str:
        """A short sentence under `limits`: "fits in RAM", "needs N MB of swap" or "cannot run: ...".

        With a GPU (limits.gpu_mb: its memory limit, or its memory, in MB): "fits on the
        GPU", "fits on the GPU and N MB of host RAM", or the host verdicts for
        what the GPU cannot hold. limits.cpu_kernels: CPU workers run kernels beside the
        GPU (placement "any", what a GPU memory limit resolves "auto" to). What
        they write stays in RAM until a GPU task reads it, and without swap
        nothing takes it back, so RAM must hold the whole peak: a 256 MB GPU
        limit beside 4 MB of RAM stopped on the emulated GPU, unlimited it ran.
        """
        memory_limit_mb, swap_size_mb, gpu_mb = limits.memory_limit_mb, limits.swap_mb, limits.gpu_mb
        problem = self._task_problem(memory_limit_mb, gpu_mb)
        if problem:
            return problem
        if gpu_mb and limits.cpu_kernels and not swap_size_mb and self.peak > memory_limit_mb * MB:
            return (f"cannot run: under a GPU memory limit CPU workers run kernels too and keep what they write in "
                    f"RAM, which nothing takes back without swap, and the step's peak of {self.peak / MB:.0f} MB is "
                    f"over the {memory_limit_mb:g} MB memory limit; give --swap-dir, raise --memory-limit-mb to "
                    f"{math.ceil(self.peak / MB)}, or leave GPU memory unlimited (kernels then run on the GPU alone)")
        host_mb = math.ceil(self.host_bytes(gpu_mb) / MB)
        need = self.swap_needed_mb(memory_limit_mb, gpu_mb)
        if need == 0:
            if not gpu_mb:
                return "fits in RAM"
            return "fits on the GPU" if host_mb == 0 else f"fits on the GPU and {host_mb} MB of host RAM"
        if swap_size_mb and swap_size_mb < need:
            beside_gpu = f" beyond the GPU's {gpu_mb:g} MB" if gpu_mb else ""
            return (f"cannot run: needs {need} MB of swap (the step's peak of {self.peak / MB:.0f} MB{beside_gpu} is "
                    f"over the {memory_limit_mb:g} MB limit, and the swap must hold all of it) but swap is "
                    f"{swap_size_mb:g} MB; raise --swap-size-mb or --memory-limit-mb")
        return f"needs {need} MB of swap"

    def check(self, limits: Limits) -> str:
        """Returns the verdict under `limits`, or raises MemoryPlanError when the step cannot run (no swap given
        counts)."""
        text = self.verdict(limits)
        if text.startswith("cannot run"):
            raise MemoryPlanError(text)
        if text.startswith("needs") and not limits.swap_mb:
            need = self.swap_needed_mb(limits.memory_limit_mb, limits.gpu_mb)
            raise MemoryPlanError(f"cannot run without swap: the step {text} under a memory limit of "
                                  f"{limits.memory_limit_mb:g} MB (peak {self.peak / MB:.0f} MB); give --swap-dir and "
                                  f"--swap-size-mb {need}, or raise "
                                  "--memory-limit-mb")
        return text

    def task_bytes_target(self, memory_limit_mb: float, gpu_mb: float = 0) -> float:
        """The most bytes one task may need: every worker runs one task at once in RAM, and a GPU holds
        runtime.gpu_tasks_in_flight() tasks."""
        target = memory_limit_mb * MB / self.workers
        return min(target, gpu_mb * MB / runtime.gpu_tasks_in_flight()) if gpu_mb else target

    def smaller_tiles(self, memory_limit_mb: float, gpu_mb: float = 0, axes=SHRINK_ORDER) -> dict | None:
        """Tile sizes (axis -> size, all axes) under which every task fits the limits, shrinking only `axes`.

        Halves, one at a time, the axis whose halving shrinks the largest task the
        most, down to _MIN_TILE. None when that cannot make it fit.
        """
        if self.config is None:
            return None
        target = self.task_bytes_target(memory_limit_mb, gpu_mb)
        tiles = dataclasses.asdict(self.tiles)
        while True:
            size = _largest_task(self.config, self.batch_size, self.seq_len, tiles, self.optimizer, self.finetune,
                                 self.update)[0]
            if size <= target:
                return tiles
            best = None
            for axis in axes:
                if tiles[axis] // 2 < _MIN_TILE[axis]:
                    continue
                trial = dict(tiles, **{axis: tiles[axis] // 2})
                trial_size = _largest_task(self.config, self.batch_size, self.seq_len, trial, self.optimizer,
                                           self.finetune, self.update)[0]
                if trial_size < size and (best is None or trial_size < best[1]):
                    best = (axis, trial_size)
            if best is None:
                return None
            tiles[best[0]] //= 2

    def suggest_tiles(self, memory_limit_mb: float, gpu_mb: float = 0) -> str:
        """Flags with smaller tiles under which every task fits the limits, e.g. "--tile-vocab 2048"."""
        tiles = self.smaller_tiles(memory_limit_mb, gpu_mb)
        if tiles is None:
            return ""
        current = dataclasses.asdict(self.tiles)
        return " ".join(f"--tile-{axis} {tiles[axis]}" for axis in SHRINK_ORDER if tiles[axis] != current[axis])

    def rows(self) -> list[tuple[str, float, str]]:
        """(what, MB, note) rows of the table."""
        mine = f", this rank's 1/{self.shards}" if self.shards > 1 else ""
        gradients = ("freed by the optimizer update" + (", kept between micro-batches" if self.grad_accum_steps > 1
                                                         else ""))
        if self.shards > 1:
            gradients = ("every parameter's partial sums on every rank until the last micro-batch"
                         if self.grad_accum_steps > 1 else
                         f"this rank's 1/{self.shards} once summed, whole for the layers in the backward")
        return [
            ("parameters", self.parameters / MB, f"{self.n_params:,} float32" + (
                ", trained" if self.frozen_parameters else "") + mine),
            *([("frozen parameters", self.frozen_parameters / MB, "no gradient, no optimizer state" + mine)]
              if self.frozen_parameters else []),
            ("gradients", self.gradients / MB, gradients),
            ("optimizer state", self.optimizer_state / MB, self.optimizer + mine),
            *([("compute copies", self.compute_copies / MB, "bfloat16 weights, written by the update" + mine)]
              if self.compute_copies else []),
            *([("parameters kept", self.fetched / MB,
                "other ranks' tiles read, kept until written, and their gradients") if self.keep_fetched else
               ("parameters fetched (peak)", self.fetched / MB, "other ranks' tiles, the op in flight and the next")]
              if self.shards > 1 else []),
            *([("next state (speculative update)", (self.parameters + self.optimizer_state + self.compute_copies) / MB,
                "written apart in the backward, the state from the step's end")] if self.update == "speculative"
              else []),
            ("token ids", self.inputs / MB, "idx, targets, positions"),
            ("activations kept for backward", self.activations / MB, "incl. layer-norm/attention/loss residuals"),
            ("activation gradients (peak)", self.activation_gradients / MB, "alive at once in the backward pass"),
            ("peak of the step", self.peak / MB, self.peak_phase),
            ("largest task", self.largest_task / MB, self.largest_task_name),
            (f"{self.workers} workers x largest task", self.concurrent_tasks / MB, "must fit under the limit"),
        ]

    def table(self) -> str:
        t = self.tiles
        micro = (f" per micro-batch, {self.grad_accum_steps} micro-batches per step adding to the same gradients"
                 if self.grad_accum_steps > 1 else "")
        rows = f" on this rank (of {self.shards} sharing the state)" if self.shards > 1 else ""
        lines = [] if t is None else [
            f"batch {self.batch_size}{rows} x seq {self.seq_len}{micro}; tiles batch={t.batch} seq={t.seq} "
            f"embd={t.embd} heads={t.heads} hidden={t.hidden} vocab={t.vocab}"]
        for what, mb, note in self.rows():
            lines.append(f"  {what:<32} {mb:>12,.1f} MB   {note}")
        return "\n".join(lines)


def _largest_task(config, batch_size, seq_len, tiles: dict, optimizer: str, finetune=None, update="after"):
    return _largest_task_of_tiles(config, batch_size, seq_len, tuple(sorted(tiles.items())), optimizer, finetune,
                                  update)


@functools.lru_cache(maxsize=256)  # the search of smaller_tiles tries the same tiles again
def _largest_task_of_tiles(config, batch_size, seq_len, tiles: tuple, optimizer: str, finetune=None,
                           update="after"):
    step = record.trace_step(config, batch_size, seq_len, Tiles(**dict(tiles)), finetune)
    return _largest_of(step, optimizer, update)


def _largest_of(step: RecordedStep, optimizer: str, update: str = "after"):
    tasks = [task for op in step.ops for task in op.tasks]
    n_state = OPTIMIZER_STATES[optimizer]
    fused = timeline.fused_at(step) if update == "speculative" else {}
    apart = {p.name for params in fused.values() for p in params}
    for p in step.params:  # optimizer update: parameter, gradient, states and compute copy, one tile each
        copy = step.copies[p.name].tile_bytes if p.name in step.copies else 0
        tiles = 2 + n_state + (1 + n_state if p.name in apart else 0)  # a speculative one writes p and states apart
        tasks.append((tiles * p.tile_bytes + copy, f"{optimizer} update of a {p.name} tile {_tile_str(p)}"))
    return max(tasks, key=lambda t: t[0])


def _tile_str(t: T) -> str:
    return "(" + ", ".join(str(min(a, n)) for a, n in zip(t.tile, t.shape)) + ")"


def plan(spec: StepSpec, *, workers: int | None = None, gpu_mb: float | None = None) -> MemoryPlan:
    """The memory plan of the training step `spec`: its config's model (its family's) on (batch_size, seq_len) tokens.

    Tile sizes are the config's (or the automatic ones, for `gpu_mb` of GPU
    memory), as `resolve_tiles` gives them; `workers` and `gpu_mb` default to
    the runtime's. With `grad_accum_steps`
    > 1 a step is that many micro-batches of (batch_size, seq_len): the plan is
    the one of a micro-batch that adds to gradients already there (the state
    is the same, activations are one micro-batch's). `finetune` (jnntile.lora.FineTune) says what trains:
    frozen parameters count once, without gradient or optimizer state. `update` is how the optimizer update
    meets the backward (jnntile.optim.UPDATE_MODES).
    """
    config, batch_size, seq_len, optimizer = spec.config, spec.batch_size, spec.seq_len, spec.optimizer
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: use one of {sorted(OPTIMIZER_STATES)}")
    if seq_len > config.max_positions:
        raise ValueError(f"seq_len={seq_len} is longer than the model's {config.max_positions} positions")
    if workers is None:
        workers = runtime.config().workers
    tiles = resolve_tiles(config, batch_size, seq_len, gpu_mb)
    return _plan_of(record.trace_step(config, batch_size, seq_len, tiles, spec.finetune), optimizer, workers,
                    spec.grad_accum_steps, spec.update, spec.shards, spec.keep_fetched, batch_size=batch_size,
                    seq_len=seq_len, tiles=tiles, config=config, finetune=spec.finetune)


def plan_model(build_model, loss, optimizer: str = "adamw", workers: int | None = None,
               grad_accum_steps: int = 1, update: str = "after") -> MemoryPlan:
    """The memory plan of one training step of any model built from jnntile's modules (see `record_step`):
    `build_model()` makes it, `loss(model)` runs its forward to the loss."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: use one of {sorted(OPTIMIZER_STATES)}")
    workers = runtime.config().workers if workers is None else workers
    return _plan_of(record.record_step(build_model, loss), optimizer, workers, grad_accum_steps, update)


def _plan_of(step: RecordedStep, optimizer: str, workers: int, grad_accum_steps: int, update: str,
             shards: int = 1, keep_fetched: bool = False, **shape) -> MemoryPlan:
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps} must be at least 1")
    if update not in UPDATE_MODES:
        raise ValueError(f"update={update!r}: use one of {', '.join(UPDATE_MODES)}")
    shard = sharding.shard_of(step, shards, optimizer, keep_fetched)
    params, whole = sum(shard.held(p) for p in step.params), sum(p.nbytes for p in step.params)
    activations, act_grads, peak, phase = timeline.simulate(step, optimizer, shard, grad_accum_steps > 1, update)
    largest, largest_name = _largest_of(step, optimizer, update)
    sent, received = shard.traffic(step, grad_accum_steps)
    return MemoryPlan(
        optimizer=optimizer, workers=workers, n_params=whole // F32, parameters=params,
        gradients=whole if grad_accum_steps > 1 else params,  # partial sums on every rank
        optimizer_state=params * OPTIMIZER_STATES[optimizer], inputs=sum(t.nbytes for t in step.inputs),
        compute_copies=sum(shard.held(t) for t in step.copies.values()),
        frozen_parameters=sum(shard.held(t) for t in step.frozen),
        activations=activations, activation_gradients=act_grads, peak=peak, peak_phase=phase,
        largest_task=largest, largest_task_name=largest_name, grad_accum_steps=grad_accum_steps, step=step,
        update=update, shards=shards, sent=sent, received=received,
        fetched=shard.kept or max((shard.fetched(*step.ops[i:i + 2]) for i in range(len(step.ops))), default=0),
        keep_fetched=shard.keep_fetched,
        **shape)
