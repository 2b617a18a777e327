"""Rotary position embedding (RoPE) over tiles, differentiable in x.

`rotary(x, inv_freq, pos, rotated_parts)` takes x (B, T, P, H, D) tiled
(tb, tt, 1, th, D), such as a fused q/k/v projection (B, T, G + 2, H, D), and
turns each head's pairs (x[c], x[c + D/2]) of the parts p < rotated_parts (the
queries and keys) by the angle (pos + t) * inv_freq[c] of its sequence row t, as
Hugging Face's Llama does (`rotate_half`, cos and sin in float32). The other
parts (the values) are copied. The result is shaped and tiled like x.

`pos`, the position of the first row, is a per-step value (an int32 scalar, a
JAX array under jit) passed as an array operand, so one compiled step serves
every offset, prefill and decoding alike (DESIGN invariant 4). A packed batch,
whose examples each restart at position 0, passes `positions` instead: an int32
(B, T) Tensor tiled (tb, tt) like x's rows, the position of every row. `inv_freq`, the
D/2 frequencies (Llama 3.1's scaling included, `LlamaConfig.inverse_frequencies`),
is fixed by the model and compiled in as an attribute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jnntile import _xla_ffi
from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target, release
from jnntile.core.tensor import Tensor

MAX_HEAD_DIM = _xla_ffi.rotary_max_head_dim  # kernels/rotary.h: the frequencies travel with each task


def _forward(x, pos, inv_freq, rotated_parts, *positions, zero_grad):
    y = tensor_mod.new_handle(x.shape, x.dtype, x.tile_shape)
    token = call("rotary", [x.handle, y, *(p.handle for p in positions)], [x.token, *(p.token for p in positions)],
                 zero_grads=[y] if zero_grad else [], inputs=[pos], inv_freq=inv_freq, rotated_parts=rotated_parts)
    return Tensor(token, y), (x, pos, Tensor(token, y), *positions)


def _backward(inv_freq, rotated_parts, residuals, g):
    x, pos, y, *positions = residuals
    grad_x = grad_target(x)
    (fresh,), written = fresh_targets(grad_x)  # written instead of added to where it holds nothing yet
    token = call("rotary_backward", [tensor_mod.grad_handle(y.handle), grad_x, *(p.handle for p in positions)],
                 [y.token, g.token, x.token, *(p.token for p in positions)], inputs=[pos], writes=written,
                 fresh=fresh, inv_freq=inv_freq, rotated_parts=rotated_parts)
    token = release(token, y)
    # The positions are integers: the scalar's cotangent is the empty float0 kind, the Tensor's only orders.
    return (x.with_token(token), np.zeros(np.shape(pos), dtype=jax.dtypes.float0),
            *(p.with_token(token) for p in positions))


_rotary = differentiable(_forward, _backward, nondiff_argnums=(2, 3), name="rotary")


def rotary(x: Tensor, inv_freq, pos=0, rotated_parts: int | None = None, positions: Tensor | None = None) -> Tensor:
    """x (B, T, P, H, D) with the parts p < rotated_parts (default: all but the last) turned by their
    positions pos, pos + 1, ... along T, or by `positions` (int32 (B, T) tiled like x's rows: a packed batch);
    same layout as x."""
    if not isinstance(x, Tensor) or x.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"rotary: x must be a float32 or bfloat16 jnntile Tensor, got {x!r}")
    if x.ndim != 5:
        raise ValueError(f"rotary: x must have shape (B, T, P, H, D), got {x.shape}; view a projection's output "
                         "(B, T, P * H * D) as (B, T, P, H, D)")
    B, T, P, H, D = x.shape
    tb, tt, tp, th, td = x.tile_shape
    if tp != 1 or td != D:
        raise ValueError(f"rotary: x tile_shape {x.tile_shape} must be 1 on axis 2 and keep the head dimension "
                         f"D={D} whole; use tile_shape ({tb}, {tt}, 1, {th}, {D})")
    if D % 2 or D > MAX_HEAD_DIM:
        raise ValueError(f"rotary: the head dimension D={D} must be even and at most {MAX_HEAD_DIM}")
    inv_freq = tuple(float(f) for f in np.asarray(inv_freq, np.float32).ravel())
    if len(inv_freq) != D // 2:
        raise ValueError(f"rotary: {len(inv_freq)} frequencies for head dimension D={D}; it needs D / 2 = {D // 2}")
    rotated_parts = P - 1 if rotated_parts is None else int(rotated_parts)
    if not 0 <= rotated_parts <= P:
        raise ValueError(f"rotary: rotated_parts={rotated_parts} must be in [0, {P}] (x has {P} parts on axis 2)")
    if jnp.ndim(pos) != 0 or not jnp.issubdtype(jnp.result_type(pos), jnp.integer):
        raise TypeError(f"rotary: pos must be an integer scalar (a per-step jnp.int32 value), got "
                        f"{jnp.result_type(pos)} with shape {jnp.shape(pos)}")
    if positions is None:
        return _rotary(x, jnp.asarray(pos, jnp.int32), inv_freq, rotated_parts)
    rows = (B, T), (tb, tt)
    if not isinstance(positions, Tensor) or positions.dtype != "int32" or (positions.shape,
                                                                           positions.tile_shape) != rows:
        raise ValueError(f"rotary: positions must be an int32 Tensor of shape ({B}, {T}) tiled ({tb}, {tt}), like "
                         f"x's rows, got {positions!r}")
    return _rotary(x, jnp.asarray(pos, jnp.int32), inv_freq, rotated_parts, positions)
