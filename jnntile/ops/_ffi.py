"""The one way every op reaches the native code.

`call` passes tensor ids as an int32 buffer (so one compiled call serves every
tensor), the tokens of the tensors touched (so XLA orders the calls the way
StarPU must see them, DESIGN invariant 2) and static attributes, and returns
the fresh token. It also pins tensors created while tracing and remembers the
latest concrete token of each eager tensor so freeing waits for it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jnntile import tensor as tensor_mod
from jnntile.tensor import Tensor, _Handle

TOKEN = jax.ShapeDtypeStruct((), jnp.float32)


def _attr(value):
    if isinstance(value, bool):
        return np.int64(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    if isinstance(value, (tuple, list)):
        is_int = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
        return np.asarray(value, dtype=np.int64 if is_int else np.float64)
    raise TypeError(f"unsupported attribute value {value!r}")


def _ids(handles: Sequence[_Handle | None]) -> np.ndarray:
    """Tensor ids; None (a gradient nobody needs) becomes -1 and is skipped natively."""
    for handle in handles:
        if handle is not None:
            handle.check_alive()
    return np.asarray([-1 if h is None else h.id for h in handles], dtype=np.int32)


def after(token, *handles: _Handle):
    """Records `token` as the latest op on `handles` (pins them if tracing)."""
    tracing = isinstance(token, jax.core.Tracer)
    for handle in (h for h in handles if h is not None):
        if tracing:  # the compiled program refers to this id: keep it
            tensor_mod._pinned.add(handle)
        else:
            handle.last_token = token
    return token


def call(target: str, handles: Sequence[_Handle], tokens: Sequence, *,
         zero_grads: Sequence[_Handle] = (), inputs: Sequence = (), **attrs):
    """Calls FFI target `jnntile_<target>` on `handles` after `tokens`.

    `zero_grads` names tensors whose gradient companions this call zeroes;
    `inputs` are extra array operands placed after the id buffer: per-step
    values (a learning rate, a seed) that must not be attributes, because an
    attribute is compiled into the program (DESIGN invariant 4).
    """
    for handle in zero_grads:  # create the companions now, before the native call needs them
        tensor_mod.grad_handle(handle)
        handle.grad_zeroed = True
    ids = _ids(list(handles) + list(zero_grads))
    if zero_grads:
        attrs["zero_grads"] = len(zero_grads)
    if inputs:
        attrs["n_inputs"] = len(inputs)
    fn = jax.ffi.ffi_call(f"jnntile_{target}", TOKEN, has_side_effect=True)
    token = fn(ids, *inputs, *tokens, **{k: _attr(v) for k, v in attrs.items()})
    return after(token, *handles)


def join(*tokens):
    """One token that depends on all of `tokens` (for calls after several writes)."""
    tokens = [t for t in tokens if t is not None]
    out = tokens[0]
    for t in tokens[1:]:
        out = out + t
    return out


def grad_target(t: Tensor) -> _Handle | None:
    """Where a backward op accumulates the gradient of `t`, or None if nobody zeroed it."""
    if t.dtype != "float32" or not t.handle.grad_zeroed:
        return None
    return tensor_mod.grad_handle(t.handle)
