"""Tiled matrix multiplication with transposes, alpha and leading batch axes.

Axes are grouped (see xla_ffi/ops/gemm.cc): `a` is [batch][M..][K..] (or
[batch][K..][M..] with trans_a), `b` is [batch][K..][N..] (or [batch][N..][K..]
with trans_b) and the result is [batch][M..][N..]; `ndim` counts the K axes.
Tiles must agree on shared axes. `linear` is the product of a layer: a bias and a residual connection added
by the product's own tasks.
"""

from __future__ import annotations

from jnntile.core import tensor as tensor_mod
from jnntile.ops import bias as bias_ops
from jnntile.ops._ffi import accumulate, call, differentiable, fresh_targets, grad_target, release
from jnntile.core.tensor import Tensor


def layout(a: Tensor, b: Tensor, trans_a, trans_b, ndim, batch_ndim):
    """Shape and tile shape of the result; raises naming the mismatch."""
    if a.dtype not in tensor_mod.FLOAT_DTYPES or b.dtype != a.dtype:
        raise TypeError(f"matmul needs two float32 or two bfloat16 tensors, got {a.dtype} and {b.dtype}")
    m_ndim = a.ndim - batch_ndim - ndim
    n_ndim = b.ndim - batch_ndim - ndim
    if ndim < 1 or batch_ndim < 0 or m_ndim < 0 or n_ndim < 0:
        raise ValueError(f"matmul: a {a.shape} and b {b.shape} have too few axes for ndim={ndim}, "
                         f"batch_ndim={batch_ndim}")

    def groups(t, first_ndim):
        s, ts = t.shape, t.tile_shape
        bb, mid = batch_ndim, batch_ndim + first_ndim
        return (s[:bb], ts[:bb]), (s[bb:mid], ts[bb:mid]), (s[mid:], ts[mid:])

    a_batch, a_first, a_second = groups(a, ndim if trans_a else m_ndim)
    b_batch, b_first, b_second = groups(b, n_ndim if trans_b else ndim)
    a_m, a_k = (a_second, a_first) if trans_a else (a_first, a_second)
    b_k, b_n = (b_second, b_first) if trans_b else (b_first, b_second)
    for what, x, y in (("batch axes", a_batch, b_batch), ("contraction axes", a_k, b_k)):
        if x[0] != y[0]:
            raise ValueError(f"matmul: {what} differ: {x[0]} in a {a.shape} vs {y[0]} in b {b.shape}")
        if x[1] != y[1]:
            raise ValueError(f"matmul: tiles on the {what} differ: {x[1]} in a (tile_shape "
                             f"{a.tile_shape}) vs {y[1]} in b (tile_shape {b.tile_shape})")
    return a_batch[0] + a_m[0] + b_n[0], a_batch[1] + a_m[1] + b_n[1]


def matmul(a: Tensor, b: Tensor, *, trans_a=False, trans_b=False, alpha=1.0, ndim=1,
           batch_ndim=0) -> Tensor:
    """alpha * op(a) @ op(b) as a new tensor; differentiable in a and b."""
    layout(a, b, trans_a, trans_b, ndim, batch_ndim)
    return _matmul(a, b, (bool(trans_a), bool(trans_b), float(alpha), int(ndim), int(batch_ndim)))


def _forward(a, b, params, zero_grad):
    trans_a, trans_b, alpha, ndim, batch_ndim = params
    shape, tile_shape = layout(a, b, trans_a, trans_b, ndim, batch_ndim)
    out = tensor_mod.new_handle(shape, a.dtype, tile_shape)  # products accumulate in float32 either way
    token = call("gemm", [a.handle, b.handle, out], [a.token, b.token], zero_grads=[out] if zero_grad else [],
                 trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=0.0, ndim=ndim, batch_ndim=batch_ndim)
    return Tensor(token, out), (a, b, Tensor(token, out))


