"""Dropout with a counter-based mask, differentiable in x.

Element g (row-major index in the whole tensor) is kept when a hash of
(seed, g) is at least `rate`, so the mask is the same for any tiling and any
number of workers, and the backward recomputes it instead of storing it.
Kept values are scaled by 1 / (1 - rate).

`seed` is a per-step value: a JAX (or numpy, or Python) integer scalar passed
to the native code as an array operand, so a jitted step compiles once and
takes a new seed every call (DESIGN invariant 4). `rate` is a Python float
fixed at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import call, differentiable, grad_target, release
from jnntile.core.tensor import Tensor


def _forward(x, seed, rate, zero_grad):
    out = tensor_mod.new_handle(x.shape, x.dtype, x.tile_shape)
    token = call("dropout", [x.handle, out], [x.token], zero_grads=[out] if zero_grad else [], inputs=[seed],
                 rate=rate)
    return Tensor(token, out), (x, seed, Tensor(token, out))


def _backward(rate, residuals, g):
    x, seed, out = residuals
    token = call("dropout_backward", [tensor_mod.grad_handle(out.handle), grad_target(x)],
                 [out.token, g.token, x.token], inputs=[seed], rate=rate)
    token = release(token, out)
    # The seed is an integer: its cotangent is the empty float0 kind.
    return x.with_token(token), np.zeros(np.shape(seed), dtype=jax.dtypes.float0)


_dropout = differentiable(_forward, _backward, nondiff_argnums=(2,))


def dropout(x: Tensor, rate: float, seed) -> Tensor:
    """x * mask / (1 - rate) with mask ~ Bernoulli(1 - rate) from (seed, element index); same layout as x.

    rate == 0 returns x itself (no task).
    """
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout: rate={rate} must be in [0, 1)")
    if x.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"dropout needs a float32 or bfloat16 tensor, got {x!r}")
    if not jnp.issubdtype(jnp.result_type(seed), jnp.integer) or jnp.ndim(seed) != 0:
        raise TypeError(f"dropout: seed must be an integer scalar (a per-step jnp.int32 value), got "
                        f"{jnp.result_type(seed)} with shape {jnp.shape(seed)}")
    if rate == 0.0:
        return x
    return _dropout(x, jnp.asarray(seed, jnp.int32), rate)
