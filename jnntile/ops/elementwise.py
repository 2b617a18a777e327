"""Elementwise ops on tensors of identical shape, tiling and dtype (float32 or bfloat16, computed in float32).

Unary functions are declared once, natively (`Unary` in xla_ffi/kernels/elementwise.h,
bound as `jnntile._xla_ffi.Unary`); `gelu_tanh`, `relu`, ... are generated from
it, and `UNARY` gives each its jnp reference, which tests compare against.
Linear ops (add, axpby, scale, copy) share one backward: accumulate the output
gradient, scaled, into each input gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jnntile import _xla_ffi
from jnntile.core import tensor as tensor_mod
from jnntile.ops._ffi import accumulate, call, differentiable, fresh_targets, grad_target, release, tile_bytes
from jnntile.core.tensor import Tensor

# name (a member of _xla_ffi.Unary): jnp reference
UNARY = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "exp": jnp.exp,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
}


def _require_float(*tensors: Tensor):
    for t in tensors:
        if t.dtype not in tensor_mod.FLOAT_DTYPES:
            raise TypeError(f"elementwise ops need float32 or bfloat16 tensors, got {t!r}")
    if len({t.dtype for t in tensors}) > 1:
        raise TypeError(f"elementwise ops need tensors of one dtype, got {', '.join(map(repr, tensors))}")


def _require_same_layout(x: Tensor, y: Tensor):
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {x.shape} vs {y.shape}")
    if x.tile_shape != y.tile_shape:
        raise ValueError(f"tile shapes differ for shape {x.shape}: {x.tile_shape} vs {y.tile_shape}")


def _new_like(x: Tensor):
    return tensor_mod.new_handle(x.shape, x.dtype, x.tile_shape)


# ---- unary family --------------------------------------------------------------

def _unary_forward(x, code, zero_grad):
    out = _new_like(x)
    token = call("unary", [x.handle, out], [x.token], zero_grads=[out] if zero_grad else [], op=code)
    return Tensor(token, out), (x, Tensor(token, out))


def _unary_backward(code, residuals, g):
    x, out = residuals
    grad_x = grad_target(x)
    (fresh,), written = fresh_targets(grad_x)  # dx = dy f'(x) where dx holds nothing yet
    token = call("unary_backward", [x.handle, tensor_mod.grad_handle(out.handle), grad_x],
                 [out.token, g.token, x.token], writes=written, fresh=fresh, op=code)
    return (x.with_token(release(token, out)),)


def _unary_footprint(name, inputs, outputs, scratch):
    (x,) = inputs
    return 3 * tile_bytes(x), "unary backward (x, dy, dx tiles)"


_unary = differentiable(_unary_forward, _unary_backward, nondiff_argnums=(1,), name="unary",
                        footprint=_unary_footprint)


def _make_unary(name: str):
    code = _xla_ffi.Unary[name].value

    def op(x: Tensor) -> Tensor:
        _require_float(x)
        return _unary(x, code)

    op.__name__ = name
    op.__doc__ = f"Elementwise {name}, differentiable."
    return op


gelu_tanh = _make_unary("gelu_tanh")
relu = _make_unary("relu")
tanh = _make_unary("tanh")
exp = _make_unary("exp")
silu = _make_unary("silu")
sigmoid = _make_unary("sigmoid")


# ---- linear family: out = a * x (+ b * y) -------------------------------------------

def _linear_forward(inputs, coeffs, zero_grad):
    out = _new_like(inputs[0])
    attrs = {"a": coeffs[0]} if len(inputs) == 1 else {"a": coeffs[0], "b": coeffs[1]}
    token = call("axpby", [t.handle for t in inputs] + [out], [t.token for t in inputs],
                 zero_grads=[out] if zero_grad else [], **attrs)
    return Tensor(token, out), (inputs, Tensor(token, out))


def _linear_backward(coeffs, residuals, g):
    inputs, out = residuals
    token = accumulate(tensor_mod.grad_handle(out.handle), [grad_target(t) for t in inputs],
                       [out.token, g.token] + [t.token for t in inputs], coeffs, source_dies=True)
    token = release(token, out)
    return (tuple(t.with_token(token) for t in inputs),)


_linear = differentiable(_linear_forward, _linear_backward, nondiff_argnums=(1,), name="add")


def axpby(a: float, x: Tensor, b: float, y: Tensor) -> Tensor:
    """a * x + b * y as a new tensor."""
    _require_float(x, y)
    _require_same_layout(x, y)
    return _linear((x, y), (float(a), float(b)))


def add(x: Tensor, y: Tensor) -> Tensor:
    return axpby(1.0, x, 1.0, y)


# ---- a part: out = x with y added to its part of x along one axis ---------------------------------------

def _add_part_forward(x, y, axis, offset, zero_grad):
    out = _new_like(x)
    token = call("axpby", [x.handle, out], [x.token], zero_grads=[out] if zero_grad else [], a=1.0)
    token = call("accumulate_part", [y.handle, out], [token, y.token], axis=axis, offset=offset, alpha=1.0, fresh=0,
                 into_part=0)
    return Tensor(token, out), (x, y, Tensor(token, out))


def _add_part_backward(axis, offset, residuals, g):
    x, y, out = residuals
    grad_out = tensor_mod.grad_handle(out.handle)
    token, grad_y = g.token, grad_target(y)
    if grad_y is not None:
        (fresh,), written = fresh_targets(grad_y)
        token = call("accumulate_part", [grad_out, grad_y], [out.token, token, y.token], writes=written, axis=axis,
                     offset=offset, alpha=1.0, fresh=fresh, into_part=1)
    token = accumulate(grad_out, [grad_target(x)], [out.token, token, x.token], [1.0], source_dies=True)
    token = release(token, out)
    return x.with_token(token), y.with_token(token)


_add_part = differentiable(_add_part_forward, _add_part_backward, nondiff_argnums=(2, 3), name="add_part")


def add_part(x: Tensor, y: Tensor, axis: int, start: int) -> Tensor:
    """x with y added to its part that starts at index `start` of `axis` (and spans y's extent there), as a new
    tensor. y is tiled as x and its part is whole tiles of x (`start` and y's extent multiples of x's tile along
    `axis`): the adapter of one part of a fused projection adds into that part of the product."""
    _require_float(x, y)
    axis = axis % x.ndim
    tile = x.tile_shape[axis]
    others = [d for d in range(x.ndim) if d != axis]
    if y.ndim != x.ndim or [y.shape[d] for d in others] != [x.shape[d] for d in others] or \
            y.tile_shape != x.tile_shape or start % tile or not 0 <= start <= x.shape[axis] - y.shape[axis] or \
            (y.shape[axis] % tile and start + y.shape[axis] != x.shape[axis]):
        raise ValueError(f"add_part: {y!r} is not a part of whole tiles of {x!r} along axis {axis} at {start}")
    return _add_part(x, y, axis, start // tile)


def scale(a: float, x: Tensor) -> Tensor:
    """a * x as a new tensor."""
    _require_float(x)
    return _linear((x,), (float(a),))


def copy(x: Tensor) -> Tensor:
    """A new tensor with the values (and tiling) of x."""
    return scale(1.0, x)
