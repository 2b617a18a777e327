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
`python -m jnntile.train` and this module's command line use it.

`python -m jnntile.memory --model gpt2 --batch-size 8 --seq-len 1024
--memory-limit-mb 4096` (or --model llama-1b, ...) prints the table and the verdict.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import heapq
import math
import sys

import numpy as np
from flax import nnx

from jnntile import flags, runtime
from jnntile.optim import UPDATE_MODES
from jnntile import tensor as tensor_mod
from jnntile.models import TILE_AXES
from jnntile.models import families
from jnntile.ops import _ffi
from jnntile.models import Tiles, resolve_tiles

MB = 2 ** 20
F32 = 4
I32 = 4
F64 = 8
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}  # parameter-sized tensors of state per parameter
# The tile axes (jnntile.models.TILE_AXES) in the order a suggestion shrinks them, and the smallest tile it
# proposes on each.
_SHRINK_ORDER = ("vocab", "hidden", "embd", "seq", "heads", "batch")
_MIN_TILE = {"vocab": 64, "hidden": 64, "embd": 32, "seq": 16, "heads": 1, "batch": 1}


class MemoryPlanError(ValueError):
    """The configuration cannot train under the given memory limit and swap."""


@dataclasses.dataclass(frozen=True)
class _T:
    """A tensor of the step: bytes, tile bytes, kind ("param", "frozen": a parameter nobody trains, "act",
    "scratch", "input", "copy": a parameter's persistent compute copy, written by the optimizer update)."""

    name: str
    shape: tuple
    tile: tuple
    itemsize: int
    kind: str
    floating: bool = True  # float32 or bfloat16: differentiated (token ids and positions are not)
    master: str = ""  # of a compute copy: its parameter's name (the copy's gradient is the parameter's)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def tile_bytes(self) -> int:
        return math.prod(min(t, n) for t, n in zip(self.tile, self.shape)) * self.itemsize

    @property
    def has_grad(self) -> bool:
        return self.kind in ("param", "act") and self.floating


@dataclasses.dataclass
class _Op:
    name: str
    inputs: list  # tensors read (activations, parameters, inputs)
    outputs: list  # activations created
    residuals: list  # scratch kept for the backward
    tasks: list  # (bytes, description) of the largest tasks, forward and backward
    # Recomputation (jnntile.remat): the region's output, on the region's last op.
    region_output: object = None
    region_start: int | None = None  # on the region's last op: the index of its first op


@dataclasses.dataclass
class _RecordedStep:
    """The ops of one training step: parameters, token ids and the ops in forward order."""

    ops: list  # _Op
    params: list  # _T: the trained parameters
    inputs: list  # _T
    copies: dict = dataclasses.field(default_factory=dict)  # parameter name -> its compute copy (_T)
    frozen: list = dataclasses.field(default_factory=list)  # _T: parameters read, never differentiated

    def gradient_owner(self, t: _T) -> _T:
        """The tensor whose gradient t's gradient is: a compute copy's is its parameter's (none for a frozen
        parameter's)."""
        return next(p for p in self.params + self.frozen if p.name == t.master) if t.kind == "copy" else t


def record_step(build_model, loss, trainable=nnx.Param) -> _RecordedStep:
    """The ops of one training step of any model built from jnntile's modules and ops, recorded with the
    op layer submitting nothing and allocating nothing (jnntile.tensor.recording): `build_model()` makes
    the model, `loss(model)` runs its forward to the loss, as the training step does. Each differentiable
    op reports the tensors it reads, creates and keeps for its backward, and its largest task; the
    backward and the optimizer update follow from those (`_simulate`, `_largest_of`). Parameters outside the
    NNX filter `trainable` are frozen: read, without gradient or optimizer state."""
    recorded = []
    with tensor_mod.recording(recorded):
        model = build_model()
        loss(model)
    described: dict = {}

    def describe(t, kind, name):
        if t.handle not in described:
            described[t.handle] = _T(name, t.shape, t.tile_shape, np.dtype(t.dtype).itemsize, kind,
                                     t.dtype in tensor_mod.FLOAT_DTYPES)
        return described[t.handle]

    trained = nnx.filterlib.to_predicate(trainable)
    variables = [(path, variable) for path, variable in nnx.iter_graph(model) if isinstance(variable, nnx.Param)]
    params, frozen = [], []
    for path, variable in variables:
        kind = "param" if trained(path, variable) else "frozen"
        (params if kind == "param" else frozen).append(describe(variable.get_value(), kind,
                                                                ".".join(str(p) for p in path)))
    ops, inputs = [], []
    regions = [r for r in recorded if isinstance(r, _ffi.RecordedRecomputation)]
    recorded = [r for r in recorded if not isinstance(r, _ffi.RecordedRecomputation)]
    for index, op in enumerate(recorded):
        name = f"{op.name} (op {index + 1} of {len(recorded)})"
        for t in op.inputs:
            if t.handle not in described:  # data written from the host (token ids, positions), not by an op
                inputs.append(describe(t, "input", f"{name} input"))
        outputs = [describe(t, "act", f"{name} output") for t in op.outputs if t.handle.master is None]
        for t in op.outputs:
            if t.handle.master is not None:
                master = described[t.handle.master].name
                described[t.handle] = dataclasses.replace(describe(t, "copy", f"{master} compute copy"), master=master)
                outputs.append(described[t.handle])
        residuals = [describe(t, "scratch", f"{name} scratch") for t in op.residuals]
        ops.append(_Op(name, [described[t.handle] for t in op.inputs], outputs, residuals,
                       [(op.task_bytes, op.task)]))
    # A region's start counts the markers before it too; ops are numbered without them.
    for number, region in enumerate(regions):
        start = region.start - number
        last = next(i for i in range(len(ops) - 1, start - 1, -1)
                    if any(t.handle == region.output.handle for t in recorded[i].outputs))
        ops[last].region_start, ops[last].region_output = start, described[region.output.handle]
    copies = {t.master: t for t in described.values() if t.kind == "copy"}
    return _RecordedStep(ops, params, inputs, copies, frozen)