def backward_call(params, a: Tensor, b: Tensor, out: Tensor, g: Tensor, bias: Tensor | None = None):
    """The token of the call that adds out's gradient g through the product into a's and b's gradients, and
    for a linear layer (`bias`, whose gradient and b's are both wanted) the column sums of g into bias's,
    in the tasks of b's gradient."""
    trans_a, trans_b, alpha, ndim, batch_ndim = params
    targets = [grad_target(a), grad_target(b)] + ([grad_target(bias)] if bias is not None else [])
    # A gradient still at zero is written by the product, not filled and added to (one pass over its tiles).
    fresh, written = fresh_targets(*targets)
    with_bias = dict(fresh_bias=fresh[2]) if bias is not None else {}
    # Invariant 1: the backward call consumes the forward token (out.token).
    return call("gemm_backward", [a.handle, b.handle, *targets[:2], tensor_mod.grad_handle(out.handle), *targets[2:]],
                [out.token, g.token, a.token, b.token] + ([bias.token] if bias is not None else []), writes=written,
                fresh_a=fresh[0], fresh_b=fresh[1], **with_bias, trans_a=trans_a, trans_b=trans_b, alpha=alpha,
                ndim=ndim, batch_ndim=batch_ndim)


def _backward(params, residuals, g):
    a, b, out = residuals
    token = release(backward_call(params, a, b, out, g), out)  # this was the last use of out and its gradient
    return a.with_token(token), b.with_token(token)


_matmul = differentiable(_forward, _backward, nondiff_argnums=(2,), name="matmul")


def _linear_forward(x, w, b, residual, params, zero_grad):
    trans_a, trans_b, alpha, ndim, batch_ndim = params
    shape, tile_shape = layout(x, w, trans_a, trans_b, ndim, batch_ndim)
    out = tensor_mod.new_handle(shape, x.dtype, tile_shape)
    token = call("gemm", [x.handle, w.handle, out, None if b is None else b.handle,
                          None if residual is None else residual.handle],
                 [t.token for t in (x, w, b, residual) if t is not None], zero_grads=[out] if zero_grad else [],
                 trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=0.0, ndim=ndim, batch_ndim=batch_ndim)
    return Tensor(token, out), (x, w, b, residual, Tensor(token, out))


def linear_backward_rest(token, out: Tensor, g: Tensor, b: Tensor | None, residual: Tensor | None,
                         bias_summed: bool):
    """After the products of a linear layer's backward (`token`): b's gradient unless they summed it
    (`bias_summed`), the residual's, and out released; the token of it all."""
    if b is not None and not bias_summed:
        token = bias_ops.backward_call(out, g, None, b, [token, b.token])
    if residual is not None:
        # A copy, not the tiles themselves (`source_dies`): the products above still read them, and the residual
        # stream's gradient is added into next, which would wait for those reads.
        token = accumulate(tensor_mod.grad_handle(out.handle), [grad_target(residual)],
                           [token, g.token, residual.token], [1.0])
    return release(token, out)


def _linear_backward(params, residuals, g):
    x, w, b, residual, out = residuals
    # db summed in dW's tasks (ops/gemm.cc) where both are wanted
    summed = b is not None and grad_target(w) is not None and grad_target(b) is not None
    token = linear_backward_rest(backward_call(params, x, w, out, g, bias=b if summed else None), out, g, b,
                                 residual, summed)
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
        return matmul(x, w, trans_b=trans_b, ndim=ndim)
    out_axes = slice(0, w.ndim - ndim) if trans_b else slice(ndim, w.ndim)
    if b is not None:
        if b.shape != w.shape[out_axes] or b.tile_shape != w.tile_shape[out_axes]:
            raise ValueError(f"linear: b (shape {b.shape}, tile_shape {b.tile_shape}) must match w's output axes "
                             f"(shape {w.shape[out_axes]}, tile_shape {w.tile_shape[out_axes]})")
        if b.dtype != "float32":
            raise TypeError(f"linear: b must be float32 (a bias stays a float32 master), got {b!r}")
    shape, tile_shape = layout(x, w, False, trans_b, ndim, 0)
    if residual is not None and (residual.shape, residual.tile_shape, residual.dtype) != (shape, tile_shape, x.dtype):
        raise ValueError(f"linear: the residual {residual!r} must have the result's shape {shape}, tiles "
                         f"{tile_shape} and dtype {x.dtype}")
    return _linear(x, w, b, residual, (False, bool(trans_b), 1.0, int(ndim), 0))
