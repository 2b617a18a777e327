"""Bias addition: `add_bias(x, b)` broadcasts `b` over the leading axes of `x`: `b` has the trailing axes of
`x` (usually one, `(N,)` for `x` `(..., N)`) and the same tiles on them.

A linear layer's bias is added by its product's own tasks instead (`jnntile.ops.gemm.linear`); `backward_call`
here sums a bias's gradient where those tasks cannot (a frozen weight).
"""

from __future__ import annotations

from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target, release
from jnntile.core.tensor import Tensor


def _check(x: Tensor, b: Tensor):
    if x.dtype not in tensor_mod.FLOAT_DTYPES or b.dtype != "float32":
        raise TypeError(f"add_bias needs x float32 or bfloat16 and b float32 (a bias stays a float32 master), "
                        f"got x {x!r} and b {b!r}")
    k = b.ndim
    if k == 0 or k > x.ndim or x.shape[x.ndim - k:] != b.shape:
        raise ValueError(f"add_bias: b of shape {b.shape} must equal the trailing axes of x {x.shape}")
    if x.tile_shape[x.ndim - k:] != b.tile_shape:
        raise ValueError(f"add_bias: b's tile_shape {b.tile_shape} must equal x's tiles on its trailing axes "
                         f"{x.tile_shape[x.ndim - k:]} (x tile_shape {x.tile_shape}); tile b the same way")


def _forward(x, b, zero_grad):
    out = tensor_mod.new_handle(x.shape, x.dtype, x.tile_shape)
    token = call("add_bias", [x.handle, b.handle, out], [x.token, b.token], zero_grads=[out] if zero_grad else [])
    return Tensor(token, out), (x, b, Tensor(token, out))


def backward_call(out: Tensor, g: Tensor, grad_x, b: Tensor, tokens):
    """The token of the call that adds out's gradient into grad_x (a handle, or None) and sums it into b's
    gradient, each written instead where it holds nothing yet."""
    grad_b = grad_target(b)
    (fresh_x, fresh_b), written = fresh_targets(grad_x, grad_b)
    return call("add_bias_backward", [tensor_mod.grad_handle(out.handle), grad_x, grad_b],
                [out.token, g.token, *tokens], writes=written, fresh_dx=fresh_x, fresh_db=fresh_b)


def _backward(residuals, g):
    x, b, out = residuals
    token = release(backward_call(out, g, grad_target(x), b, [x.token, b.token]), out)
    return x.with_token(token), b.with_token(token)


_add_bias = differentiable(_forward, _backward, name="add_bias")


def add_bias(x: Tensor, b: Tensor) -> Tensor:
    """x + b with b broadcast over the leading axes of x; same layout and dtype as x (b is float32)."""
    _check(x, b)
    return _add_bias(x, b)
