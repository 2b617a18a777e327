"""Embedding lookup: out[b, t, :] = table[ids[b, t], :], differentiable in the table.

`ids` is an int32 Tensor (B, T) tiled (tb, tt) (any number of axes works);
`table` is a Tensor (V, C) tiled (tv, tc): float32, or bfloat16 for a frozen
table (`nn.base_dtype`: it has no gradient); the output is (B, T, C) tiled
(tb, tt, tc). The vocabulary axis may be split into several tiles; each id is
looked up in the tile that holds it. Position embeddings are the same op with
position ids: see `position_ids`.

Ids must lie in [0, V). Under `jax.jit` their values are not visible to
Python, so nothing here can check them: the model validates token ids with
`check_ids` on the host before writing them into a tensor. The native kernels
never index outside the table: an out-of-range id gives a zero row and no
gradient.
"""

from __future__ import annotations

import jax
import numpy as np

from jnntile.core import tensor as tensor_mod
from jnntile.ops import values
from jnntile.ops._ffi import call, differentiable, grad_target, release
from jnntile.core.tensor import Tensor


def check_ids(ids, vocab_size: int) -> None:
    """Raises ValueError if an id of the (eager, numpy or JAX) integer array is outside [0, vocab_size)."""
    if isinstance(ids, jax.core.Tracer):
        raise TypeError("check_ids needs concrete ids (numpy or an eager JAX array), not a traced value: "
                        "validate the ids before the jitted step")
    array = np.asarray(ids)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
    bad = (array < 0) | (array >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"token id {int(array[where])} at index {where} is outside the vocabulary "
                         f"[0, {vocab_size}) (vocab_size={vocab_size}); {int(bad.sum())} ids are out of range")


def position_ids(batch: int, seq_len: int, tile_shape=None) -> Tensor:
    """An int32 Tensor (batch, seq_len) whose every row is arange(seq_len), for position embeddings.

    Blocks while writing; create it once per (batch, seq_len, tiling) and reuse it.
    """
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len))
    return values.from_array(np.ascontiguousarray(positions), tile_shape)


def _layout(ids: Tensor, table: Tensor):
    """Shape and tile shape of the output; raises naming the argument at fault."""
    if ids.dtype != "int32":
        raise TypeError(f"embedding: ids must be int32, got {ids!r}; write the ids as np.int32")
    if table.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"embedding: table must be float32 or bfloat16, got {table!r}")
    if table.ndim != 2:
        raise ValueError(f"embedding: table must be (vocab_size, channels), got shape {table.shape}")
    return ids.shape + table.shape[1:], ids.tile_shape + table.tile_shape[1:]


def _forward(ids, table, dtype, zero_grad):
    shape, tile_shape = _layout(ids, table)
    out = tensor_mod.new_handle(shape, dtype, tile_shape)
    token = call("embedding", [ids.handle, table.handle, out], [ids.token, table.token],
                 zero_grads=[out] if zero_grad else [])
    return Tensor(token, out), (ids, table, Tensor(token, out))


def _backward(dtype, residuals, g):
    ids, table, out = residuals
    target = grad_target(table)
    if target is not None and table.dtype != "float32":
        raise TypeError(f"embedding: the gradient of a {table.dtype} table ({table!r}) was asked for, and only a "
                        "float32 table has one: a bfloat16 table is a frozen base (nn.base_dtype); build a table "
                        "to train outside nn.base_dtype(\"bfloat16\"), or leave it out of the differentiation")
    token = call("embedding_backward", [ids.handle, tensor_mod.grad_handle(out.handle), target],
                 [out.token, g.token, ids.token, table.token])
    token = release(token, out)
    return ids.with_token(token), table.with_token(token)


_embedding = differentiable(_forward, _backward, nondiff_argnums=(2,), name="embedding")


def embedding(ids: Tensor, table: Tensor, dtype: str = "float32") -> Tensor:
    """table[ids] as a new (*ids.shape, C) tensor tiled (*ids.tile_shape, table.tile_shape[1]), of `dtype`
    (float32 or bfloat16: rows of the table rounded); a float32 table's gradient sums in float32, a bfloat16
    table (frozen) has none."""
    _layout(ids, table)
    if dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"embedding: dtype must be float32 or bfloat16, got {dtype!r}")
    return _embedding(ids, table, dtype)
