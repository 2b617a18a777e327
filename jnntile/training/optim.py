"""Optax transformations that update tiled parameters in place on StarPU.

Each is an `optax.GradientTransformation` (pure `init` / `update`) composable
with `optax.chain`. `update(grads, state, params)` submits the tiled update of
every parameter and moment tile and returns updates that `optax.apply_updates`
(or `nnx.Optimizer`) applies by advancing the parameters' tokens: the tiles
already hold the new values. Learning rates may be Optax schedules; the value
of each step reaches the native code as an array, never as an attribute, so
changing it does not recompile (DESIGN invariant 4).

`adamw` and `sgd` consume the gradients: once a parameter is updated its
gradient tiles are invalidated (DESIGN invariant 7), so they are never written
to swap between steps; the next `jnntile.value_and_grad` starts them at zero
again. Read gradients (norms, logging) before the update.

In a distributed run (several MPI ranks, docs/distributed.md) `allreduce_sum`
comes first: it sums each rank's gradients over the ranks, and the
transformations after it refuse gradients that were not summed (each rank
would otherwise update its copy of the parameters with its own gradients).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import weakref
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jnntile import _xla_ffi
from jnntile.core import distributed, runtime
from jnntile.core import tensor as tensor_mod
from jnntile.core.grad import grad_of
from jnntile.core.ledger import LEDGER
from jnntile.ops import _ffi
from jnntile.ops import values as values_ops
from jnntile.ops._ffi import call
from jnntile.core.tensor import Gradient, Tensor


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def _leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=_is_tensor)


def _check(grads, params, name: str):
    if params is None:
        raise ValueError(f"jnntile.optim.{name} updates parameters in place: call update(grads, state, params)")
    grad_leaves, param_leaves = _leaves(grads), _leaves(params)
    if len(grad_leaves) != len(param_leaves):
        raise ValueError(f"{name}: {len(grad_leaves)} gradients for {len(param_leaves)} parameters")
    for g, p in zip(grad_leaves, param_leaves):
        if not (_is_tensor(g) and _is_tensor(p)) or g.id != p.id:
            raise ValueError(f"{name}: gradients must be the jnntile.grad results of these parameters, got {g!r} "
                             f"for {p!r}")
    return grad_leaves, param_leaves


def _grad_values(g: Tensor):
    """The handle holding the gradient values of g."""
    return tensor_mod.grad_handle(g.handle)


def _require_summed(grad_leaves, name: str) -> None:
    if runtime.world_size() > 1 and not all(getattr(g, "summed", False) for g in grad_leaves):
        raise ValueError(f"{name}: in a distributed run the gradients must be summed over the ranks first: chain "
                         f"jnntile.optim.allreduce_sum() before {name} (jnntile.step.make_steps does)")


def _clip_operands(g: Tensor) -> tuple[list, list, float]:
    """The clip of g's values for an update to apply as it reads them: (handles, tokens, max_norm).

    clip_by_global_norm only names the clip on the gradients it returns: the
    update scales each value as it reads it, which saves a pass that reads and
    writes every gradient tile (with disk swap, a write and a read of all
    gradients per step). Values clipped in place already (`jnntile.grad_of`
    read them) are read as they are, after that clip.
    """
    clip = g.clip if isinstance(g, Gradient) else None
    if clip is None:
        return [], [], 0.0
    applied = LEDGER.clipped(_grad_values(g), clip.norm.handle)
    if applied is not None:
        return [], [applied], 0.0
    return [clip.norm.handle], [clip.norm.token], clip.max_norm


def _consume(g: Tensor, token):
    """Invalidates the gradient values of g after `token` (the update that read them last)."""
    if not _ffi.RELEASE:
        return token
    return _ffi.invalidate([_grad_values(g)], [token])


def _update_calls(op: str, step, leaves: list, own_operands: Callable, attrs: Callable) -> list:
    """Updates `leaves` ((index, gradient) pairs) in place with one call of `op` per kind of leaf, and returns
    each leaf's token. Leaves with the same weight decay, compute copy (or none) and clip share a call, in
    which the native op takes their small tiles several to a task (a GPT-2 block's biases and norm vectors:
    one or two tasks, not one per tile). `own_operands(i, g)` gives a leaf's handles and tokens, `attrs(i)`
    its call's attributes; a gradient's clip is applied as the update reads it. A leaf with a compute copy
    (a model in bfloat16) has it written by the task that updates the master."""
    kinds: dict = {}
    for i, g in leaves:
        clip_handles, clip_tokens, max_norm = _clip_operands(g)
        kind = (step.decay[i], step.params[i].handle.copy is not None, tuple(map(id, clip_handles)), max_norm)
        kinds.setdefault(kind, []).append((i, g, clip_handles, clip_tokens))
    tokens = {}
    for (_, copied, _, max_norm), members in kinds.items():
        handles, operand_tokens, clip_tokens = [], [], {}
        for i, g, _, leaf_clip_tokens in members:
            leaf_handles, leaf_tokens = own_operands(i, g)
            handles += leaf_handles + ([step.params[i].handle.copy] if copied else [])
            operand_tokens += leaf_tokens
            clip_tokens.update((id(t), t) for t in leaf_clip_tokens)
        first = members[0]
        token = call(op, handles + first[2], operand_tokens + list(clip_tokens.values()), max_norm=max_norm,
                     **({"copy": True} if copied else {}), **attrs(first[0]))
        tokens.update((i, token) for i, *_ in members)
    return [tokens[i] for i, _ in leaves]


def _learning_rate(learning_rate, count):
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    return jnp.asarray(lr, jnp.float32)


def _updates_like(params, tokens):
    """Updates for optax.apply_updates: the parameters with the tokens of their in-place update."""
    tokens = iter(tokens)
    return jax.tree.map(lambda p: Tensor(next(tokens), p.handle), params, is_leaf=_is_tensor)


class AdamWState(NamedTuple):
    count: jax.Array  # updates done so far
    mu: Any  # first moments, Tensors shaped like the parameters
    nu: Any  # second moments


# The optimizers a command can train with (train's --optimizer), each with the parameter-sized tensors of state it
# keeps per parameter (the memory planner counts them).
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}


def adamw(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, mask: Callable[[Any], Any] | None = None) -> optax.GradientTransformation:
    """AdamW as `optax.adamw` (bias correction, decoupled weight decay), on tiles in place.

    `mask(params)` returns a pytree of bools like the params: weight decay only where True.
    """

    rule = _AdamW(learning_rate, b1, b2, eps, weight_decay, mask)
    state_type = _declared(AdamWState, rule)

    def init(params):
        zeros = values_ops.zeros_like  # sharded as its parameter
        return state_type(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params, is_leaf=_is_tensor),
                          nu=jax.tree.map(zeros, params, is_leaf=_is_tensor))

    def update(grads, state, params=None):
        grad_leaves, param_leaves = _check(grads, params, "adamw")
        _require_summed(grad_leaves, "adamw")
        step = rule.start(state, params)
        tokens = rule.update_leaves(step, list(enumerate(grad_leaves)))
        tokens = [_consume(g, token) for g, token in zip(grad_leaves, tokens)]
        return _updates_like(params, tokens), rule.state_after(step, state, tokens)

    return optax.GradientTransformation(init, update)


def sgd(learning_rate: float | Callable) -> optax.GradientTransformation:
    """Plain SGD (no momentum): p -= lr * g, on tiles in place."""

    rule = _Sgd(learning_rate)
    state_type = _declared(optax.ScaleByScheduleState, rule)

    def init(params):
        return state_type(count=jnp.zeros([], jnp.int32))

    def update(grads, state, params=None):
        grad_leaves, param_leaves = _check(grads, params, "sgd")
        _require_summed(grad_leaves, "sgd")
        step = rule.start(state, params)
        tokens = rule.update_leaves(step, list(enumerate(grad_leaves)))
        tokens = [_consume(g, token) for g, token in zip(grad_leaves, tokens)]
        return _updates_like(params, tokens), rule.state_after(step, state, tokens)

    return optax.GradientTransformation(init, update)


def global_norm(grads) -> Tensor:
    """The L2 norm of all gradients together, as a scalar Tensor computed on StarPU."""
    grad_leaves = _leaves(grads)
    values = [grad_of(g) for g in grad_leaves]  # clipped ones scaled first
    norm = tensor_mod.new_handle((), "float32", ())
    if distributed.sharding():
        # Each owner sums the squares of its gradient tiles into a partial sum sharded as the tile; the norm's
        # sum reads every partial, which its owner sends to every rank: all of them sum the same values in the
        # same order, those of one process.
        values = [_sharded_partial_sums(g, v) for g, v in zip(grad_leaves, values)]
    token = call("sumsq", [v.handle for v in values] + [norm], [v.token for v in values], sqrt=True)
    return Tensor(token, norm)


def _sharded_partial_sums(g: Tensor, value: Tensor) -> Tensor:
    """The sums of squares of `value`'s tiles (int64 holding doubles, one per tile) on the owners of g's."""
    tiles = math.prod(value.grid)
    partials = tensor_mod.new_handle((tiles,), "int64", (1,))
    owners = distributed.owners(g.handle)
    if owners:
        _xla_ffi.tensor_shard(partials.id, owners)
    return Tensor(call("sumsq", [value.handle, partials], [value.token], partials=1), partials)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """As `optax.clip_by_global_norm`: scales gradients by max_norm / norm when norm >= max_norm.

    The norm is computed and applied on StarPU, with no host synchronisation.
    The gradients returned carry the clip (`Gradient.clip`: the norm and
    max_norm): the next `adamw` or `sgd` update applies the scale as it reads
    them, and `jnntile.grad_of` (any other read) applies it in place first.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be positive (use no clipping to disable it)")
    state_type = _declared(optax.EmptyState, _Clip(float(max_norm)))

    def init(params):
        return state_type()

    def update(grads, state, params=None):
        grad_leaves = _leaves(grads)
        _require_summed(grad_leaves, "clip_by_global_norm")
        clip = tensor_mod.Clip(global_norm(grads), float(max_norm))
        clipped = jax.tree.map(lambda g: Gradient(g.token, g.handle, clip, getattr(g, "summed", False)), grads,
                               is_leaf=_is_tensor)
        return clipped, state

    return optax.GradientTransformation(init, update)


