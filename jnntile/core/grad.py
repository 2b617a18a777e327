"""Differentiation of functions of Tensors.

Backward ops accumulate into each tensor's gradient companion, so a tensor used
twice (a tied embedding, a residual stream) gets the sum. Activations start at
zero in the forward op that creates them; the arguments being differentiated
start at zero here, before the function runs. That is why `jnntile.grad` /
`jnntile.value_and_grad` wrap `jax.grad`: they return Tensors with the same ids
as the arguments, ordered after every backward task, and `grad_of` reads the
gradient values.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from jnntile.core import tensor as tensor_mod
from jnntile.core.ledger import LEDGER
from jnntile.ops import _ffi, values
from jnntile.ops._ffi import call
from jnntile.core.tensor import Gradient, Tensor


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def zero_grads(tree):
    """Returns `tree` with every floating Tensor's gradient set to zero (ordered by token).

    Inside `value_and_grad` the zero-fill is only marked and submitted right
    before the first backward call that touches the gradient (see
    jnntile/ops/_ffi.py), so gradients take no memory during the forward pass.
    """
    lazy = _ffi.current_step() is not None and _ffi.LAZY_ZERO

    def zero(x):
        if not _is_tensor(x) or x.dtype not in tensor_mod.FLOAT_DTYPES:
            return x
        grad = tensor_mod.grad_handle(x.handle)
        x.handle.grad_zeroed = True
        if lazy:
            LEDGER.zero_later(grad)
            return x
        return x.with_token(call("fill", [grad], [x.token], value=0.0, writes=[grad]))

    return jax.tree.map(zero, tree, is_leaf=_is_tensor)


def _fill_untouched(g):
    """Submits the zero-fill of an argument's gradient that no backward call touched."""
    if not _is_tensor(g) or g.handle.grad is None or not LEDGER.take_zero(g.handle.grad):
        return g
    grad = g.handle.grad
    return g.with_token(call("fill", [grad], [g.token], value=0.0, writes=[grad]))


def grad_of(t: Tensor) -> Tensor:
    """The accumulated gradient of `t` as a Tensor, ordered after the cotangent `t.token`.

    `jnntile.grad` of a function of Tensors returns Tensors with the same ids as
    the inputs; their tiles stay untouched and the gradient values live here.
    A `Gradient` clipped by `jnntile.optim.clip_by_global_norm` is scaled in
    place first (once: the ledger remembers it, and the update then reads the
    scaled values as they are).
    """
    if not t.handle.grad_zeroed:
        raise ValueError(f"{t.handle!r} has no gradient: differentiate with jnntile.grad or "
                         "jnntile.value_and_grad, which start its gradient at zero")
    values = tensor_mod.grad_handle(t.handle)
    clip = t.clip if isinstance(t, Gradient) else None
    if clip is None:
        return Tensor(t.token, values)
    token = LEDGER.clipped(values, clip.norm.handle)
    if token is None:
        token = call("clip_by_norm", [values, clip.norm.handle], [t.token, clip.norm.token], max_norm=clip.max_norm)
        LEDGER.record_clip(values, clip.norm.handle, token)
    return Tensor(_ffi.join(t.token, token), values)


def mark_computed(grads):
    """Tells the ledger that `grads`, returned by a compiled program that just ran, hold their values.

    The ledger learns what a program does to the tiles only while JAX traces it: a compiled program that
    runs again tells it nothing. A program traced after one that ran compiled (jnntile.step.make_steps'
    last micro-batch, traced anew under "auto" after a step that clipped) would otherwise find these
    gradients as the last trace left them, consumed by the update of the step before, and refuse to
    accumulate into them.
    """
    for g in jax.tree.leaves(grads, is_leaf=_is_tensor):
        if _is_tensor(g):
            LEDGER.written(tensor_mod.grad_handle(g.handle))


