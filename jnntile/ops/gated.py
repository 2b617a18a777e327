"""The SiLU-gated product of Llama's MLP (SwiGLU), differentiable.

`swiglu(x)` takes the fused gate/up projection x (..., 2, I) tiled (..., 1, ti)
(index 0 on axis -2 the gate, 1 the up projection: one matrix product makes
both, and they are separate tiles) and returns silu(gate) * up, (..., I) tiled
(..., ti), with silu(a) = a * sigmoid(a) in float32 as PyTorch computes it.
"""

from __future__ import annotations

from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target, release, tile_bytes
from jnntile.core.tensor import Tensor


def _forward(x, zero_grad):
    y = tensor_mod.new_handle(x.shape[:-2] + x.shape[-1:], x.dtype, x.tile_shape[:-2] + x.tile_shape[-1:])
    token = call("swiglu", [x.handle, y], [x.token], zero_grads=[y] if zero_grad else [])
    return Tensor(token, y), (x, Tensor(token, y))


def _backward(residuals, g):
    x, y = residuals
    grad_x = grad_target(x)
    (fresh,), written = fresh_targets(grad_x)  # written instead of added to where it holds nothing yet
    token = call("swiglu_backward", [x.handle, tensor_mod.grad_handle(y.handle), grad_x],
                 [y.token, g.token, x.token], writes=written, fresh=fresh)
    return (x.with_token(release(token, y)),)


def _footprint(name, inputs, outputs, scratch):
    """The backward's task: gate, up, dy, dgate and dup tiles, each the size of an output tile."""
    (y,) = outputs
    return 5 * tile_bytes(y), "swiglu backward (gate, up, dy, dgate, dup tiles)"


_swiglu = differentiable(_forward, _backward, name="swiglu", footprint=_footprint)


def swiglu(x: Tensor) -> Tensor:
    """silu(x[..., 0, :]) * x[..., 1, :] for x (..., 2, I) tiled (..., 1, ti); the result is (..., I) tiled (..., ti)."""
    if not isinstance(x, Tensor) or x.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"swiglu: x must be a float32 or bfloat16 jnntile Tensor, got {x!r}")
    if x.ndim < 2 or x.shape[-2] != 2:
        raise ValueError(f"swiglu: x must have shape (..., 2, I) (gate and up projections on axis -2), got "
                         f"{x.shape}; view the fused projection's output (..., 2 * I) as (..., 2, I)")
    if x.tile_shape[-2] != 1:
        suggestion = x.tile_shape[:-2] + (1,) + x.tile_shape[-1:]
        raise ValueError(f"swiglu: x tile_shape {x.tile_shape} must be 1 on axis -2 so that gate and up are "
                         f"separate tiles; use tile_shape {suggestion}")
    return _swiglu(x)