# Distinct per traced allreduce and the same on every rank, which traces the same program: the
# transfers of different calls never share StarPU-MPI tags (xla_ffi/ops/allreduce.cc).
_allreduce_keys = itertools.count(1)


def allreduce_sum(ownership: distributed.DataParallel = distributed.DEFAULT_OWNERSHIP
                  ) -> optax.GradientTransformation:
    """Sums the gradients over the ranks of a distributed run; on one process it does nothing.

    With each rank's loss scaled by 1/N (`jnntile.value_and_grad(..., scale=1 / N)`,
    N = `jnntile.runtime.world_size()`), the sum is the gradient of the mean loss
    of the whole batch. Chain it first: `optax.chain(allreduce_sum(), clip_by_global_norm(1.0), adamw(...))`.
    Every gradient tile is summed at a root rank (`ownership.reduction_roots`)
    in a fixed order and sent back from there, so all ranks hold the same bits
    and apply the same update. The transfers and additions are StarPU tasks
    and StarPU-MPI requests submitted at once: a tile travels as soon as the
    backward finished it, and nothing waits on the host.
    """

    def init(params):
        return optax.EmptyState()

    def update(grads, state, params=None):
        size = runtime.world_size()
        if size == 1:
            return grads, state
        grad_leaves = _leaves(grads)
        if any(getattr(g, "summed", False) for g in grad_leaves):
            raise ValueError("allreduce_sum: these gradients are summed over the ranks already; chain it once "
                             "(jnntile.step.make_steps adds it: give make_steps the transformation of one process)")
        values = [grad_of(g) for g in grad_leaves]  # clipped ones scaled first
        roots = ownership.reduction_roots(sum(math.prod(g.grid) for g in grad_leaves), size)
        token = call("allreduce", [v.handle for v in values], [v.token for v in values], roots=roots,
                     key=next(_allreduce_keys), schedule=runtime.ALLREDUCE_SCHEDULES[runtime.config().allreduce])
        return jax.tree.map(lambda g: Gradient(token, g.handle, summed=True), grads, is_leaf=_is_tensor), state

    return optax.GradientTransformation(init, update)


