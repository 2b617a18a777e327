"""The one way every op reaches the native code, and the lifetime of tiles within a step.

`call` passes tensor ids as an int32 buffer (so one compiled call serves every
tensor), the tokens of the tensors touched (so XLA orders the calls the way
StarPU must see them, DESIGN invariant 2) and static attributes, and returns
the fresh token. It also pins tensors created while tracing and remembers the
latest concrete token of each eager tensor so freeing waits for it.

Inside `jnntile.value_and_grad` a `Step` scope is active (see `step_scope`).
It does three things for memory (DESIGN invariant 7):

* Gradients start at zero lazily. The forward op that creates an activation,
  and `value_and_grad` for the arguments, only mark the gradient companion
  "zero pending"; the zero-fill is submitted right before the first backward
  call that touches it. Activation gradients then take no memory before the
  backward reaches them, and no tile of zeros is ever swapped out and back.
  A first call that writes every tile of such a gradient (`fresh_targets`)
  writes it instead of adding into zeros, and no fill is submitted at all.
* Calls on a gradient companion are chained in trace order (each depends on
  the tokens of every earlier call on it in this step), so the accumulations
  of several consumers run in one fixed order: the first one finds the
  zero-fill before it, and results are bitwise reproducible.
* `release` invalidates tensors after their last use: every backward rule
  releases the op's outputs, their gradients and its scratch residuals once its
  own tasks are submitted. The invalidation depends on the tokens of every call
  that touched those tensors in this step (including reads whose results are
  arrays, such as `to_array` of the loss or of an auxiliary output), so XLA
  cannot run it before one of them.

Outside a scope (plain `jax.grad`), gradients are zeroed eagerly by the forward
call and nothing is released.

Every differentiable op is declared once, from its forward and backward, by
`differentiable`.

Where JAX's default backend is a GPU (jax[cuda13] installed), the token graph
still runs on JAX's CPU device: the FFI targets are registered for the CPU
platform and read tensor ids and per-step values from host memory, while
StarPU, not XLA, runs the work on the GPU. Eager calls run under
`jax.default_device(cpu)` and their tokens are committed to the CPU device, so a
jitted step whose arguments hold Tensors is compiled for the CPU ("computation
follows data"); its loss comes back as a JAX array on the CPU device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jnntile.core import tensor as tensor_mod
from jnntile.core.ledger import LEDGER
from jnntile.core.tensor import Tensor, _Handle

TOKEN = jax.ShapeDtypeStruct((), jnp.float32)

# True when JAX's default device is not the CPU (see the module docstring).
COMMIT_TO_HOST = jax.default_backend() != "cpu"


def host_device():
    """JAX's CPU device, where the token graph runs."""
    return jax.devices("cpu")[0]


def on_host(fn, *args, **kwargs):
    """Calls `fn` (an FFI call or an array constructor) so that its eager result lives on the CPU device.

    Traced calls are placed by the jitted computation they belong to.
    """
    if not COMMIT_TO_HOST:
        return fn(*args, **kwargs)
    with jax.default_device(host_device()):
        out = fn(*args, **kwargs)
    return out if isinstance(out, jax.core.Tracer) else jax.device_put(out, host_device())

# Measurement switches for bench/memory.py. LAZY_ZERO = False zeroes gradients
# eagerly in the forward call; RELEASE = False keeps every activation and
# gradient (no invalidation by backward rules or optimizers), as before.
LAZY_ZERO = True
RELEASE = True