def _continue_from(tree, previous):
    """`tree` (arguments) ready to add to their gradients `previous`, from an earlier differentiation.

    Checks that every Tensor's gradient still holds values; orders each first
    backward use of a gradient after `previous`'s token (DESIGN invariant 2)
    and each Tensor's use after it too, so that the next micro-batch starts
    when the last one's gradients are done and one micro-batch of activations
    is alive at a time.
    """
    def link(x, g):
        if not _is_tensor(x):
            return x
        if not _is_tensor(g) or g.id != x.id:
            raise ValueError(f"accumulate: expected the gradient of {x!r} from an earlier jnntile.value_and_grad "
                             f"of the same arguments, got {g!r}")
        grad = x.handle.grad
        if grad is None or not x.handle.grad_zeroed or LEDGER.invalidated(grad):
            raise ValueError(f"accumulate: the gradient of {x!r} holds nothing (never computed, or consumed by a "
                             "jnntile.optim update, which invalidates gradients): accumulate before the update, "
                             "starting from the gradients of a call without accumulate")
        token = grad_of(g).token  # the sum continues from clipped values
        _ffi.record(token, grad)
        return x.with_token(_ffi.join(x.token, token))

    try:
        return jax.tree.map(link, tree, previous, is_leaf=_is_tensor)
    except ValueError as error:
        if str(error).startswith("accumulate:"):
            raise
        raise ValueError(f"accumulate: the gradients given do not match the differentiated arguments ({error})") \
            from error


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                   keep_activations: bool = False, accumulate=None, scale=1.0, on_final: Callable | None = None):
    """Like `jax.value_and_grad`; gradients of Tensor arguments come back as Tensors.

    Activations (outputs of ops inside `fun`), their gradients and the ops'
    scratch residuals are invalidated after their last use in the backward pass
    (DESIGN invariant 7): their memory is freed and they are never written to
    swap. Reading one afterwards (an output returned as aux, or `grad_of` an
    activation) raises an error; read it inside `fun` (e.g. `jnntile.to_array`
    in the aux output), or pass `keep_activations=True` to keep them all.

    Gradient accumulation: `accumulate` takes the gradients an earlier call
    returned for the same arguments (before any optimizer update consumed
    them); this call adds its gradients into the same tiles instead of
    starting them at zero, and returns the sums. `scale` multiplies the
    cotangent of `fun`'s value (a float or a JAX scalar): with `scale=1/n` the
    sum over n micro-batches is the gradient of their mean loss. The value
    returned is `fun`'s, unscaled.

    `on_final(tensor)`, when given, is called inside the backward as soon as the gradient of a
    differentiated Tensor is final (the Tensor's token orders after it), before the backward goes on: once
    the backward of every op that read it in the forward ran (a block recomputed with `jnntile.remat`
    counts as one reader). It submits what uses the gradient (jnntile.optim's fused update) and returns
    the token of that, which the gradient returned for the tensor carries, or None to leave it (an
    activation's).
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def scaled_fun(*args, **kwargs):
        # A scalar Tensor result is read back so JAX sees a scalar array; the
        # differentiated output is value * scale, the value itself rides as aux.
        out = fun(*args, **kwargs)
        value = out[0] if has_aux else out
        if _is_tensor(value):
            value = values.to_array(value)
        return value * scale, (value, out[1] if has_aux else None)

    differentiated = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)

    def wrapped(*args, **kwargs):
        with _ffi.step_scope(keep_activations, on_final):
            args = list(args)
            if accumulate is None:
                for i in nums:
                    args[i] = zero_grads(args[i])
            else:
                previous = (accumulate,) if isinstance(argnums, int) else tuple(accumulate)
                if len(previous) != len(nums):
                    raise ValueError(f"accumulate: {len(previous)} gradient trees for {len(nums)} arguments")
                for i, g in zip(nums, previous):
                    args[i] = _continue_from(args[i], g)
            (_, (value, aux)), grads = differentiated(*args, **kwargs)
            grads = jax.tree.map(_fill_untouched, grads, is_leaf=_is_tensor)
            for g in jax.tree.leaves(grads, is_leaf=_is_tensor):  # a clip of earlier values is not theirs
                if _is_tensor(g):
                    LEDGER.new_values(tensor_mod.grad_handle(g.handle))
            if accumulate is not None:  # an argument nobody used this time: its gradient is the earlier sum
                grads = jax.tree.map(lambda g, p: g.with_token(_ffi.join(g.token, p.token)) if _is_tensor(g) else g,
                                     grads, previous[0] if isinstance(argnums, int) else previous,
                                     is_leaf=_is_tensor)
        grads = jax.tree.map(lambda g: tensor_mod.Gradient(g.token, g.handle) if _is_tensor(g) else g,
                             grads, is_leaf=_is_tensor)
        return ((value, aux) if has_aux else value), grads

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
         keep_activations: bool = False, accumulate=None, scale=1.0, on_final: Callable | None = None):
    """Like `jax.grad`; gradients of Tensor arguments come back as Tensors (see `value_and_grad`)."""
    vg = value_and_grad(fun, argnums, has_aux, keep_activations=keep_activations, accumulate=accumulate, scale=scale,
                        on_final=on_final)

    def wrapped(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def remat(fn: Callable) -> Callable:
    """`fn(*args) -> Tensor` recomputed in the backward pass instead of keeping its activations, as
    `jax.checkpoint` does for plain JAX (activation recomputation).

    The forward runs `fn` without differentiating it and invalidates every tensor it created but its
    output (DESIGN invariant 7), so between the forward and the backward only the arguments and the output
    live. The backward runs `fn` again, now differentiated (same kernels, same inputs; dropout masks come
    from counter-based seeds, so they are the same), hands the output's gradient to the recomputed output
    and runs its backward. Gradients equal those without recomputation bit for bit. Arguments are pytrees
    of Tensors (parameters as an nnx.State) and arrays (a dropout seed, None).
    """
    @jax.custom_vjp
    def run(*args):
        return fn(*args)

    def forward(*args):
        step = _ffi.current_step()
        if step is None:
            y = zero_grads(fn(*args))
            return y, (args, y)
        touched_before = {h: list(tokens) for h, tokens in step.touched.items()}
        if step.on_final is not None:  # the block's ops run undifferentiated: the block reads its arguments
            _ffi.count_reads(step, args)
        y = fn(*args)
        # The output is an activation the rest of the differentiated function reads: its gradient starts at
        # zero, as the op that made it would have done when differentiated.
        y = zero_grads(y)
        # The ops ran undifferentiated, each traced on its own: the tokens they recorded must not leave their
        # traces. Every op of the block is an ancestor of its output, so y's token orders the invalidation
        # after all of them.
        created = [h for h in step.touched if h not in touched_before]
        step.touched.clear()
        step.touched.update(touched_before)
        if not step.keep_activations and _ffi.RELEASE:
            keep = {t.handle for t in jax.tree.leaves(args, is_leaf=_is_tensor) if _is_tensor(t)} | {y.handle}
            dead = [h for h in created if h not in keep and h.master is None]  # compute copies persist
            if dead:
                y = y.with_token(call("invalidate", dead, [y.token], writes=dead))
                for h in dead:
                    step.touched.pop(h, None)
        return y, (args, y)

    def backward(residuals, g):
        args, y = residuals
        # Recompute only once the output's gradient is there: the inputs are ready long before, and StarPU
        # runs a task as soon as its data is, so a recomputation submitted early would run early, every
        # block's at once, all their activations alive together (measured: no swap saved). StarPU orders
        # tasks by data only, so the submission itself waits (a blocking call, as reads are).
        ready = call("wait_for", [tensor_mod.grad_handle(y.handle)], [g.token])
        args = jax.tree.map(lambda x: x.with_token(_ffi.join(x.token, ready)) if _is_tensor(x) else x, args,
                            is_leaf=_is_tensor)
        again, vjp = jax.vjp(fn, *args)
        # The recomputed output takes the gradient the output received; the output and its gradient are dead.
        token = _ffi.accumulate(tensor_mod.grad_handle(y.handle), [_ffi.grad_target(again)], [g.token, again.token],
                                [1.0], source_dies=True)
        token = _ffi.release(token, y)
        cotangents = vjp(again.with_token(token))
        step = _ffi.current_step()
        if step is None or step.on_final is None:
            return cotangents
        return _ffi.hand_over_final(step, args, cotangents)

    run.defvjp(forward, backward)

    def recorded_or_run(*args):
        record = tensor_mod.active_recording()
        if record is None:
            return run(*args)
        start = len(record)  # the planner records the ops, then marks them recomputed
        y = fn(*args)
        record.append(_ffi.RecordedRecomputation(start, y))
        return y

    return recorded_or_run