class SumToOwners:
    """With sharded state (`jnntile.distributed.sharded_state`): each gradient summed over the ranks up to the
    owners of its parameter's tiles, as soon as the gradient is final (`on_final`, which
    `jnntile.value_and_grad` calls inside the backward), so a rank never holds more than the gradients of the
    layers in flight beside its own shard's. The ranks that own no tile drop their partial sums once sent.
    `finish` sums those the backward did not hand over and marks them all summed."""

    def __init__(self, params):
        self.params = {p.handle for p in _leaves(params)}
        self.summed = {}

    def _sum(self, values: list[Tensor], params: list) -> object:
        roots = [owner for p in params for owner in distributed.owners(p)]
        return call("allreduce", [v.handle for v in values], [v.token for v in values], roots=roots,
                    key=next(_allreduce_keys), schedule=runtime.ALLREDUCE_SCHEDULES[runtime.config().allreduce],
                    to_owner=1)

    def on_final(self, x: Tensor):
        if x.handle not in self.params:  # an activation
            return None
        value = grad_of(x)
        self.summed[x.handle] = token = self._sum([value], [x.handle])
        return token

    def finish(self, grads):
        leaves = [g for g in _leaves(grads) if g.handle not in self.summed]
        if leaves:
            token = self._sum([grad_of(g) for g in leaves], [g.handle for g in leaves])
            self.summed.update((g.handle, token) for g in leaves)
        return jax.tree.map(lambda g: Gradient(self.summed[g.handle], g.handle, summed=True), grads,
                            is_leaf=_is_tensor)