def _attr(value):
    if isinstance(value, bool):
        return np.int64(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    if isinstance(value, (tuple, list)):
        is_int = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
        return np.asarray(value, dtype=np.int64 if is_int else np.float64)
    raise TypeError(f"unsupported attribute value {value!r}")


def invalidated_error(handle: _Handle) -> ValueError:
    return ValueError(
        f"{handle!r} was invalidated (its memory released after its last use in a backward pass, or by an "
        "optimizer update for a gradient); it cannot be read until something writes it again. Read it inside the "
        "differentiated function, or pass keep_activations=True to jnntile.value_and_grad / "
        "jnntile.nn.value_and_grad to keep activations and their gradients")


def _ids(handles: Sequence[_Handle | None], writes: Sequence[_Handle] = ()) -> np.ndarray:
    """Tensor ids; None (a gradient nobody needs) becomes -1 and is skipped natively."""
    for handle in handles:
        if handle is not None:
            handle.check_alive()
            if LEDGER.invalidated(handle) and not any(handle is w for w in writes):
                raise invalidated_error(handle)
    return np.asarray([-1 if h is None else h.id for h in handles], dtype=np.int32)


# ---- the step scope ---------------------------------------------------------------------

@dataclasses.dataclass
class Step:
    """Bookkeeping of one differentiation, at trace time (see the module docstring)."""

    keep_activations: bool = False
    # handle -> tokens of the calls that touched it in this step (arrays for reads)
    touched: dict = dataclasses.field(default_factory=dict)
    # `value_and_grad(on_final=...)`: called once the gradient of a tensor is final, inside the backward
    # (`hand_over_final`); it submits what uses it (the optimizer update fused into the backward).
    on_final: Callable | None = None
    # handle -> the forward reads of it whose backward has not run yet: a differentiable op's, or a block's
    # of jnntile.remat (whose ops, run undifferentiated, count as one read until the block's backward).
    reads_left: dict = dataclasses.field(default_factory=dict)


_steps: list[Step] = []


@contextlib.contextmanager
def step_scope(keep_activations: bool = False, on_final: Callable | None = None):
    step = Step(keep_activations=bool(keep_activations), on_final=on_final)
    _steps.append(step)
    try:
        yield step
    finally:
        _steps.remove(step)


def current_step() -> Step | None:
    return _steps[-1] if _steps else None


def _dedup(tokens):
    seen, out = set(), []
    for t in tokens:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def record(token, *handles: _Handle | None) -> None:
    """Remembers that the call giving `token` touched `handles` in the current step."""
    step = current_step()
    if step is None or token is None:
        return
    for handle in handles:
        if handle is not None:
            step.touched.setdefault(handle, []).append(token)


def read_token(array) -> jax.Array:
    """A scalar float32 that depends on `array`: orders later calls after the read that produced it."""
    return jnp.ravel(array)[0].astype(jnp.float32)


def prepare(handles: Sequence[_Handle | None], tokens: Sequence, writes: Sequence[_Handle] = ()) -> list:
    """The tokens a call on `handles` must wait for, after submitting pending zero-fills.

    A gradient companion whose zero-fill is pending (jnntile.ledger) is filled
    first, unless this call writes it whole; a call on a gradient companion
    waits for every earlier call on it in this step.
    """
    tokens = list(tokens)
    step = current_step()
    for handle in handles:
        if handle is None:
            continue
        if LEDGER.take_zero(handle):
            if not any(handle is w for w in writes):
                deps = _dedup(tokens + (step.touched.get(handle, []) if step else []))
                fill_token = call("fill", [handle], deps, writes=[handle], value=0.0)
                tokens.append(fill_token)
        if handle.is_grad and step is not None:
            tokens.extend(step.touched.get(handle, []))
    return _dedup(tokens)


def after(token, *handles: _Handle):
    """Records `token` as the latest op on `handles` (pins them if tracing)."""
    tracing = isinstance(token, jax.core.Tracer)
    for handle in (h for h in handles if h is not None):
        if tracing:  # the compiled program refers to this id: keep it
            tensor_mod._pinned.add(handle)
        else:
            handle.last_token = token
    return token


def call(target: str, handles: Sequence[_Handle], tokens: Sequence, *,
         zero_grads: Sequence[_Handle] = (), inputs: Sequence = (), writes: Sequence[_Handle] = (), **attrs):
    """Calls FFI target `jnntile_<target>` on `handles` after `tokens`.

    `zero_grads` names tensors whose gradient companions start at zero here
    (lazily inside a step scope, see the module docstring); `inputs` are extra
    array operands placed after the id buffer: per-step values (a learning
    rate, a seed) that must not be attributes, because an attribute is compiled
    into the program (DESIGN invariant 4). `writes` names handles this call
    only writes (every tile, write-only) or invalidates: they may be
    invalidated before it, and hold data after it.
    """
    if tensor_mod.active_recording() is not None:  # the planner records ops (differentiable), not calls
        return on_host(jnp.zeros, (), jnp.float32)
    step = current_step()
    lazy = step is not None and LAZY_ZERO
    for handle in zero_grads:  # create the companions now, before the native call needs them
        grad = tensor_mod.grad_handle(handle)
        handle.grad_zeroed = True
        if lazy:
            LEDGER.zero_later(grad)
    if lazy:
        zero_grads = ()
    handles = list(handles)
    _ids(handles, writes)  # checks before anything is submitted
    tokens = prepare(handles, tokens, writes)
    ids = _ids(handles + list(zero_grads), writes)
    if zero_grads:
        attrs["zero_grads"] = len(zero_grads)
        for handle in zero_grads:
            LEDGER.written(handle.grad)
    if inputs:
        attrs["n_inputs"] = len(inputs)
    fn = jax.ffi.ffi_call(f"jnntile_{target}", TOKEN, has_side_effect=True)
    token = on_host(fn, ids, *inputs, *tokens, **{k: _attr(v) for k, v in attrs.items()})
    for handle in writes:
        (LEDGER.dropped if target == "invalidate" else LEDGER.written)(handle)
    record(token, *handles, *(h.grad for h in zero_grads))
    return after(token, *handles)


def join(*tokens):
    """One token that depends on all of `tokens` (for calls after several writes)."""
    tokens = _dedup(tokens)
    out = tokens[0]
    for t in tokens[1:]:
        out = out + t
    return out


def fresh_targets(*targets: _Handle | None) -> tuple[list[int], list[_Handle]]:
    """Which of a backward call's gradient targets hold nothing yet (their zero-fill is pending), each handle
    counted at its first place: the call writes those instead of adding into them, which saves the fill's
    pass over their tiles. Returns a 0/1 flag per target (the call's attribute) and the fresh handles (its
    `writes`)."""
    seen, flags = set(), []
    for target in targets:
        flags.append(int(target is not None and id(target) not in seen and LEDGER.zero_pending(target)))
        if target is not None:
            seen.add(id(target))
    return flags, [t for t, fresh in zip(targets, flags) if fresh]


def _taker(source: _Handle, targets: Sequence[_Handle | None], alphas: Sequence[float],
           fresh: Sequence[int]) -> int | None:
    """The index of the last target that can take source's tiles (accumulate's `source_dies`): it holds nothing
    yet, its alpha is 1 and its layout is source's; None when there is none."""
    for i in reversed(range(len(targets))):
        target = targets[i]
        if fresh[i] and float(alphas[i]) == 1.0 and \
                (target.dtype, target.shape, target.tile_shape) == (source.dtype, source.shape, source.tile_shape):
            return i
    return None


def accumulate(source: _Handle, targets: Sequence[_Handle | None], tokens: Sequence, alphas: Sequence[float], *,
               source_dies: bool = False):
    """targets[i] += alphas[i] * source (None skipped); a target still at zero is written instead.

    With `source_dies` (the caller releases source right after), the last target that holds nothing yet, with
    alpha 1 and source's layout, takes source's tiles instead of a copy of them (`swap_tiles`: no task, and the
    next backward call on it need not wait for one), and source the target's empty ones; the other targets
    then add the values from it.
    """
    fresh, written = fresh_targets(*targets)
    index = _taker(source, targets, alphas, fresh) if source_dies and releasing() else None
    if index is not None:
        targets = list(targets)
        taker, targets[index] = targets[index], None
        swapped = call("swap_tiles", [source, taker], tokens, writes=[taker])
        LEDGER.zero_later(source)  # it holds the taker's tiles now, which hold nothing
        if all(target is None for target in targets):
            return swapped
        source, tokens = taker, [swapped]  # the values are the taker's now
        fresh, written = fresh_targets(*targets)
    return call("accumulate", [source, *targets], tokens, alphas=[float(a) for a in alphas], fresh=fresh,
                writes=written)


def grad_target(t: Tensor) -> _Handle | None:
    """Where a backward op accumulates the gradient of `t`, or None if nobody zeroed it (a compute copy's
    gradient is its master's)."""
    if t.dtype not in tensor_mod.FLOAT_DTYPES or not (t.handle.master or t.handle).grad_zeroed:
        return None
    return tensor_mod.grad_handle(t.handle)


# ---- gradients final inside the backward ---------------------------------------------------------

def _tensor_leaves(tree) -> list[Tensor]:
    return [t for t in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Tensor)) if isinstance(t, Tensor)]


