"""Recording a training step: the ops a model's forward submits, with the tensors each reads, creates and keeps
for its backward, and its largest task, recorded with the op layer submitting nothing (jnntile.tensor.recording).
The timeline (timeline.py), the swap model (swap.py) and the plan (plan.py) follow the step from this record."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import nnx

from jnntile.core import tensor as tensor_mod
from jnntile.models import TILE_AXES, families
from jnntile.ops import _ffi
from jnntile.ops import quant


@dataclasses.dataclass(frozen=True)
class T:
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
class Op:
    name: str
    inputs: list  # tensors read (activations, parameters, inputs)
    outputs: list  # activations created
    residuals: list  # scratch kept for the backward
    tasks: list  # (bytes, description) of the largest tasks, forward and backward
    # Recomputation (jnntile.remat): the region's output, on the region's last op.
    region_output: object = None
    region_start: int | None = None  # on the region's last op: the index of its first op


@dataclasses.dataclass
class RecordedStep:
    """The ops of one training step: parameters, token ids and the ops in forward order."""

    ops: list  # Op
    params: list  # T: the trained parameters
    inputs: list  # T
    copies: dict = dataclasses.field(default_factory=dict)  # parameter name -> its compute copy (T)
    frozen: list = dataclasses.field(default_factory=list)  # T: parameters read, never differentiated

    def gradient_owner(self, t: T) -> T:
        """The tensor whose gradient t's gradient is: a compute copy's is its parameter's (none for a frozen
        parameter's)."""
        return next(p for p in self.params + self.frozen if p.name == t.master) if t.kind == "copy" else t


def record_step(build_model, loss, trainable=nnx.Param) -> RecordedStep:
    """The ops of one training step of any model built from jnntile's modules and ops, recorded with the
    op layer submitting nothing and allocating nothing (jnntile.tensor.recording): `build_model()` makes
    the model, `loss(model)` runs its forward to the loss, as the training step does. Each differentiable
    op reports the tensors it reads, creates and keeps for its backward, and its largest task; the
    backward and the optimizer update follow from those (timeline.py, plan.py). Parameters outside the
    NNX filter `trainable` are frozen: read, without gradient or optimizer state."""
    recorded = []
    with tensor_mod.recording(recorded):
        model = build_model()
        loss(model)
    described: dict = {}

    def describe(t, kind, name):
        if t.handle not in described:
            described[t.handle] = T(name, t.shape, t.tile_shape, np.dtype(t.dtype).itemsize, kind,
                                     t.dtype in tensor_mod.FLOAT_DTYPES)
        return described[t.handle]

    trained = nnx.filterlib.to_predicate(trainable)
    variables = [(path, variable) for path, variable in nnx.iter_graph(model) if isinstance(variable, nnx.Param)]
    params, frozen = [], []
    for path, variable in variables:
        kind = "param" if trained(path, variable) else "frozen"
        name, value = ".".join(str(p) for p in path), variable.get_value()
        parts = ([(t, f"{name}.{part}") for part, t in value.stored()]
                 if isinstance(value, quant.Quantized) else [(value, name)])  # a quantized base: its stored bytes
        (params if kind == "param" else frozen).extend(describe(t, kind, part) for t, part in parts)
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
        ops.append(Op(name, [described[t.handle] for t in op.inputs], outputs, residuals,
                       [(op.task_bytes, op.task)]))
    # A region's start counts the markers before it too; ops are numbered without them.
    for number, region in enumerate(regions):
        start = region.start - number
        last = next(i for i in range(len(ops) - 1, start - 1, -1)
                    if any(t.handle == region.output.handle for t in recorded[i].outputs))
        ops[last].region_start, ops[last].region_output = start, described[region.output.handle]
    copies = {t.master: t for t in described.values() if t.kind == "copy"}
    return RecordedStep(ops, params, inputs, copies, frozen)


def trace_step(config, batch_size: int, seq_len: int, tiles, finetune=None) -> RecordedStep:
    """The recorded step of `config`'s model with `tiles` on (batch_size, seq_len) tokens; `finetune`
    (jnntile.lora.FineTune) says what trains."""
    config = dataclasses.replace(config, **{f"tile_{axis}": getattr(tiles, axis) for axis in TILE_AXES})
    ids = np.zeros((batch_size, seq_len), np.int32)
    lora_dropout = finetune is not None and finetune.lora is not None and finetune.lora.dropout > 0
    dropout_seed = np.int32(0) if config.dropout > 0 or lora_dropout else None  # training passes one

    def loss(model):
        return model(model.token_tensor(ids), model.token_tensor(ids), dropout_seed=dropout_seed)

    def build():
        return families.build(config, batch_size=batch_size, seq_len=seq_len)

    if finetune is None:
        return record_step(build, loss)
    return record_step(lambda: finetune.build(build, config.dtype)[0], loss, finetune.filter())