# ---- the update fused into the backward ------------------------------------------------------------------
#
# jnntile.value_and_grad(on_final=...) hands each parameter over as soon as its gradient is final (the
# backward of every op that read it ran), while the backward of the earlier layers goes on. `FusedUpdate`
# updates it there, so the gradient is read while in RAM and dropped: it never reaches swap. Without a clip
# that is the update itself, in place. With clip_by_global_norm the scale is unknown until every gradient
# is done, so the update is speculative: written apart, unclipped, into shadow tensors (the parameter and
# its moments stay as they were), with the gradient's per-tile sums of squares beside it. Once the norm is
# known, each shadow becomes its tensor's state by exchanging tiles (no data moves); when the norm clips,
# the clipped step replaces the speculative one first, from the moments before and after it
# (AdamwStep::rescale in xla_ffi/kernels/optim.h), as the update after the backward computes a clipped
# step: the same bits. Clipping then costs a read of the old parameter and both moments and a write of
# the new ones; not clipping costs nothing more.

# A transformation's state says what the transformation does: adamw, sgd and clip_by_global_norm make their
# states of a subclass of their state type (`_declared`) that holds their rule. A chain's state holds its
# transformations' states in order (a tuple from optax.chain, an OrderedDict from optax.named_chain), so a
# step's optimizer state tells whether it can be fused and how (`_chain_rule`), whichever chain built it. The
# subclass adds no leaf: checkpoints hold the same leaves in the same order.


class _Declared:
    """Mixed into the state types of jnntile's transformations; `rule` is what the transformation does."""

    __slots__ = ()
    rule: Any = None


def _declared(state_type: type, rule) -> type:
    """A subclass of the NamedTuple `state_type` whose states carry `rule`."""
    return type(state_type.__name__, (state_type, _Declared), {"__slots__": (), "rule": rule})


_shadows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shadow(handle: tensor_mod._Handle) -> tensor_mod._Handle:
    """The tensor a speculative update writes `handle`'s next value to (created once, with a compute copy
    where `handle` has one); it holds nothing between steps."""
    shadow = _shadows.get(handle)
    if shadow is None:
        shadow = _shadows[handle] = tensor_mod.new_handle(handle.shape, handle.dtype, handle.tile_shape)
        if handle.copy is not None:
            tensor_mod.compute_copy_handle(shadow, handle.copy.dtype)
    return shadow


def _with_copies(handles: list, *tensors) -> tuple[list, dict]:
    """`handles` then the compute copies of `tensors` (all or none have one): operands of an apart update
    or a commit."""
    copies = [t.copy for t in tensors]
    if copies[0] is None:
        return handles, {}
    return handles + copies, {"copy": True}


@dataclasses.dataclass
class _Step:
    """What one step's update of the parameters needs, per leaf in `params`' order."""

    params: list
    lr: jax.Array
    count: jax.Array  # 1-based
    decay: list
    moments: list  # per leaf: (m, v) Tensors, or () for SGD