def _read_key(handle: _Handle) -> _Handle:
    return handle.master or handle  # a compute copy is read for its master


def count_reads(step: Step, args) -> None:
    """A forward read of every Tensor in `args` whose backward is still to come (see `hand_over_final`)."""
    for t in _tensor_leaves(args):
        key = _read_key(t.handle)
        step.reads_left[key] = step.reads_left.get(key, 0) + 1


def hand_over_final(step: Step, args, cotangents):
    """The `cotangents` of `args` after the backward of the forward reads `count_reads` counted for them:
    a differentiated Tensor with no forward read left has its final gradient, and `step.on_final` gets it
    (the Tensor, its token the cotangent's) and returns the token of what it submitted, or None when it
    leaves that tensor (an activation). The cotangent carries that token, and every other cotangent is
    ordered after it, so the rest of the backward is submitted after it."""
    final = set()
    for t in _tensor_leaves(args):
        key = _read_key(t.handle)
        step.reads_left[key] -= 1
        if step.reads_left[key] == 0 and t.handle.master is None and t.handle.grad_zeroed:
            final.add(id(t.handle))
    tokens = {}

    def hand_over(x, ct):
        if isinstance(x, Tensor) and isinstance(ct, Tensor) and id(x.handle) in final and x.handle not in tokens:
            token = step.on_final(x.with_token(ct.token))
            if token is not None:
                tokens[x.handle] = token
                return ct.with_token(token)
        return ct

    is_tensor = lambda x: isinstance(x, Tensor)  # noqa: E731
    cotangents = jax.tree.map(hand_over, tuple(args), tuple(cotangents), is_leaf=is_tensor)
    if not tokens:
        return cotangents
    after_all = join(*tokens.values())

    def order_after(x, ct):
        if not (isinstance(x, Tensor) and isinstance(ct, Tensor)) or x.handle in tokens:
            return ct
        return ct.with_token(join(ct.token, after_all))

    return tuple(jax.tree.map(order_after, tuple(args), cotangents, is_leaf=is_tensor))


# ---- differentiable ops ------------------------------------------------------------------

@dataclasses.dataclass
class RecordedOp:
    """One differentiable op of a recorded step (see `differentiable`): the tensors it reads, creates and
    keeps for its backward, and its largest task's bytes."""

    name: str
    inputs: list  # Tensors read
    outputs: list  # Tensors created
    residuals: list  # Tensors the forward creates only for the backward (scratch)
    task_bytes: int
    task: str


@dataclasses.dataclass
class RecordedRecomputation:
    """The recorded ops from `start` to here run undifferentiated in the forward and again in the backward
    (`jnntile.remat`): of their tensors only `output` lives between the two."""

    start: int
    output: Tensor


def one_tile_each(name: str, inputs, outputs, residuals) -> tuple[int, str]:
    """The default footprint: a task touches one tile of each input and output (elementwise ops, the
    products: an A, a B and a C tile)."""
    tensors = [*inputs, *outputs]
    return sum(tile_bytes(t) for t in tensors), f"{name} ({len(tensors)} tiles)"


def tile_bytes(t: Tensor) -> int:
    return math.prod(t.tile_shape) * np.dtype(t.dtype).itemsize


def differentiable(forward, backward, nondiff_argnums=(), *, name: str | None = None, footprint=one_tile_each):
    """The `jax.custom_vjp` function of an op, from its forward and backward rules.

    `forward(*args, zero_grad)` submits the op and returns `(out, residuals)`.
    `zero_grad` is True only in the forward of a differentiation: the output's
    gradient companion starts at zero there, and a residual that only the
    backward reads (layer norm's statistics) need be created only then. The
    plain call drops the residuals.
    `backward(*nondiff_args, residuals, g)` returns a cotangent per
    differentiable argument, as for `jax.custom_vjp`, and `nondiff_argnums`
    are the positions of the parameters fixed at trace time.
    `footprint(name, inputs, outputs, residuals)` gives the bytes and a description of the op's largest
    task (forward or backward), for the memory planner, which records the ops of a step with the
    forward of a differentiation (`jnntile.tensor.recording`).
    """
    @functools.partial(jax.custom_vjp, nondiff_argnums=nondiff_argnums)
    def op(*args):
        record = tensor_mod.active_recording()
        if record is not None:
            return _record(record, op_name, forward, footprint, args)
        return forward(*args, zero_grad=False)[0]

    def forward_rule(*args):
        out, residuals = forward(*args, zero_grad=True)
        step = current_step()
        if step is None or step.on_final is None:
            return out, (residuals, None)
        differentiated = tuple(a for i, a in enumerate(args) if i not in nondiff_argnums)
        count_reads(step, differentiated)
        return out, (residuals, differentiated)

    def backward_rule(*args):
        *fixed, (residuals, differentiated), g = args
        cotangents = backward(*fixed, residuals, g)
        if differentiated is None:
            return cotangents
        return hand_over_final(current_step(), differentiated, cotangents)

    op_name = name or forward.__module__.rpartition(".")[2]
    op.defvjp(forward_rule, backward_rule)
    return op


