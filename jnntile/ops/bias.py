"""Bias addition and the linear layer built on it.

`add_bias(x, b)` broadcasts `b` over the leading axes of `x`: `b` has the
trailing axes of `x` (usually one, `(N,)` for `x` `(..., N)`) and the same
tiles on them. `linear(x, w, b)` is `matmul(x, w)` contracting the last axis of
`x` with the first of `w`, plus `b` shaped like `w`'s output axes (added by
the product's own tasks), so a fused projection `w: (C, 3, H, D)` gives
`(..., 3, H, D)`; `linear(x, w, b, residual=r)` adds a residual connection r the
same way.
"""

from __future__ import annotations

from jnntile import tensor as tensor_mod
from jnntile.ops import gemm
from jnntile.ops._ffi import accumulate, call, differentiable, fresh_targets, grad_target, release
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


def _linear_forward(x, w, b, residual, params, zero_grad):
    trans_a, trans_b, alpha, ndim, batch_ndim = params
    shape, tile_shape = gemm.layout(x, w, trans_a, trans_b, ndim, batch_ndim)
    out = tensor_mod.new_handle(shape, x.dtype, tile_shape)
    token = call("gemm", [x.handle, w.handle, out, None if b is None else b.handle,
                          None if residual is None else residual.handle],
                 [t.token for t in (x, w, b, residual) if t is not None], zero_grads=[out] if zero_grad else [],
                 trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=0.0, ndim=ndim, batch_ndim=batch_ndim)
    return Tensor(token, out), (x, w, b, residual, Tensor(token, out))


def _linear_backward(params, residuals, g):
    x, w, b, residual, out = residuals
    if b is None:
        token = gemm.backward_call(params, x, w, out, g)
    elif grad_target(w) is not None and grad_target(b) is not None:  # db summed in dW's tasks (ops/gemm.cc)
        token = gemm.backward_call(params, x, w, out, g, bias=b)
    else:
        token = backward_call(out, g, None, b, [gemm.backward_call(params, x, w, out, g), b.token])
    if residual is not None:
        # A copy, not the tiles themselves (`source_dies`): the products above still read them, and the residual
        # stream's gradient is added into next, which would wait for those reads.
        token = accumulate(tensor_mod.grad_handle(out.handle), [grad_target(residual)],
                           [token, g.token, residual.token], [1.0])
    token = release(token, out)
    return tuple(None if t is None else t.with_token(token) for t in (x, w, b, residual))


_linear = differentiable(_linear_forward, _linear_backward, nondiff_argnums=(4,), name="linear")


def linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, ndim: int = 1, trans_b: bool = False,
           residual: Tensor | None = None) -> Tensor:
    """x @ w (+ b) (+ residual): x (..., C..) tiled (..., tc..), w (C.., N..) tiled (tc.., tn..) (`trans_b`:
    (N.., C..)), b (N..) tiled (tn..); `ndim` counts the C axes; `residual` has the result's layout and dtype.

    The result is (..., N..) tiled (..., tn..). The bias and the residual are added by the product's own tasks,
    not by a pass of their own over the result; the bias's gradient needs no copy of the result's: it is summed
    in the tasks of w's gradient (a pass of its own over dy only when w is frozen).
    """
    if b is None and residual is None:
        return gemm.matmul(x, w, trans_b=trans_b, ndim=ndim)
    out_axes = slice(0, w.ndim - ndim) if trans_b else slice(ndim, w.ndim)
    if b is not None:
        if b.shape != w.shape[out_axes] or b.tile_shape != w.tile_shape[out_axes]:
            raise ValueError(f"linear: b (shape {b.shape}, tile_shape {b.tile_shape}) must match w's output axes "
                             f"(shape {w.shape[out_axes]}, tile_shape {w.tile_shape[out_axes]})")
        if b.dtype != "float32":
            raise TypeError(f"linear: b must be float32 (a bias stays a float32 master), got {b!r}")
    shape, tile_shape = gemm.layout(x, w, False, trans_b, ndim, 0)
    if residual is not None and (residual.shape, residual.tile_shape, residual.dtype) != (shape, tile_shape, x.dtype):
        raise ValueError(f"linear: the residual {residual!r} must have the result's shape {shape}, tiles "
                         f"{tile_shape} and dtype {x.dtype}")
    return _linear(x, w, b, residual, (False, bool(trans_b), 1.0, int(ndim), 0))