@dataclasses.dataclass(frozen=True)
class _AdamW:
    learning_rate: Any
    b1: float
    b2: float
    eps: float
    weight_decay: float
    mask: Any

    def start(self, state: AdamWState, params) -> _Step:
        param_leaves = _leaves(params)
        decay = _leaves(self.mask(params)) if self.mask is not None else [True] * len(param_leaves)
        count = (state.count + 1).astype(jnp.int32)
        return _Step(param_leaves, _learning_rate(self.learning_rate, state.count), count, decay,
                     list(zip(_leaves(state.mu), _leaves(state.nu))))

    def _attrs(self, step: _Step, i: int) -> dict:
        return dict(inputs=[step.lr, step.count], b1=self.b1, b2=self.b2, eps=self.eps,
                    weight_decay=self.weight_decay if step.decay[i] else 0.0)

    def update_leaves(self, step: _Step, leaves: list) -> list:
        def own_operands(i, g):
            p, (m, v) = step.params[i], step.moments[i]
            return [p.handle, _grad_values(g), m.handle, v.handle], [g.token, p.token, m.token, v.token]

        return _update_calls("adamw", step, leaves, own_operands, lambda i: self._attrs(step, i))

    def update_apart(self, step: _Step, i: int, g: Tensor):
        p, (m, v) = step.params[i], step.moments[i]
        shadows = [_shadow(t.handle) for t in (p, m, v)]
        handles, copy_attrs = _with_copies([p.handle, _grad_values(g), m.handle, v.handle] + shadows, shadows[0])
        return call("adamw_apart", handles, [g.token, p.token, m.token, v.token], writes=handles[4:],
                    **copy_attrs, **self._attrs(step, i))

    def commit(self, step: _Step, i: int, clip: tensor_mod.Clip, token):
        p, (m, v) = step.params[i], step.moments[i]
        shadows = [_shadow(t.handle) for t in (p, m, v)]
        handles, copy_attrs = _with_copies([clip.norm.handle, p.handle, m.handle, v.handle] + shadows, p.handle,
                                           shadows[0])
        token = call("adamw_commit", handles, [clip.norm.token, token], max_norm=clip.max_norm, **copy_attrs,
                     **self._attrs(step, i))
        for shadow in shadows:
            LEDGER.dropped(shadow)
        return token

    def state_after(self, step: _Step, state: AdamWState, tokens) -> AdamWState:
        return state._replace(count=step.count, mu=_with_tokens(state.mu, tokens), nu=_with_tokens(state.nu, tokens))


@dataclasses.dataclass(frozen=True)
class _Sgd:
    learning_rate: Any

    def start(self, state, params) -> _Step:
        param_leaves = _leaves(params)
        return _Step(param_leaves, _learning_rate(self.learning_rate, state.count), state.count + 1,
                     [False] * len(param_leaves), [()] * len(param_leaves))

    def update_leaves(self, step: _Step, leaves: list) -> list:
        def own_operands(i, g):
            p = step.params[i]
            return [p.handle, _grad_values(g)], [g.token, p.token]

        return _update_calls("sgd", step, leaves, own_operands, lambda i: dict(inputs=[step.lr]))

    def update_apart(self, step: _Step, i: int, g: Tensor):
        p = step.params[i]
        shadow = _shadow(p.handle)
        handles, copy_attrs = _with_copies([p.handle, _grad_values(g), shadow], shadow)
        return call("sgd_apart", handles, [g.token, p.token], inputs=[step.lr], writes=handles[2:], **copy_attrs)

    def commit(self, step: _Step, i: int, clip: tensor_mod.Clip, token):
        p = step.params[i]
        shadow = _shadow(p.handle)
        handles, copy_attrs = _with_copies([clip.norm.handle, p.handle, shadow], p.handle, shadow)
        token = call("sgd_commit", handles, [clip.norm.token, token], max_norm=clip.max_norm, **copy_attrs)
        LEDGER.dropped(shadow)
        return token

    def state_after(self, step: _Step, state, tokens):
        return state._replace(count=step.count)


@dataclasses.dataclass(frozen=True)
class _Clip:
    max_norm: float


