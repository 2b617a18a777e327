"""Causal multi-head self-attention over tiles, FlashAttention-2 style.

`causal_attention(qkv)` takes the c_attn projection viewed as (B, T, 3, H, D)
(q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]; heads contiguous, HF
GPT-2's split of the 3C axis) and returns softmax(q k^T / sqrt(D) + causal
mask) v as (B, T, H, D). Tiles of qkv are (tb, tt, 1, th, D): q, k and v are
separate tiles and the head dimension is whole; the output is tiled
(tb, tt, th, D). Queries and keys share the sequence tile tt, and only one
(tt, tt) block of scores exists per task, so memory does not grow with T^2
(see xla_ffi/ops/attention.cc for the tasks).
"""

from __future__ import annotations

from jnntile import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, grad_target, release
from jnntile.tensor import Tensor


def _check(qkv: Tensor) -> None:
    if not isinstance(qkv, Tensor):
        raise TypeError(f"causal_attention: qkv must be a jnntile Tensor, got {type(qkv).__name__}")
    if qkv.dtype != "float32":
        raise TypeError(f"causal_attention: qkv must be float32, got {qkv!r}")
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"causal_attention: qkv must have shape (B, T, 3, H, D), got {qkv.shape}; view the "
                         "c_attn output (B, T, 3 * H * D) as (B, T, 3, H, D)")
    B, T, _, H, D = qkv.shape
    tb, tt, t3, th, td = qkv.tile_shape
    if t3 != 1:
        raise ValueError(f"causal_attention: qkv tile_shape {qkv.tile_shape} must be 1 on axis 2 so that q, k "
                         f"and v are separate tiles; use tile_shape ({tb}, {tt}, 1, {th}, {D})")
    if td != D:
        raise ValueError(f"causal_attention: qkv tile_shape {qkv.tile_shape} must keep the head dimension D={D} "
                         f"whole; use tile_shape ({tb}, {tt}, 1, {th}, {D})")


def _forward(qkv: Tensor, zero_grad: bool):
    """Submits the forward; returns the output and the residuals (qkv, output, logsumexp per query row (B, T, H))."""
    B, T, _, H, D = qkv.shape
    tb, tt, _, th, _ = qkv.tile_shape
    out = tensor_mod.new_handle((B, T, H, D), "float32", (tb, tt, th, D))
    lse = tensor_mod.new_handle((B, T, H), "float32", (tb, tt, th))
    token = call("attention", [qkv.handle, out, lse], [qkv.token], zero_grads=[out] if zero_grad else [])
    return Tensor(token, out), (qkv, Tensor(token, out), Tensor(token, lse))


def _backward(residuals, g):
    qkv, out, lse = residuals
    # Invariant 1: out.token (the forward, which also wrote lse) orders this call.
    token = call("attention_backward",
                 [qkv.handle, out.handle, lse.handle, tensor_mod.grad_handle(out.handle), grad_target(qkv)],
                 [out.token, g.token, qkv.token])
    # The backward read out and lse: they, and out's gradient, are dead now.
    return (qkv.with_token(release(token, out, lse)),)


_causal_attention = differentiable(_forward, _backward)


def causal_attention(qkv: Tensor) -> Tensor:
    """Causal softmax attention with scale 1/sqrt(D): qkv (B, T, 3, H, D) -> (B, T, H, D).

    Differentiable in qkv; the backward recomputes the scores tile by tile.
    """
    _check(qkv)
    return _causal_attention(qkv)
