"""Cross-entropy fused with softmax over a (possibly tiled) vocabulary axis.

`cross_entropy(logits (B, T, V), targets (B, T))` is the mean over tokens whose
target is not `ignore_index` of logsumexp(logits) - logits[target], and 0 when
every target is ignored. Targets must be tiled like the logits on (B, T); the
vocabulary axis may have any tile size (see xla_ffi/ops/loss.cc for the tasks).

A target outside [0, V) that is not `ignore_index` contributes only its
logsumexp (and only softmax to the gradient): the model validates token ids
before they get here, this only keeps a bad id from crashing the process.
"""

from __future__ import annotations

import numpy as np

from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target, release, tile_bytes
from jnntile.core.tensor import Tensor


def _check(logits: Tensor, targets: Tensor, ignore_index) -> None:
    if not isinstance(logits, Tensor) or not isinstance(targets, Tensor):
        raise TypeError(f"cross_entropy: logits and targets must be jnntile Tensors, got "
                        f"{type(logits).__name__} and {type(targets).__name__}")
    if logits.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"cross_entropy: logits must be float32 or bfloat16, got {logits!r}")
    if targets.dtype != "int32":
        raise TypeError(f"cross_entropy: targets must be int32 token ids, got {targets!r}")
    if logits.ndim != 3:
        raise ValueError(f"cross_entropy: logits must have shape (B, T, V), got {logits.shape}")
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"cross_entropy: targets shape {targets.shape} must be the logits' (B, T) = "
                         f"{logits.shape[:2]} (logits {logits.shape})")
    if targets.tile_shape != logits.tile_shape[:2]:
        raise ValueError(f"cross_entropy: targets tile_shape {targets.tile_shape} must equal the logits' tiles "
                         f"on (B, T), {logits.tile_shape[:2]} (logits tile_shape {logits.tile_shape}); create "
                         f"the targets with tile_shape={logits.tile_shape[:2]}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    if not -2**31 <= ignore_index < 2**31:
        raise ValueError(f"cross_entropy: ignore_index {ignore_index} does not fit in int32 like the targets")


def _forward(logits: Tensor, targets: Tensor, ignore_index: int, zero_grad: bool):
    """Submits the forward; returns the loss and the residuals (inputs, loss, lse per token, 1 / count)."""
    loss = tensor_mod.new_handle((), "float32", ())
    lse = tensor_mod.new_handle(logits.shape[:2], "float32", logits.tile_shape[:2])
    inv_count = tensor_mod.new_handle((), "float32", ())
    token = call("cross_entropy", [logits.handle, targets.handle, loss, lse, inv_count],
                 [logits.token, targets.token], zero_grads=[loss] if zero_grad else [],
                 ignore_index=ignore_index)
    loss, lse, inv_count = (Tensor(token, h) for h in (loss, lse, inv_count))
    return loss, (logits, targets, loss, lse, inv_count)


def _backward(ignore_index, residuals, g):
    logits, targets, loss, lse, inv_count = residuals
    grad_logits = grad_target(logits)
    (fresh,), written = fresh_targets(grad_logits)  # written, not added into, where it holds nothing yet
    # Invariant 1: loss.token (the forward, which also wrote lse and inv_count) orders this call.
    token = call("cross_entropy_backward",
                 [logits.handle, targets.handle, lse.handle, inv_count.handle,
                  tensor_mod.grad_handle(loss.handle), grad_logits],
                 [loss.token, g.token, logits.token, targets.token], writes=written, ignore_index=ignore_index,
                 fresh_dlogits=fresh)
    token = release(token, loss, lse, inv_count)
    return logits.with_token(token), targets.with_token(token)


def _footprint(name, inputs, outputs, scratch):
    logits, targets = inputs
    lse = scratch[0]
    return (2 * tile_bytes(logits) + tile_bytes(targets) + tile_bytes(lse),
            "cross_entropy backward (logits, dlogits tiles)")


_cross_entropy = differentiable(_forward, _backward, nondiff_argnums=(2,), name="cross_entropy", footprint=_footprint)


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of `logits` (B, T, V) against int32 `targets` (B, T) as a scalar tensor.

    Tokens whose target equals `ignore_index` are left out of the mean (and get
    a zero gradient); the loss is 0 when all are. Differentiable in `logits`.
    """
    _check(logits, targets, ignore_index)
    return _cross_entropy(logits, targets, int(ignore_index))