@dataclasses.dataclass(frozen=True)
class _Chain:
    clip: _Clip | None
    main: _AdamW | _Sgd


def _with_tokens(tree, tokens):
    tokens = iter(tokens)
    return jax.tree.map(lambda t: t.with_token(next(tokens)), tree, is_leaf=_is_tensor)


# `optax.chain` itself: a chain of an optional `clip_by_global_norm` then `adamw` or `sgd` fuses whichever
# chain built it (`_chain_rule`); the name stays for the code that used it.
chain = optax.chain


def _chain_states(opt_state) -> tuple | None:
    """The states of a chain's transformations in order: `opt_state` of optax.chain or optax.named_chain."""
    if isinstance(opt_state, collections.OrderedDict):
        return tuple(opt_state.values())
    return opt_state if type(opt_state) is tuple else None


def _with_last_state(opt_state, state):
    """A chain's state `opt_state` with the state of its last transformation replaced by `state`."""
    if isinstance(opt_state, collections.OrderedDict):
        replaced = collections.OrderedDict(opt_state)
        replaced[next(reversed(opt_state))] = state
        return replaced
    return (*opt_state[:-1], state)


def _chain_rule(opt_state) -> _Chain | None:
    """What the chain whose state is `opt_state` does when it is an optional `clip_by_global_norm` then
    `adamw` or `sgd`, read from its states' types (`_declared`); None for any other optimizer."""
    states = _chain_states(opt_state)
    rules = [s.rule if isinstance(s, _Declared) else None for s in states or ()]
    if len(rules) == 2 and isinstance(rules[0], _Clip) and isinstance(rules[1], (_AdamW, _Sgd)):
        return _Chain(rules[0], rules[1])
    if len(rules) == 1 and isinstance(rules[0], (_AdamW, _Sgd)):
        return _Chain(None, rules[0])
    return None


class FusedUpdate:
    """One step of a fusable chain (see `fused_update`), run as the backward finishes each parameter's gradient.

    Pass it as `on_final` to `jnntile.value_and_grad` (when `mode` is not "after"), then call
    `finish(grads)` with the gradients returned: it updates the parameters the backward did not hand over
    and commits the speculative updates, and returns what `tx.update` would have (updates, new state). In
    mode "after" nothing is handed over and `finish` is `tx.update`. `norm` is then the step's global
    norm (a scalar Tensor) when the chain clips.
    """

    def __init__(self, rule: _Chain, opt_state, params, mode: str):
        self.rule, self.opt_state, self.params, self.mode = rule, opt_state, params, mode
        self.main_state = _chain_states(opt_state)[-1]
        self.step = rule.main.start(self.main_state, params)
        self.index = {p.handle: i for i, p in enumerate(self.step.params)}
        self.fused: dict[int, Any] = {}  # leaf -> token of its update (speculative when clipping)
        self.partial_sums: dict[int, Tensor] = {}  # leaf -> its gradient's sum of squares, per tile
        self.norm: Tensor | None = None

    def __call__(self, param: Tensor):
        i = self.index.get(param.handle)
        if i is None or i in self.fused or self.mode == "after":
            return None
        g = Tensor(param.token, param.handle)  # a gradient as jnntile.grad returns it
        if self.rule.clip is None:
            token = self.rule.main.update_leaves(self.step, [(i, g)])[0]
        else:
            grid = math.prod(self.step.params[i].grid)
            sums = tensor_mod.new_handle((grid,), "int64", (1,))  # doubles' bits (xla_ffi/ops/reduce.cc)
            self.partial_sums[i] = Tensor(call("sumsq", [_grad_values(g), sums], [g.token], partials=True,
                                               writes=[sums]), sums)
            token = self.rule.main.update_apart(self.step, i, g)
        self.fused[i] = _consume(g, token)
        return self.fused[i]

    def finish(self, grads):
        grad_leaves, _ = _check(grads, self.params, "FusedUpdate.finish")
        clip = None
        if self.rule.clip is not None:  # the global norm's sum in the order of global_norm's: the same bits
            parts = [self.partial_sums[i] if i in self.fused else grad_of(g) for i, g in enumerate(grad_leaves)]
            norm = tensor_mod.new_handle((), "float32", ())
            token = call("sumsq", [t.handle for t in parts] + [norm], [t.token for t in parts], sqrt=True)
            self.norm = Tensor(token, norm)
            clip = tensor_mod.Clip(self.norm, self.rule.clip.max_norm)
        rest = [(i, Gradient(g.token, g.handle, clip)) for i, g in enumerate(grad_leaves) if i not in self.fused]
        updated = dict(zip([i for i, _ in rest], self.rule.main.update_leaves(self.step, rest)))
        tokens = []
        for i, g in enumerate(grad_leaves):
            if i in updated:
                tokens.append(_consume(g, updated[i]))
            elif clip is None:
                tokens.append(self.fused[i])
            else:
                tokens.append(self.rule.main.commit(self.step, i, clip, self.fused[i]))
        state = self.rule.main.state_after(self.step, self.main_state, tokens)
        return _updates_like(self.params, tokens), _with_last_state(self.opt_state, state)


