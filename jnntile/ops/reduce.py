"""Whole-tensor reductions into a scalar tensor: sum of squares and norm."""

from __future__ import annotations

from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, grad_target, release
from jnntile.core.tensor import Tensor


def _forward(x, take_sqrt, zero_grad):
    out = tensor_mod.new_handle((), "float32", ())
    token = call("sumsq", [x.handle, out], [x.token], zero_grads=[out] if zero_grad else [], sqrt=take_sqrt)
    return Tensor(token, out), (x, Tensor(token, out))


def _backward(take_sqrt, residuals, g):
    x, out = residuals
    token = call("sumsq_backward", [x.handle, out.handle, tensor_mod.grad_handle(out.handle), grad_target(x)],
                 [out.token, g.token, x.token], sqrt=take_sqrt)
    return (x.with_token(release(token, out)),)


_sumsq = differentiable(_forward, _backward, nondiff_argnums=(1,))


def _require_float(x: Tensor):
    if x.dtype != "float32":
        raise TypeError(f"reductions need float32 tensors, got {x!r}")


def sumsq(x: Tensor) -> Tensor:
    """sum(x**2) as a scalar tensor (accumulated in float64 per tile)."""
    _require_float(x)
    return _sumsq(x, False)


def norm(x: Tensor) -> Tensor:
    """The Euclidean (Frobenius) norm of x as a scalar tensor."""
    _require_float(x)
    return _sumsq(x, True)
