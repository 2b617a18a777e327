"""Causal self-attention over tiles, FlashAttention-2 style, multi-head or grouped-query.

`causal_attention(qkv)` takes the fused q/k/v projection viewed as
(B, T, G + 2, H, D): G query heads share each of the H key/value heads
(grouped-query attention, as Llama's num_key_value_heads; G = 1 is GPT-2's
multi-head attention, its c_attn output (B, T, 3, H, D)). Axis 2 index g < G
holds group member g's queries, index G the keys, G + 1 the values. It returns
softmax(q k^T / sqrt(D) + causal mask) v as (B, T, G, H, D), or (B, T, H, D)
where G = 1. Tiles of qkv are (tb, tt, 1, th, D): queries, keys and values are
separate tiles and the head dimension is whole; the output is tiled
(tb, tt, 1, th, D) ((tb, tt, th, D) where G = 1). Queries and keys share the
sequence tile tt, only one (tt, tt) block of scores exists per task, so memory
does not grow with T^2, and a task takes the query tiles of a whole group, so
each key and value tile is read once per group (see xla_ffi/ops/attention.cc).

Packed batches (document masking): `causal_attention(qkv, documents)` with
`documents(segments, tile_shape)` lets query t attend only to keys s <= t of its
own example, a run of equal ids in its row of `segments` (B, T) (padding, id 0,
attends to the padding before it; its outputs are never trained). The op reads
where each example starts when it submits, as a per-step array, so one compiled
step serves every batch: a (query tile, key tile) pair wholly outside every
query's example runs no task, one wholly inside runs as without masking, and
only a mixed one masks per element.

Incremental decoding (forward only) keeps the keys and values of past
positions in a cache (B, T_max, 2, H, D) tiled (tb, tc, 1, th, D) (`kv_cache`):
`cache_write(qkv, cache, pos)` stores the k and v of qkv, whose rows are the
positions pos .. pos + T - 1, and `cached_attention(qkv, cache, pos)` attends
from its queries to the cached positions 0 .. pos + T - 1. `pos` is a per-step
value (an int32 scalar, a JAX array under jit), not an attribute, so one
compiled step serves every position (DESIGN invariant 4); the tasks touch only
the cache tiles up to pos + T, so a step costs O(pos).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jnntile.core import tensor as tensor_mod
from jnntile.ops import values
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target, on_host, release, tile_bytes
from jnntile.core.tensor import Tensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Documents:
    """Where each position's example starts, for document masking (`documents`): query t of a row sees keys
    starts[t] .. t. `starts` is the int32 (B, T) Tensor the mixed pairs' tasks read, tiled like qkv's (B, T);
    `host` the same values as an array the op reads when it submits (to skip and classify pairs)."""

    starts: Tensor
    host: jax.Array


def segment_starts(segments) -> jax.Array:
    """For int (B, T) segment ids, the first position of each position's example: of the run of equal ids it
    lies in (traceable)."""
    segments = jnp.asarray(segments)
    T = segments.shape[-1]
    begins = jnp.concatenate([jnp.ones(segments.shape[:-1] + (1,), bool), segments[..., 1:] != segments[..., :-1]],
                             axis=-1)
    return jax.lax.cummax(jnp.where(begins, jnp.arange(T, dtype=jnp.int32), 0), axis=segments.ndim - 1)


def documents(segments, tile_shape) -> Documents:
    """The Documents of int (B, T) segment ids (an example is a run of equal ids in a row; the data layer numbers
    them 1, 2, ... and pads with 0), for a qkv whose (B, T) tiles are `tile_shape` (tb, tt)."""
    if jnp.ndim(segments) != 2 or not jnp.issubdtype(jnp.result_type(segments), jnp.integer):
        raise TypeError(f"documents: segments must be an integer (B, T) array, got {jnp.result_type(segments)} "
                        f"with shape {jnp.shape(segments)}")
    host = on_host(segment_starts, segments)
    return Documents(values.from_array(host, tuple(tile_shape)), host)


def _check(qkv: Tensor, op: str = "causal_attention") -> None:
    if not isinstance(qkv, Tensor):
        raise TypeError(f"{op}: qkv must be a jnntile Tensor, got {type(qkv).__name__}")
    if qkv.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"{op}: qkv must be float32 or bfloat16, got {qkv!r}")
    if qkv.ndim != 5 or qkv.shape[2] < 3:
        raise ValueError(f"{op}: qkv must have shape (B, T, G + 2, H, D), got {qkv.shape}; view the fused "
                         "projection's output (B, T, (G + 2) * H * D) as (B, T, G + 2, H, D)")
    B, T, _, H, D = qkv.shape
    tb, tt, t3, th, td = qkv.tile_shape
    if t3 != 1:
        raise ValueError(f"{op}: qkv tile_shape {qkv.tile_shape} must be 1 on axis 2 so that queries, keys "
                         f"and values are separate tiles; use tile_shape ({tb}, {tt}, 1, {th}, {D})")
    if td != D:
        raise ValueError(f"{op}: qkv tile_shape {qkv.tile_shape} must keep the head dimension D={D} "
                         f"whole; use tile_shape ({tb}, {tt}, 1, {th}, {D})")


def output_layout(qkv: Tensor) -> tuple[tuple, tuple]:
    """Shape and tile shape of the attention output for qkv: (B, T, G, H, D), or (B, T, H, D) where G = 1."""
    B, T, P, H, D = qkv.shape
    tb, tt, _, th, _ = qkv.tile_shape
    if P == 3:
        return (B, T, H, D), (tb, tt, th, D)
    return (B, T, P - 2, H, D), (tb, tt, 1, th, D)


def _forward(qkv: Tensor, *documents, zero_grad: bool):
    """Submits the forward; returns the output and the residuals (qkv, output, logsumexp per query row, and
    the Documents where masked)."""
    shape, tile_shape = output_layout(qkv)
    out = tensor_mod.new_handle(shape, qkv.dtype, tile_shape)
    lse = tensor_mod.new_handle(shape[:-1], "float32", tile_shape[:-1])
    handles, tokens, inputs = _masking(documents)
    token = call("attention", [qkv.handle, out, lse, *handles], [qkv.token, *tokens], inputs=inputs,
                 zero_grads=[out] if zero_grad else [])
    return Tensor(token, out), (qkv, Tensor(token, out), Tensor(token, lse), *documents)


def _masking(documents):
    """The starts handle, its token and its host values a masked call adds; nothing for plain causal."""
    if not documents:
        return [], [], []
    (d,) = documents
    return [d.starts.handle], [d.starts.token], [d.host]


def _backward(residuals, g):
    qkv, out, lse, *documents = residuals
    grad_qkv = grad_target(qkv)
    # A bfloat16 gradient that holds nothing yet is not filled: the first step to touch each of its tiles
    # zeroes the tile's float32 sums. A float32 one keeps its fill, which allocates it whole when the backward
    # starts, as the planner counts it (zeroed by the steps instead, its tiles came tile by tile, and the peak
    # fell 5% short of the plan: tests/test_memory.py).
    (fresh,), written = fresh_targets(grad_qkv) if qkv.dtype == "bfloat16" else ((0,), [])
    # Invariant 1: out.token (the forward, which also wrote lse) orders this call.
    handles, tokens, inputs = _masking(documents)
    token = call("attention_backward",
                 [qkv.handle, out.handle, lse.handle, tensor_mod.grad_handle(out.handle), grad_qkv, *handles],
                 [out.token, g.token, qkv.token, *tokens], inputs=inputs, writes=written, fresh=fresh)
    # The backward read out and lse: they, and out's gradient, are dead now.
    token = release(token, out, lse)
    # The starts are integers: no gradient (their Tensor's token orders what follows; the array's is float0).
    return (qkv.with_token(token), *(Documents(d.starts.with_token(token), np.zeros(np.shape(d.host), jax.dtypes.float0))
                                     for d in documents))


def _footprint(name, inputs, outputs, scratch):
    """A query tile's first backward step: per member of a group of G query heads q, dout, dq, lse and delta
    tiles and the out tile its row sums read; k, v, dk and dv; the probabilities and their gradient (tile_seq x
    tile_seq per head of a batch row, kernels/attention.h), reused by the members; in bfloat16 also, in its
    scratch, the float32 copies of the tiles it reads (q and dout per member, k and v) or the bfloat16 copies of
    the probabilities and their gradient, whichever is larger (ops/attention.cc: step_scratch_floats; the
    float32 copies of out and dout for the row sums fit in it)."""
    (qkv, *_), (out,), (lse,) = inputs, outputs, scratch
    groups = qkv.shape[2] - 2
    tt, th = qkv.tile_shape[1], qkv.tile_shape[3]
    extra = 0
    if qkv.dtype == "bfloat16":
        extra = max((2 * groups + 2) * math.prod(out.tile_shape) * 4, th * tt * tt * 2)
    return ((4 * groups + 4) * tile_bytes(out) + 2 * groups * tile_bytes(lse) + 2 * th * tt * tt * 4 + extra,
            "attention backward step")


_causal_attention = differentiable(_forward, _backward, name="attention", footprint=_footprint)


def causal_attention(qkv: Tensor, documents: Documents | None = None) -> Tensor:
    """Causal softmax attention with scale 1/sqrt(D): qkv (B, T, G + 2, H, D) -> (B, T, G, H, D)
    ((B, T, 3, H, D) -> (B, T, H, D) where G = 1); with `documents` (a packed batch) each query attends only
    to the keys of its own example.

    Differentiable in qkv; the backward recomputes the scores tile by tile.
    """
    _check(qkv)
    if documents is None:
        return _causal_attention(qkv)
    B, T, _, _, _ = qkv.shape
    rows = (qkv.tile_shape[0], qkv.tile_shape[1])
    if not isinstance(documents, Documents) or documents.starts.shape != (B, T) or documents.starts.tile_shape != rows:
        raise ValueError(f"causal_attention: documents must come from documents(segments, {rows}) for segments of "
                         f"shape ({B}, {T}), the batch and sequence tiles of qkv {qkv!r}")
    return _causal_attention(qkv, documents)


# ---- incremental decoding -------------------------------------------------------------

def kv_cache(batch: int, length: int, heads: int, head_dim: int, tile_shape) -> Tensor:
    """An empty key/value cache (batch, length, 2, heads, head_dim) tiled `tile_shape` (tb, tc, 1, th, head_dim).

    Its tiles take no memory until `cache_write` writes them.
    """
    shape = (batch, length, 2, heads, head_dim)
    tile_shape = tuple(tile_shape)
    if len(tile_shape) != 5 or tile_shape[2] != 1 or tile_shape[4] != head_dim:
        raise ValueError(f"kv_cache: tile_shape {tile_shape} must be (tb, tc, 1, th, {head_dim}): keys and values in "
                         "separate tiles, the head dimension whole")
    handle = tensor_mod.new_handle(shape, "float32", tile_shape)
    return Tensor(on_host(jnp.zeros, (), jnp.float32), handle)


def _check_cache(qkv: Tensor, cache: Tensor, pos, op: str):
    _check(qkv, op)
    if not isinstance(cache, Tensor) or cache.dtype != "float32":
        raise TypeError(f"{op}: cache must be a float32 jnntile Tensor from kv_cache, got {cache!r}")
    B, T, _, H, D = qkv.shape
    tb, _, _, th, _ = qkv.tile_shape
    if cache.ndim != 5 or cache.shape[2] != 2 or (cache.shape[0], cache.shape[3], cache.shape[4]) != (B, H, D):
        raise ValueError(f"{op}: cache of shape {cache.shape} does not fit qkv {qkv.shape}: it must be "
                         f"(B, T_max, 2, H, D) = ({B}, T_max, 2, {H}, {D})")
    ctb, ctc, _, cth, _ = cache.tile_shape
    if (ctb, cth) != (tb, th):
        raise ValueError(f"{op}: cache tile_shape {cache.tile_shape} must share qkv's batch and head tiles "
                         f"(qkv tile_shape {qkv.tile_shape}): use ({tb}, {ctc}, 1, {th}, {D})")
    if T > cache.shape[1]:
        raise ValueError(f"{op}: qkv holds {T} positions, more than the cache's {cache.shape[1]}")
    if jnp.ndim(pos) != 0 or not jnp.issubdtype(jnp.result_type(pos), jnp.integer):
        raise TypeError(f"{op}: pos must be an integer scalar (a per-step jnp.int32 value), got "
                        f"{jnp.result_type(pos)} with shape {jnp.shape(pos)}")
    # A traced position is checked by the native code when the step runs.
    if not isinstance(pos, jax.core.Tracer) and not 0 <= int(pos) <= cache.shape[1] - T:
        raise ValueError(f"{op}: positions {int(pos)} .. {int(pos) + T - 1} lie outside the cache's "
                         f"{cache.shape[1]} positions")
    return jnp.asarray(pos, jnp.int32)


def cache_write(qkv: Tensor, cache: Tensor, pos) -> Tensor:
    """Writes the keys and values of qkv (B, T, G + 2, H, D) into cache at positions pos .. pos + T - 1.

    Returns the cache after the write (a new token). Positions must be written in
    order from 0: a cache tile whose first row is written here starts afresh (its
    later rows zeroed), while writing into the middle of a tile nothing wrote
    before raises. Positions beyond the cache raise when the step runs.
    """
    pos = _check_cache(qkv, cache, pos, "cache_write")
    # The cache is listed as written: a tile whose first row this call writes
    # starts afresh (also after `data.invalidate`); the native side checks that
    # the tiles it only adds rows to hold data.
    token = call("attention_cache_write", [qkv.handle, cache.handle], [qkv.token, cache.token], inputs=[pos],
                 writes=[cache.handle])
    return cache.with_token(token)


def cached_attention(qkv: Tensor, cache: Tensor, pos) -> Tensor:
    """Causal attention of the queries of qkv (positions pos .. pos + T - 1) over the cache.

    The cache must hold positions 0 .. pos + T - 1 (`cache_write` of this qkv
    first). Shaped and tiled like `causal_attention`'s output; not differentiable.
    """
    pos = _check_cache(qkv, cache, pos, "cached_attention")
    shape, tile_shape = output_layout(qkv)
    out = tensor_mod.new_handle(shape, qkv.dtype, tile_shape)
    token = call("attention_cached", [qkv.handle, cache.handle, out], [qkv.token, cache.token], inputs=[pos])
    return Tensor(token, out)