# How a training step updates the parameters: after the backward, fused into it in place (no clip), or
# speculative (a clip: written apart, committed once the norm is known).
UPDATE_MODES = ("after", "fused", "speculative")
FUSED_UPDATE_CHOICES = ("auto", "on", "off")


def update_mode(clip: bool, fused_update: str = "auto", swap: bool = False) -> str:
    """The mode (one of UPDATE_MODES) of a step with or without `clip` for the setting `fused_update`.

    "auto" fuses an update without clip always: it only frees each gradient earlier. With a clip it fuses
    only with disk swap (`swap`): a speculative update keeps the new parameters and moments of the fused
    parameters beside the old ones until the step ends (12 bytes per parameter for AdamW, 4 for SGD), which
    costs RAM where everything fits, and saves the gradients' trip to the disk and back where it does not
    (and not right after a step that clipped: `clipped`).
    """
    if fused_update not in FUSED_UPDATE_CHOICES:
        raise ValueError(f"fused_update={fused_update!r}: use one of {', '.join(FUSED_UPDATE_CHOICES)}")
    if fused_update == "off" or (fused_update == "auto" and clip and not swap):
        return "after"
    return "speculative" if clip else "fused"


def fused_update(opt_state, params, setting: str = "on") -> FusedUpdate | None:
    """One step of the optimizer whose state is `opt_state` as a `FusedUpdate` in the mode `update_mode`
    gives for `setting` (the runtime's swap decides "auto"), or None when the optimizer is not a fusable
    chain (an optional `clip_by_global_norm` then `adamw` or `sgd`, by optax.chain or optax.named_chain) or
    the run is distributed (gradients are summed over the ranks first)."""
    rule = _chain_rule(opt_state)
    if rule is None or runtime.world_size() > 1:
        return None
    return FusedUpdate(rule, opt_state, params,
                       update_mode(rule.clip is not None, setting, runtime.config().swap_dir is not None))


def speculates(opt_state, setting: str) -> bool:
    """Whether a step of the optimizer whose state is `opt_state` under `setting` updates speculatively (see
    `update_mode`)."""
    rule = _chain_rule(opt_state)
    return (rule is not None and rule.clip is not None and runtime.world_size() == 1
            and update_mode(True, setting, runtime.config().swap_dir is not None) == "speculative")


def clipped(opt_state, norm: Tensor) -> bool | None:
    """Whether the global `norm` a step of the optimizer whose state is `opt_state` computed clipped (read
    from its tile: waits for it); None when the optimizer is not a fusable chain that clips.

    A speculative update that clips costs more than the update after the backward (it reads the old
    parameter and moments again and writes the new ones twice), and a norm that clipped once tends to clip
    again: under "auto", `jnntile.step.make_steps` runs the step after one that clipped with the update
    after the backward (the same bits either way).
    """
    rule = _chain_rule(opt_state)
    if rule is None or rule.clip is None:
        return None
    return bool(float(norm.numpy()) >= rule.clip.max_norm)


__all__ = ["AdamWState", "FUSED_UPDATE_CHOICES", "FusedUpdate", "Gradient", "OPTIMIZER_STATES", "UPDATE_MODES",
           "adamw", "allreduce_sum", "chain", "clip_by_global_norm", "clipped", "fused_update", "global_norm", "sgd",
           "speculates", "update_mode"]
