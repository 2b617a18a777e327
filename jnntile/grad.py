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

from jnntile import tensor as tensor_mod
from jnntile.ops._ffi import call
from jnntile.tensor import Tensor


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def zero_grads(tree):
    """Returns `tree` with every float32 Tensor's gradient set to zero (ordered by token)."""

    def zero(x):
        if not _is_tensor(x) or x.dtype != "float32":
            return x
        grad = tensor_mod.grad_handle(x.handle)
        x.handle.grad_zeroed = True
        return x.with_token(call("fill", [grad], [x.token], value=0.0))

    return jax.tree.map(zero, tree, is_leaf=_is_tensor)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like `jax.value_and_grad`; gradients of Tensor arguments come back as Tensors."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def scalar_fun(*args, **kwargs):
        # A scalar Tensor result is read back so JAX sees a scalar array.
        out = fun(*args, **kwargs)
        value = out[0] if has_aux else out
        if _is_tensor(value):
            value = tensor_mod.to_array(value)
        return (value, out[1]) if has_aux else value

    differentiated = jax.value_and_grad(scalar_fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args, **kwargs):
        args = list(args)
        for i in nums:
            args[i] = zero_grads(args[i])
        value, grads = differentiated(*args, **kwargs)
        return value, jax.tree.map(lambda g: tensor_mod.Gradient(g.token, g.handle) if _is_tensor(g) else g,
                                   grads, is_leaf=_is_tensor)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like `jax.grad`; gradients of Tensor arguments come back as Tensors."""
    vg = value_and_grad(fun, argnums, has_aux)

    def wrapped(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped
