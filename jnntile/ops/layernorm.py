"""Layer normalization and RMS normalization over the last axis, differentiable in x and the parameters.

`x` is (..., C) tiled (..., tc); `weight` and `bias` are (C,) tiled (tc,). The
C axis may be split into several tiles: per-row statistics are combined across
them natively (in double). `layer_norm`: the variance is the biased one and
`eps` is added inside the square root, as in `torch.nn.LayerNorm` and GPT-2.
`rms_norm`: x / sqrt(mean(x^2) + eps) * weight, no bias, as Llama's RMSNorm; the
same kernels with the mean taken as 0. The forward saves per-row (mean, rstd)
as a float32 tensor (..., 2) for the backward.
"""

from __future__ import annotations

import math

from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target, release, tile_bytes
from jnntile.core.tensor import Tensor


def _check(op: str, x: Tensor, params: dict, eps: float):
    if x.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32 or bfloat16, got {x!r}")
    for name, t in params.items():  # parameters stay float32 masters, whatever x's dtype
        if t.dtype != "float32":
            raise TypeError(f"{op}: {name} must be float32, got {t!r}")
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least one axis (the normalized one)")
    C, tc = x.shape[-1], x.tile_shape[-1]
    for name, t in params.items():
        if t.shape != (C,):
            raise ValueError(f"{op}: {name} has shape {t.shape} but x {x.shape} needs ({C},)")
        if t.tile_shape != (tc,):
            raise ValueError(f"{op}: {name} tile_shape {t.tile_shape} must equal x's tile on the normalized "
                             f"axis ({tc},) (x tile_shape {x.tile_shape}); tile {name} the same way")
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps={eps} must be non-negative")


def _forward(x, weight, bias, eps, zero_grad):
    # The per-row (mean, rstd) are only read by the backward: kept only when differentiating.
    y = tensor_mod.new_handle(x.shape, x.dtype, x.tile_shape)
    stats = tensor_mod.new_handle(x.shape[:-1] + (2,), "float32", x.tile_shape[:-1] + (2,)) if zero_grad else None
    centered = bias is not None
    token = call("layer_norm", [x.handle, weight.handle, bias.handle if centered else None, y, stats],
                 [x.token, weight.token] + ([bias.token] if centered else []),
                 zero_grads=[y] if zero_grad else [], eps=eps, centered=centered)
    y = Tensor(token, y)
    stats = None if stats is None else Tensor(token, stats)
    return y, (x, weight, bias, stats, y)


def _backward(eps, residuals, g):
    x, weight, bias, stats, y = residuals
    centered = bias is not None
    grad_params = [h for h in (grad_target(weight), grad_target(bias) if centered else None) if h is not None]
    # The parameters' gradients are written, not filled and added to, when all of them hold nothing yet.
    fresh = bool(grad_params) and all(fresh_targets(*grad_params)[0])
    token = call("layer_norm_backward",
                 [x.handle, weight.handle, stats.handle, tensor_mod.grad_handle(y.handle), grad_target(x),
                  grad_target(weight), grad_target(bias) if centered else None],
                 [y.token, g.token, x.token, weight.token] + ([bias.token] if centered else []), centered=centered,
                 writes=grad_params if fresh else [], fresh_params=fresh)
    token = release(token, y, stats)  # the saved (mean, rstd) too
    return x.with_token(token), weight.with_token(token), bias.with_token(token) if centered else None


def _footprint(name, inputs, outputs, scratch):
    """The backward's dx task: x, stats, weight, dy and dx tiles, and two doubles of sums per row."""
    x, weight = inputs[:2]
    (stats,) = scratch
    rows = math.prod(x.tile_shape[:-1])
    return 3 * tile_bytes(x) + tile_bytes(stats) + tile_bytes(weight) + 2 * 8 * rows, f"{name} backward"


_layer_norm = differentiable(_forward, _backward, nondiff_argnums=(3,), name="layer_norm", footprint=_footprint)
_rms_norm = differentiable(_forward, _backward, nondiff_argnums=(3,), name="rms_norm", footprint=_footprint)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis; same layout as x."""
    eps = float(eps)
    _check("layer_norm", x, {"weight": weight, "bias": bias}, eps)
    return _layer_norm(x, weight, bias, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (Llama's RMSNorm); same layout as x."""
    eps = float(eps)
    _check("rms_norm", x, {"weight": weight}, eps)
    return _rms_norm(x, weight, None, eps)
