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

import itertools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jnntile
from jnntile import distributed, runtime
from jnntile import tensor as tensor_mod
from jnntile.grad import grad_of
from jnntile.ledger import LEDGER
from jnntile.ops import _ffi
from jnntile.ops._ffi import call
from jnntile.tensor import Gradient, Tensor


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
                         f"jnntile.optim.allreduce_sum() before {name} (jnntile.train.make_steps does)")


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


def _copy_operands(p: Tensor) -> tuple[list, dict]:
    """The compute copy an update of `p` writes in the same task, when `p` has one (a model in bfloat16)."""
    copy = p.handle.copy
    return ([copy], {"copy": True}) if copy is not None else ([], {})


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


def adamw(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, mask: Callable[[Any], Any] | None = None) -> optax.GradientTransformation:
    """AdamW as `optax.adamw` (bias correction, decoupled weight decay), on tiles in place.

    `mask(params)` returns a pytree of bools like the params: weight decay only where True.
    """

    def init(params):
        zeros = lambda p: jnntile.zeros(p.shape, tile_shape=p.tile_shape)  # noqa: E731
        return AdamWState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params, is_leaf=_is_tensor),
                          nu=jax.tree.map(zeros, params, is_leaf=_is_tensor))

    def update(grads, state, params=None):
        grad_leaves, param_leaves = _check(grads, params, "adamw")
        _require_summed(grad_leaves, "adamw")
        decay = _leaves(mask(params)) if mask is not None else [True] * len(param_leaves)
        lr = _learning_rate(learning_rate, state.count)
        step = state.count + 1
        tokens = []
        for g, p, m, v, d in zip(grad_leaves, param_leaves, _leaves(state.mu), _leaves(state.nu), decay):
            clip_handles, clip_tokens, max_norm = _clip_operands(g)
            copy_handles, copy_attrs = _copy_operands(p)
            token = call("adamw", [p.handle, _grad_values(g), m.handle, v.handle] + copy_handles + clip_handles,
                         [g.token, p.token, m.token, v.token] + clip_tokens, inputs=[lr, step.astype(jnp.int32)],
                         b1=b1, b2=b2, eps=eps, weight_decay=weight_decay if d else 0.0, max_norm=max_norm,
                         **copy_attrs)
            tokens.append(_consume(g, token))
        tokens_iter = iter(tokens)
        mu = jax.tree.map(lambda m: m.with_token(next(tokens_iter)), state.mu, is_leaf=_is_tensor)
        tokens_iter = iter(tokens)
        nu = jax.tree.map(lambda v: v.with_token(next(tokens_iter)), state.nu, is_leaf=_is_tensor)
        return _updates_like(params, tokens), AdamWState(count=step, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def sgd(learning_rate: float | Callable) -> optax.GradientTransformation:
    """Plain SGD (no momentum): p -= lr * g, on tiles in place."""

    def init(params):
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(grads, state, params=None):
        grad_leaves, param_leaves = _check(grads, params, "sgd")
        _require_summed(grad_leaves, "sgd")
        lr = _learning_rate(learning_rate, state.count)
        tokens = []
        for g, p in zip(grad_leaves, param_leaves):
            clip_handles, clip_tokens, max_norm = _clip_operands(g)
            copy_handles, copy_attrs = _copy_operands(p)
            tokens.append(_consume(g, call("sgd", [p.handle, _grad_values(g)] + copy_handles + clip_handles,
                                           [g.token, p.token] + clip_tokens, inputs=[lr], max_norm=max_norm,
                                           **copy_attrs)))
        return _updates_like(params, tokens), optax.ScaleByScheduleState(count=state.count + 1)

    return optax.GradientTransformation(init, update)


def global_norm(grads) -> Tensor:
    """The L2 norm of all gradients together, as a scalar Tensor computed on StarPU."""
    grad_leaves = _leaves(grads)
    values = [grad_of(g) for g in grad_leaves]  # clipped ones scaled first
    norm = tensor_mod.new_handle((), "float32", ())
    token = call("sumsq", [v.handle for v in values] + [norm], [v.token for v in values], sqrt=True)
    return Tensor(token, norm)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """As `optax.clip_by_global_norm`: scales gradients by max_norm / norm when norm >= max_norm.

    The norm is computed and applied on StarPU, with no host synchronisation.
    The gradients returned carry the clip (`Gradient.clip`: the norm and
    max_norm): the next `adamw` or `sgd` update applies the scale as it reads
    them, and `jnntile.grad_of` (any other read) applies it in place first.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be positive (use no clipping to disable it)")

    def init(params):
        return optax.EmptyState()

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
                             "(jnntile.train.make_steps adds it: give make_steps the transformation of one process)")
        values = [grad_of(g) for g in grad_leaves]  # clipped ones scaled first
        roots = ownership.reduction_roots(sum(math.prod(g.grid) for g in grad_leaves), size)
        token = call("allreduce", [v.handle for v in values], [v.token for v in values], roots=roots,
                     key=next(_allreduce_keys), schedule=runtime.ALLREDUCE_SCHEDULES[runtime.config().allreduce])
        return jax.tree.map(lambda g: Gradient(token, g.handle, summed=True), grads, is_leaf=_is_tensor), state

    return optax.GradientTransformation(init, update)


__all__ = ["AdamWState", "Gradient", "adamw", "allreduce_sum", "clip_by_global_norm", "global_norm", "sgd"]