def _record(record, name: str, forward, footprint, args):
    out, residuals = forward(*args, zero_grad=True)
    is_tensor = lambda x: isinstance(x, Tensor)  # noqa: E731
    inputs = [t for t in jax.tree.leaves(args, is_leaf=is_tensor) if is_tensor(t)]
    outputs = [t for t in jax.tree.leaves(out, is_leaf=is_tensor) if is_tensor(t)]
    known = {t.handle for t in inputs + outputs}
    scratch = [t for t in jax.tree.leaves(residuals, is_leaf=is_tensor) if is_tensor(t) and t.handle not in known]
    task_bytes, task = footprint(name, inputs, outputs, scratch)
    record.append(RecordedOp(name, inputs, outputs, scratch, task_bytes, task))
    return out


# ---- invalidation -----------------------------------------------------------------------------

def invalidate(handles: Sequence[_Handle | None], tokens: Sequence):
    """Invalidates `handles` after `tokens` (and after every call on them in the current step).

    Returns the token of the invalidation. Handles already invalidated, freed
    or None are skipped; so are gradient companions whose zero-fill is still
    pending (they hold nothing) and compute copies (they live with their master).
    """
    step = current_step()
    targets = []
    for handle in handles:
        if handle is None or handle.freed or LEDGER.invalidated(handle) or any(handle is t for t in targets):
            continue
        if handle.master is not None:
            continue
        if LEDGER.zero_pending(handle):  # never filled: nothing to drop, and it starts at zero when next used
            continue
        targets.append(handle)
    if not targets:
        return join(*tokens)
    deps = list(tokens)
    if step is not None:
        for handle in targets:
            deps.extend(step.touched.pop(handle, []))
    return call("invalidate", targets, [join(*deps)], writes=targets)


def releasing() -> bool:
    """Whether `release` invalidates in the current step (one is active and keeps no activations)."""
    step = current_step()
    return step is not None and not step.keep_activations and RELEASE


def release(token, *tensors: Tensor | _Handle | None):
    """Called by backward rules after their last use of `tensors` (outputs and scratch residuals).

    Invalidates the tensors and their gradient companions unless the step keeps
    activations (or no step is active), and returns a token ordered after
    `token` and the invalidation: the backward returns it as its cotangents'
    token, so the invalidation is submitted promptly, before the next backward
    call, and StarPU never evicts the dead tiles to disk.
    """
    if not releasing():
        return token
    handles = []
    for t in tensors:
        handle = t.handle if isinstance(t, Tensor) else t
        if handle is None:
            continue
        handles.append(handle)
        if handle.grad is not None:
            handles.append(handle.grad)
    return invalidate(handles, [token])
