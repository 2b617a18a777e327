"""Bias addition and the linear layer built on it.

`add_bias(x, b)` broadcasts `b` over the leading axes of `x`: `b` has the
trailing axes of `x` (usually one, `(N,)` for `x` `(..., N)`) and the same
tiles on them. `linear(x, w, b)` is `matmul(x, w)` contracting the last axis of
`x` with the first of `w`, then `add_bias` with `b` shaped like `w`'s output
axes, so a fused projection `w: (C, 3, H, D)` gives `(..., 3, H, D)`.
"""

from __future__ import annotations

from jnntile import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target, release
from jnntile.ops.gemm import matmul
from jnntile.tensor import Tensor


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


def _backward(residuals, g):
    x, b, out = residuals
    grad_x = grad_target(x)
    (fresh_x,), written = fresh_targets(grad_x)  # dx = dy where dx holds nothing yet
    token = call("add_bias_backward", [tensor_mod.grad_handle(out.handle), grad_x, grad_target(b)],
                 [out.token, g.token, x.token, b.token], writes=written, fresh_dx=fresh_x)
    token = release(token, out)
    return x.with_token(token), b.with_token(token)


_add_bias = differentiable(_forward, _backward, name="add_bias")


def add_bias(x: Tensor, b: Tensor) -> Tensor:
    """x + b with b broadcast over the leading axes of x; same layout and dtype as x (b is float32)."""
    _check(x, b)
    return _add_bias(x, b)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """x @ w (+ b): x (..., C) tiled (..., tc), w (C, N..) tiled (tc, tn..), b (N..) tiled (tn..).

    The result is (..., N..) tiled (..., tn..).
    """
    if b is not None and (b.shape != w.shape[1:] or b.tile_shape != w.tile_shape[1:]):
        raise ValueError(f"linear: b (shape {b.shape}, tile_shape {b.tile_shape}) must match w's output axes "
                         f"(shape {w.shape[1:]}, tile_shape {w.tile_shape[1:]})")
    y = matmul(x, w)
    return y if b is None else add_bias(y, b)