def _trace_step(config, batch_size: int, seq_len: int, tiles, finetune=None) -> _RecordedStep:
    """The recorded step of `config`'s model with `tiles` on (batch_size, seq_len) tokens; `finetune`
    (jnntile.lora.FineTune) says what trains."""
    config = dataclasses.replace(config, **{f"tile_{axis}": getattr(tiles, axis) for axis in TILE_AXES})
    ids = np.zeros((batch_size, seq_len), np.int32)
    dropout_seed = np.int32(0) if config.dropout > 0 else None  # training passes one; no dropout without

    def loss(model):
        return model(model.token_tensor(ids), model.token_tensor(ids), dropout_seed=dropout_seed)

    def build():
        return families.build(config, batch_size=batch_size, seq_len=seq_len)

    if finetune is None:
        return record_step(build, loss)
    return record_step(lambda: finetune.build(build, config.dtype)[0], loss, finetune.filter())


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
    step: _RecordedStep = dataclasses.field(default=None, repr=False)  # what the numbers come from

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
        steady state (`_swap_traffic`), with or without global-norm `clip`ping and the `update` mode
        (default: the plan's; a speculative update clips, a fused one does not)."""
        update = update or self.update
        return _swap_traffic(self.step, self.optimizer, int(memory_limit_mb * MB), update,
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

    def verdict(self, memory_limit_mb: float, swap_size_mb: float = 0, gpu_mb: float = 0,
                cpu_kernels: bool = False) -> str:
        """A short sentence: "fits in RAM", "needs N MB of swap" or "cannot run: ...".

        With a GPU (gpu_mb: its memory limit, or its memory, in MB): "fits on the
        GPU", "fits on the GPU and N MB of host RAM", or the host verdicts for
        what the GPU cannot hold. cpu_kernels: CPU workers run kernels beside the
        GPU (placement "any", what a GPU memory limit resolves "auto" to). What
        they write stays in RAM until a GPU task reads it, and without swap
        nothing takes it back, so RAM must hold the whole peak: a 256 MB GPU
        limit beside 4 MB of RAM stopped on the emulated GPU, unlimited it ran.
        """
        problem = self._task_problem(memory_limit_mb, gpu_mb)
        if problem:
            return problem
        if gpu_mb and cpu_kernels and not swap_size_mb and self.peak > memory_limit_mb * MB:
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

    def check(self, memory_limit_mb: float, swap_size_mb: float = 0, gpu_mb: float = 0,
              cpu_kernels: bool = False) -> str:
        """Returns the verdict, or raises MemoryPlanError when the step cannot run (no swap given counts)."""
        text = self.verdict(memory_limit_mb, swap_size_mb, gpu_mb, cpu_kernels)
        if text.startswith("cannot run"):
            raise MemoryPlanError(text)
        if text.startswith("needs") and not swap_size_mb:
            raise MemoryPlanError(f"cannot run without swap: the step {text} under a memory limit of "
                                  f"{memory_limit_mb:g} MB (peak {self.peak / MB:.0f} MB); give --swap-dir and "
                                  f"--swap-size-mb {self.swap_needed_mb(memory_limit_mb, gpu_mb)}, or raise "
                                  "--memory-limit-mb")
        return text

    def task_bytes_target(self, memory_limit_mb: float, gpu_mb: float = 0) -> float:
        """The most bytes one task may need: every worker runs one task at once in RAM, and a GPU holds
        runtime.gpu_tasks_in_flight() tasks."""
        target = memory_limit_mb * MB / self.workers
        return min(target, gpu_mb * MB / runtime.gpu_tasks_in_flight()) if gpu_mb else target

    def smaller_tiles(self, memory_limit_mb: float, gpu_mb: float = 0, axes=_SHRINK_ORDER) -> dict | None:
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
        return " ".join(f"--tile-{axis} {tiles[axis]}" for axis in _SHRINK_ORDER if tiles[axis] != current[axis])

    def rows(self) -> list[tuple[str, float, str]]:
        """(what, MB, note) rows of the table."""
        return [
            ("parameters", self.parameters / MB, f"{self.n_params:,} float32" + (
                ", trained" if self.frozen_parameters else "")),
            *([("frozen parameters", self.frozen_parameters / MB, "no gradient, no optimizer state")]
              if self.frozen_parameters else []),
            ("gradients", self.gradients / MB, "freed by the optimizer update" + (
                ", kept between micro-batches" if self.grad_accum_steps > 1 else "")),
            ("optimizer state", self.optimizer_state / MB, self.optimizer),
            *([("compute copies", self.compute_copies / MB, "bfloat16 weights, written by the update")]
              if self.compute_copies else []),
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
        lines = [] if t is None else [
            f"batch {self.batch_size} x seq {self.seq_len}{micro}; tiles batch={t.batch} seq={t.seq} "
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
    return _largest_of(_trace_step(config, batch_size, seq_len, Tiles(**dict(tiles)), finetune), optimizer, update)


def _largest_of(step: _RecordedStep, optimizer: str, update: str = "after"):
    tasks = [task for op in step.ops for task in op.tasks]
    n_state = OPTIMIZER_STATES[optimizer]
    fused = _fused_at(step) if update == "speculative" else {}
    apart = {p.name for params in fused.values() for p in params}
    for p in step.params:  # optimizer update: parameter, gradient, states and compute copy, one tile each
        copy = step.copies[p.name].tile_bytes if p.name in step.copies else 0
        tiles = 2 + n_state + (1 + n_state if p.name in apart else 0)  # a speculative one writes p and states apart
        tasks.append((tiles * p.tile_bytes + copy, f"{optimizer} update of a {p.name} tile {_tile_str(p)}"))
    return max(tasks, key=lambda t: t[0])


def _fused_at(step: _RecordedStep) -> dict:
    """Where a fused update updates each parameter inside the backward (jnntile.grad's `on_final`): backward
    op index -> the parameters whose gradient is final once the backward reached it, the backward of the
    first op that reads them (a compute copy's maker included), or, when that op is in a recomputed region,
    of the region's first op (a region's backward is one piece)."""
    region_start = {}
    for end, op in enumerate(step.ops):
        if op.region_output is not None:
            for index in range(op.region_start, end + 1):
                region_start[index] = op.region_start
    first_reader = {}
    for index, op in enumerate(step.ops):
        for t in op.inputs:
            if t.kind == "param":
                first_reader.setdefault(t.name, region_start.get(index, index))
    fused = collections.defaultdict(list)
    for p in step.params:
        if p.name in first_reader:
            fused[first_reader[p.name]].append(p)
    return fused


def _tile_str(t: _T) -> str:
    return "(" + ", ".join(str(min(a, n)) for a, n in zip(t.tile, t.shape)) + ")"


def _simulate(step: _RecordedStep, optimizer: str, accumulating: bool = False, update: str = "after"):
    """Walks the step's timeline; returns (activations, activation-gradient peak, peak, phase).

    `accumulating`: a micro-batch after the first of a step, whose parameter
    gradients hold the earlier micro-batches' sum from the start (the first
    starts them lazily, as a step without accumulation does). `update`: a fused
    update frees the gradients of the parameters it updates in the backward; a
    speculative one also holds their next values and states until the step ends.
    """
    n_state = OPTIMIZER_STATES[optimizer]
    fused = _fused_at(step) if update != "after" else {}
    params = sum(p.nbytes for p in step.params)
    base = (params * (1 + n_state + accumulating) + sum(t.nbytes for t in step.inputs)
            + sum(t.nbytes for t in step.copies.values()) + sum(t.nbytes for t in step.frozen))
    live = 0  # activations, residuals, and gradients allocated so far
    peak, phase = base, "start"

    # Recomputed regions, by the index of their last op: what their ops create but the region's output,
    # freed after the region's forward and made again at its backward.
    made_again = {end: sum(t.nbytes for op in step.ops[last.region_start:end + 1]
                           for t in op.outputs + op.residuals if t is not last.region_output and t.kind != "copy")
                  for end, last in enumerate(step.ops) if last.region_output is not None}
    for index, op in enumerate(step.ops):  # forward
        live += sum(t.nbytes for t in op.outputs + op.residuals if t.kind != "copy")
        if base + live > peak:
            peak, phase = base + live, "end of forward"
        live -= made_again.get(index, 0)
    activations = live
    grads = {p.name for p in step.params} if accumulating else set()
    act_grad_live = act_grad_peak = 0
    # A recomputed region runs its forward again once its output's gradient is submitted, while StarPU may
    # still run the backward of the region after it: two regions' activations are alive at once.
    backward_order = sorted(made_again, reverse=True)
    recomputed = set()
    for index in reversed(range(len(step.ops))):  # backward: the op's tasks need its inputs' and outputs' gradients
        op = step.ops[index]
        if index in made_again:  # the forward again, with the next region's overlapping it
            position = backward_order.index(index)
            for end in backward_order[position:position + 2]:
                if end not in recomputed:
                    recomputed.add(end)
                    live += made_again[end] + step.ops[end].region_output.nbytes  # its output made again
        for t in map(step.gradient_owner, op.inputs + op.outputs):
            if t.has_grad and t.name not in grads:
                grads.add(t.name)
                live += t.nbytes
                if t.kind == "act":
                    act_grad_live += t.nbytes
        act_grad_peak = max(act_grad_peak, act_grad_live)
        if base + live > peak:
            peak, phase = base + live, f"backward of {op.name}"
        if op.region_output is not None:  # the recomputed output goes with the first one
            live -= op.region_output.nbytes
        for t in op.outputs + op.residuals:  # released after the op's backward (a compute copy stays)
            if t.kind != "copy":
                live -= t.nbytes
            if t.name in grads:
                live -= t.nbytes
                if t.kind == "act":
                    act_grad_live -= t.nbytes
        for p in fused.get(index, []):  # updated here: the gradient dies, a speculative update's values wait
            live -= p.nbytes
            if update == "speculative":
                live += p.nbytes * (1 + n_state) + (step.copies[p.name].nbytes if p.name in step.copies else 0)
    for p in step.params:  # parameters nobody differentiated still get a zero gradient
        if p.name not in grads:
            live += p.nbytes
    if base + live > peak:
        peak, phase = base + live, "optimizer update"
    return activations, act_grad_peak, peak, phase


_MAX_CHUNKS = 64  # a tensor counts as at most this many tiles in the swap model (a bound on its work)


def _chunks(t: _T) -> list:
    n = min(_MAX_CHUNKS, max(1, t.nbytes // max(1, t.tile_bytes)))
    return [((t.name, i), t.nbytes // n) for i in range(n)]


def _step_accesses(step: _RecordedStep, optimizer: str, mode: str, clip: bool, grad_accum_steps: int) -> list:
    """The tile accesses of one training step, in the order the runtime submits them: (tile, bytes, reads,
    writes) for a use, (tile, 0, False, False) when the tile dies. Forward: each op reads its inputs and
    writes its outputs and residuals; a recomputed region's intermediates die at its end. Backward, in
    reverse: a recomputed region runs its forward again first, then each op reads its inputs, residuals and
    its outputs' gradients, adds into its inputs' gradients, and its outputs, residuals and their gradients
    die. The optimizer reads a parameter, its gradient and state and writes them back after the backward,
    after the global norm read every gradient when it `clip`s. A fused update (`mode`, one of
    jnntile.optim.UPDATE_MODES) updates each parameter inside the backward, once its gradient is final
    (`_fused_at`), and the gradient dies there; a speculative one reads the parameter and its states there
    and writes the next ones apart, and after the backward (the norm not clipping) the old ones die and the
    new ones take their place (`_RENAME`). A model in bfloat16 converts each weight into its compute copy
    once (the update writes the copy with the parameter): the convert reads and writes nothing in a step,
    and the products that read the copy add into the parameter's gradient."""
    accesses = []
    state = {p.name: [dataclasses.replace(p, name=f"{p.name} {kind}", kind="state")
                      for kind in ("moment 1", "moment 2")[:OPTIMIZER_STATES[optimizer]]] for p in step.params}
    grad = {}

    def use(t: _T, reads: bool = True, writes: bool = False) -> None:
        accesses.extend((key, nbytes, reads, writes) for key, nbytes in _chunks(t))

    def free(t: _T) -> None:
        accesses.extend((key, 0, False, False) for key, _ in _chunks(t))

    def grad_of(t: _T) -> _T:
        if t.name not in grad:
            grad[t.name] = dataclasses.replace(t, name=f"{t.name} gradient")
        return grad[t.name]

    def update(p: _T) -> None:
        use(p, writes=True)
        use(grad_of(p))
        for s in state[p.name]:
            use(s, writes=True)
        if p.name in step.copies:
            use(step.copies[p.name], reads=False, writes=True)
        free(grad.pop(p.name))

    def kept(p: _T) -> list:  # what a speculative update writes apart: the parameter, its states and copy
        return [p, *state[p.name], *([step.copies[p.name]] if p.name in step.copies else [])]

    def update_apart(p: _T) -> None:
        use(grad_of(p))
        for t in kept(p):
            if t.kind != "copy":
                use(t)
            use(dataclasses.replace(t, name=f"{t.name} next"), reads=False, writes=True)
        free(grad.pop(p.name))

    def commit(p: _T) -> None:
        for t in kept(p):
            free(t)
            after = dataclasses.replace(t, name=f"{t.name} next")
            accesses.extend((next_key, _RENAME, key, False) for (key, _), (next_key, _) in zip(_chunks(t),
                                                                                               _chunks(after)))

    def makes_copy(op: _Op) -> bool:
        return any(t.kind == "copy" for t in op.outputs)

    def forward(ops) -> None:
        for op in ops:
            if makes_copy(op):  # fresh: no task
                continue
            for t in op.inputs:
                use(t)
            for t in op.outputs + op.residuals:
                use(t, reads=False, writes=True)

    fused_at = _fused_at(step) if mode != "after" else {}
    in_backward = {p.name for params in fused_at.values() for p in params}
    for micro_batch in range(grad_accum_steps):
        last = micro_batch == grad_accum_steps - 1
        for index, op in enumerate(step.ops):
            forward([op])
            if op.region_output is not None:
                for made in step.ops[op.region_start:index + 1]:
                    for t in made.outputs + made.residuals:
                        if t is not op.region_output and t.kind != "copy":
                            free(t)
        for index in reversed(range(len(step.ops))):
            op = step.ops[index]
            if op.region_output is not None:
                forward(step.ops[op.region_start:index + 1])
            if not makes_copy(op):  # (whose backward submits nothing: the products added into the master's)
                for t in op.inputs + op.residuals:
                    use(t)
                for t in op.outputs:
                    if t.has_grad:
                        use(grad_of(t))
                for t in map(step.gradient_owner, op.inputs):
                    if t.has_grad:
                        use(grad_of(t), writes=True)
            for t in op.outputs + op.residuals:
                if t.kind != "copy":
                    free(t)
                if t.name in grad:
                    free(grad.pop(t.name))
            for p in fused_at.get(index, []) if last else []:
                (update_apart if mode == "speculative" else update)(p)
    after = [p for p in step.params if p.name not in in_backward]
    if clip:
        for p in after:
            use(grad_of(p))
    for p in after:
        update(p)
    if mode == "speculative":
        for p in step.params:
            if p.name in in_backward:
                commit(p)
    return accesses


_RENAME = -1  # the bytes of an access that renames a tile: (old key, _RENAME, new key, False)


def _swap_traffic(step: _RecordedStep, optimizer: str, capacity: int, update: str, clip: bool,
                  grad_accum_steps: int = 1) -> tuple[int, int]:
    """(bytes written to swap, bytes read from it) by a training step in steady state with `capacity` bytes
    of RAM (the second of three, so that the first's cold start and the last's missing future do not
    count): the step's tile accesses (`_step_accesses`) replayed through RAM as a cache of the swap that
    evicts as StarPU does (`_starpu_allocate_interface`, src/datawizard/memalloc.c): a tile that does not fit
    takes over the memory of the least recently used clean tile of its size (one whose copy on disk is
    current, so nothing is written), and when there is none StarPU frees twice its size in least recently
    used order. A dirty tile evicted is written to swap; one read while not in RAM is read back; one written
    whole (a new output) needs no read; a dead tile leaves RAM and swap at no cost. A tile renamed (a
    speculative update's result becoming the parameter) keeps its place and state. (Plain LRU predicted
    15-30% fewer bytes than StarPU moved with the update fused; this is within 10% at batch 1 x 64 and 30%
    low at 4 x 1024: docs/memory.md.)
    """
    one_step = _step_accesses(step, optimizer, update, clip, grad_accum_steps)
    accesses = one_step * 3
    resident, dirty, on_disk, heap = {}, set(), set(), []  # resident: tile -> (bytes, index of its last use)
    clean = collections.defaultdict(list)  # bytes -> heap of (last use, tile) of clean tiles of that size
    used = written = read = 0

    def current(entry) -> bool:  # not stale: the tile was neither used again nor dropped since
        last_use, tile = entry
        return resident.get(tile, (0, None))[1] == last_use

    def evict(victim) -> tuple[int, int]:
        """Drops `victim` from RAM: (its bytes, the bytes written to swap for it)."""
        victim_bytes = resident.pop(victim)[0]
        on_disk.add(victim)
        if victim in dirty:
            dirty.discard(victim)
            return victim_bytes, victim_bytes
        return victim_bytes, 0

    for i, (key, nbytes, reads, writes) in enumerate(accesses):
        counted = len(one_step) <= i < 2 * len(one_step)
        if nbytes == _RENAME:
            new_key = reads
            for where in (dirty, on_disk):
                if key in where:
                    where.discard(key)
                    where.add(new_key)
            if key in resident:
                resident[new_key] = resident.pop(key)
                heapq.heappush(heap, (resident[new_key][1], new_key))
                if new_key not in dirty:
                    heapq.heappush(clean[resident[new_key][0]], (resident[new_key][1], new_key))
            continue
        if not nbytes:  # the tile dies: nothing to write or read
            used -= resident.pop(key, (0, 0))[0]
            dirty.discard(key)
            on_disk.discard(key)
            continue
        if key not in resident and used + nbytes > capacity:
            # StarPU takes over the memory of the least recently used clean tile of the same size (one with a
            # copy on disk: nothing to write), and without one frees twice the size in least-recently-used order.
            same_size = clean[nbytes]
            while same_size and not (current(same_size[0]) and same_size[0][1] not in dirty):
                heapq.heappop(same_size)
            if same_size:
                used -= evict(heapq.heappop(same_size)[1])[0]
            else:
                freed = 0
                while heap and (used + nbytes > capacity or freed < 2 * nbytes):
                    entry = heapq.heappop(heap)
                    if current(entry):
                        victim_bytes, victim_written = evict(entry[1])
                        used -= victim_bytes
                        freed += victim_bytes
                        written += victim_written if counted else 0
        if key not in resident:
            if reads and key in on_disk:
                read += nbytes if counted else 0
            used += nbytes
        resident[key] = (nbytes, i)
        heapq.heappush(heap, (i, key))
        if writes:
            dirty.add(key)
            on_disk.discard(key)
        elif key not in dirty:
            heapq.heappush(clean[nbytes], (i, key))
    return written, read


def plan(config, batch_size: int, seq_len: int, optimizer: str = "adamw", workers: int | None = None,
         grad_accum_steps: int = 1, finetune=None, update: str = "after", gpu_mb: float | None = None) -> MemoryPlan:
    """The memory plan of one training step of `config`'s model (its family's) on (batch_size, seq_len) tokens.

    Tile sizes are the config's (or the automatic ones, for `gpu_mb` of GPU
    memory), as `resolve_tiles` gives them; `workers` and `gpu_mb` default to
    the runtime's. With `grad_accum_steps`
    > 1 a step is that many micro-batches of (batch_size, seq_len): the plan is
    the one of a micro-batch that adds to gradients already there (the state
    is the same, activations are one micro-batch's). `finetune` (jnntile.lora.FineTune) says what trains:
    frozen parameters count once, without gradient or optimizer state. `update` is how the optimizer update
    meets the backward (jnntile.optim.UPDATE_MODES).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: use one of {sorted(OPTIMIZER_STATES)}")
    if seq_len > config.max_positions:
        raise ValueError(f"seq_len={seq_len} is longer than the model's {config.max_positions} positions")
    if workers is None:
        workers = runtime.config().workers
    tiles = resolve_tiles(config, batch_size, seq_len, gpu_mb)
    return _plan_of(_trace_step(config, batch_size, seq_len, tiles, finetune), optimizer, workers, grad_accum_steps,
                    update, batch_size=batch_size, seq_len=seq_len, tiles=tiles, config=config, finetune=finetune)


def plan_model(build_model, loss, optimizer: str = "adamw", workers: int | None = None,
               grad_accum_steps: int = 1, update: str = "after") -> MemoryPlan:
    """The memory plan of one training step of any model built from jnntile's modules (see `record_step`):
    `build_model()` makes it, `loss(model)` runs its forward to the loss."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: use one of {sorted(OPTIMIZER_STATES)}")
    workers = runtime.config().workers if workers is None else workers
    return _plan_of(record_step(build_model, loss), optimizer, workers, grad_accum_steps, update)


def _plan_of(step: _RecordedStep, optimizer: str, workers: int, grad_accum_steps: int, update: str,
             **shape) -> MemoryPlan:
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps} must be at least 1")
    if update not in UPDATE_MODES:
        raise ValueError(f"update={update!r}: use one of {', '.join(UPDATE_MODES)}")
    params = sum(p.nbytes for p in step.params)
    activations, act_grads, peak, phase = _simulate(step, optimizer, grad_accum_steps > 1, update)
    largest, largest_name = _largest_of(step, optimizer, update)
    return MemoryPlan(
        optimizer=optimizer, workers=workers, n_params=params // F32, parameters=params, gradients=params,
        optimizer_state=params * OPTIMIZER_STATES[optimizer], inputs=sum(t.nbytes for t in step.inputs),
        compute_copies=sum(t.nbytes for t in step.copies.values()),
        frozen_parameters=sum(t.nbytes for t in step.frozen),
        activations=activations, activation_gradients=act_grads, peak=peak, peak_phase=phase,
        largest_task=largest, largest_task_name=largest_name, grad_accum_steps=grad_accum_steps, step=step,
        update=update, **shape)


def choose_remat(config, batch_size: int, seq_len: int, memory_limit_mb: float, optimizer: str = "adamw",
                 workers: int | None = None, finetune=None, update: str = "after", grad_accum_steps: int = 1,
                 gpu_mb: float | None = None):
    """`config` with remat="auto" resolved. "none" when the step fits the memory limit without recomputation
    (beside `gpu_mb` of GPU memory, default the runtime's: what the GPU holds needs no RAM);
    else "block" with the fewest blocks recomputed (`remat_blocks`) that make it fit; when even all of them do
    not, all blocks or none, whichever the planner predicts to move fewer bytes to and from swap
    (`MemoryPlan.swap_traffic`). Returns (config, note); the note says what was chosen and why ("" when the
    config chose itself)."""
    if config.remat != "auto":
        return config, ""
    gpu_mb = runtime.gpu_memory_mb() if gpu_mb is None else gpu_mb
    limit = memory_limit_mb * 2**20
    peak = "planned peak" + (f" beyond the GPU's {gpu_mb:.0f} MB" if gpu_mb else "")
    capacity_mb = memory_limit_mb + gpu_mb  # what swap traffic is predicted against: GPU and RAM together

    @functools.cache  # each plan records the whole model
    def plan_with(blocks: int) -> MemoryPlan:
        chosen = dataclasses.replace(config, remat="block" if blocks else "none", remat_blocks=blocks or None)
        return plan(chosen, batch_size, seq_len, optimizer, workers, grad_accum_steps, finetune, update, gpu_mb)

    def peak_with(blocks: int) -> int:  # what host memory must hold
        return plan_with(blocks).host_bytes(gpu_mb)

    plain_peak = peak_with(0)
    plain = dataclasses.replace(config, remat="none", remat_blocks=None)
    if plain_peak <= limit:
        return plain, (f"--remat auto: none (the step's {peak}, {plain_peak / 2**20:.0f} MB, fits the "
                       f"{memory_limit_mb:.0f} MB limit)")
    n_blocks = config.n_blocks
    all_peak = peak_with(n_blocks)
    if all_peak > limit:  # swap either way: the fewer bytes moved
        moved = {blocks: sum(plan_with(blocks).swap_traffic(capacity_mb)) for blocks in (0, n_blocks)}
        if moved[0] <= moved[n_blocks]:
            return plain, (f"--remat auto: none (the step swaps either way, and recomputation would not lower "
                           f"the predicted swap traffic of {_amount(moved[0])} per step)")
        chosen = dataclasses.replace(config, remat="block", remat_blocks=n_blocks)
        return chosen, (f"--remat auto: block, all {n_blocks} blocks recomputed in the backward (the step swaps "
                        f"either way: swap traffic per step predicted {_instead(moved[n_blocks], moved[0])}; {peak} "
                        f"{_instead(all_peak, plain_peak)}, under the {memory_limit_mb:.0f} MB limit)")
    low, high = 1, n_blocks  # the fewest blocks that fit: the peak falls as blocks are added
    while low < high:
        middle = (low + high) // 2
        if peak_with(middle) <= limit:
            high = middle
        else:
            low = middle + 1
    chosen = dataclasses.replace(config, remat="block", remat_blocks=low)
    return chosen, (f"--remat auto: block, the first {low} of {n_blocks} blocks recomputed in the backward "
                    f"({peak} {peak_with(low) / 2**20:.0f} MB instead of {plain_peak / 2**20:.0f} MB under "
                    f"the {memory_limit_mb:.0f} MB limit)")


def _amount(n_bytes: float) -> str:
    """Bytes in GB from 1 GB up, else in MB, to a tenth."""
    return f"{n_bytes / 2**30:,.1f} GB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MB"


def _instead(chosen: float, without: float) -> str:
    """"A instead of B", two byte counts (`_amount`), or "A, about as much as without" where they print alike."""
    chosen_text, without_text = _amount(chosen), _amount(without)
    return (f"{chosen_text} instead of {without_text}" if chosen_text != without_text
            else f"{chosen_text}, about as much as without")


def fit_tiles(config, batch_size: int, seq_len: int, memory_limit_mb: float, gpu_mb: float = 0,
              optimizer: str = "adamw", workers: int | None = None, finetune=None, update: str = "after"):
    """`config` with its automatic tile sizes shrunk where the largest tasks would not fit the limits.

    Returns (config, note). The note says which tiles were chosen and why, and
    is "" when the automatic tiles fit. Tile sizes the config sets (--tile-*
    flags) never change: when shrinking the automatic ones cannot make every
    task fit, the config comes back as it was and `plan(...).check` refuses it
    with a suggestion.
    """
    memory_plan = plan(config, batch_size, seq_len, optimizer, workers, finetune=finetune, update=update,
                       gpu_mb=gpu_mb)
    problem = memory_plan.task_fit_problem(memory_limit_mb, gpu_mb)
    if problem is None:
        return config, ""
    automatic = tuple(axis for axis in _SHRINK_ORDER if getattr(config, f"tile_{axis}") is None)
    tiles = memory_plan.smaller_tiles(memory_limit_mb, gpu_mb, automatic)
    if tiles is None:
        return config, ""
    before = dataclasses.asdict(memory_plan.tiles)
    changed = {axis: tiles[axis] for axis in automatic if tiles[axis] != before[axis]}
    fitted = dataclasses.replace(config, **{f"tile_{axis}": size for axis, size in changed.items()})
    shrunk = ", ".join(f"{axis} {before[axis]} -> {size}" for axis, size in changed.items())
    return fitted, f"automatic tiles shrunk ({shrunk}): with the default ones {problem}"


# ---- command line -------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, batch, tile and runtime flags of a training step (`python -m jnntile.train` takes the same)."""
    parser.add_argument("--model", choices=list(families.PRESETS), default="tiny",
                        help="a preset of any family (jnntile/models/<family>/config.py)")
    for name in ("n-layer", "n-head", "n-embd", "vocab-size", "n-positions"):
        parser.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    parser.add_argument("--dropout", type=float, default=None, help="override the preset")
    flags.add_batch_flags(parser, batch_size=8)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's positions")
    flags.add_execution_flags(parser)
    flags.add_finetune_flags(parser)
    flags.add_runtime_flags(parser)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    flags.add_update_flags(parser)


def config_from_args(args):
    """The config the flags describe (preset, size overrides and tiles)."""
    overrides = families.size_overrides(args.model, max_positions=getattr(args, "n_positions", None))
    if getattr(args, "vocab_size", None) is not None:
        overrides["vocab_size"] = args.vocab_size
    return flags.preset_config(args, **overrides, **flags.execution_settings(args))


def plan_from_args(args) -> MemoryPlan:
    """The plan of the step the flags describe, automatic tiles fitted to the limits (see `fit_tiles`); flags
    that `python -m jnntile.train` refuses are refused alike (`flags.check_step_flags`)."""
    flags.check_step_flags(args)
    args = flags.one_batch_per_step(args)
    config = config_from_args(args)
    seq_len = args.seq_len if getattr(args, "seq_len", None) is not None else config.max_positions
    if seq_len > config.max_positions:  # as python -m jnntile.train does: the positions grow to the sequence
        config = dataclasses.replace(config, **families.size_overrides(args.model, max_positions=seq_len))
    optimizer, workers = getattr(args, "optimizer", "adamw"), getattr(args, "workers", None)
    limit, _, gpu, _ = limits_from_args(args)
    finetune = flags.finetune_settings(args) if hasattr(args, "lora_rank") else None
    update = flags.update_mode(args) if hasattr(args, "fused_update") else "after"
    config, remat_note = choose_remat(config, args.batch_size, seq_len, limit, optimizer, workers, finetune, update,
                                      args.grad_accum_steps, gpu)
    config, note = fit_tiles(config, args.batch_size, seq_len, limit, gpu, optimizer, workers, finetune, update)
    memory_plan = plan(config, args.batch_size, seq_len, optimizer, workers, args.grad_accum_steps, finetune, update,
                       gpu)
    memory_plan.tiles_note = "\n".join(n for n in (note, remat_note) if n)
    return memory_plan


def limits_from_args(args) -> tuple[int, int, int, bool]:
    """(memory limit MB, swap MB, GPU MB, CPU kernels) the flags give, runtime defaults filling the gaps; 0 means
    none. CPU kernels: CPU workers run kernels beside the GPU (see `MemoryPlan.verdict`).

    --swap-size-mb without --swap-dir plans with that much swap, and
    --gpu-memory-limit-mb with that much GPU memory (what-if); --cuda-workers 0 with none.
    """
    config = runtime.config()
    if getattr(args, "gpu_memory_limit_mb", None):
        config = dataclasses.replace(config, gpu_memory_limit_mb=args.gpu_memory_limit_mb)
    limit = args.memory_limit_mb if getattr(args, "memory_limit_mb", None) is not None else config.memory_limit_mb
    swap = getattr(args, "swap_size_mb", None)
    if swap is None:
        swap = config.swap_size_mb if getattr(args, "swap_dir", None) else 0
    gpu = getattr(args, "gpu_memory_limit_mb", None)
    if getattr(args, "cuda_workers", None) == 0:
        gpu = 0  # CPU workers only (--cuda-workers 0): the GPU's memory holds nothing
    elif gpu is None:
        gpu = runtime.gpu_memory_mb(config)
    return limit, swap, gpu, bool(gpu) and runtime.cpu_kernels_beside_gpu(config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jnntile.memory",
                                     description="What one training step needs in memory, and whether it "
                                                 "runs on the GPU, in RAM or with disk swap under the limits.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        memory_plan = plan_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    limit, swap_mb, gpu_mb, cpu_kernels = limits_from_args(args)
    config = memory_plan.config
    print(f"{config.describe()} ({args.model}), {args.optimizer}")
    if memory_plan.tiles_note:
        print(memory_plan.tiles_note)
    print(memory_plan.table())
    gpu = f"GPU memory {gpu_mb} MB, " if gpu_mb else ""
    swap = f" and {swap_mb} MB of swap" if swap_mb else ""
    verdict = memory_plan.verdict(limit, swap_mb, gpu_mb, cpu_kernels)
    print(f"{gpu}memory limit {limit} MB{swap}: {verdict}")
    if verdict.startswith("needs"):
        written, read = memory_plan.swap_traffic(limit, args.grad_clip > 0)
        how = {"after": "the update after the backward", "fused": "the update fused into the backward",
               "speculative": "the update fused into the backward, speculative until the norm is known "
                              "(when it does not clip)"}[memory_plan.update]
        print(f"swap traffic per step, predicted: {written / MB:,.0f} MB written and {read / MB:,.0f} MB read, "
              f"with {how}")
    backend = args.swap_backend or runtime.config().swap_backend
    if verdict.startswith("needs") and backend == "unistd":
        print(f"swap backend unistd: the kernel's page cache may also hold up to "
              f"{memory_plan.swap_needed_mb(limit, gpu_mb)} MB of the swap in RAM (unistd_o_direct bypasses it)")
    return 1 if verdict.startswith("cannot run") else 0


if __name__ == "__main__":
    sys.exit(main())
