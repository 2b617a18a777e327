"""The values of tensors: creating, filling, converting, writing and reading them (gradients flow only through
`to_array`). Named apart from `jnntile.data`, the token datasets."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jnntile import _xla_ffi
from jnntile.core import tensor as tensor_mod
from jnntile.core.ledger import LEDGER
from jnntile.ops import _ffi
from jnntile.ops._ffi import after, call, differentiable, grad_target, join, release
from jnntile.core.tensor import Tensor


def dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in tensor_mod.DTYPES:
        raise TypeError(f"dtype {name!r} is not supported; use one of {sorted(tensor_mod.DTYPES)}")
    return name


def empty(shape: Sequence[int], dtype="float32", tile_shape=None) -> Tensor:
    """A tensor whose tiles hold nothing yet, for a loader that overwrites every tile.

    Nothing is computed or written (to RAM or swap) until the first write of
    each tile; reading a tile before that raises an error.
    """
    handle = tensor_mod.new_handle(shape, dtype_name(dtype), tile_shape)
    return Tensor(after(_ffi.on_host(jnp.zeros, (), jnp.float32), handle), handle)


def full(shape: Sequence[int], value: float, dtype="float32", tile_shape=None) -> Tensor:
    handle = tensor_mod.new_handle(tuple(shape), dtype_name(dtype), tile_shape)
    return Tensor(call("fill", [handle], [], value=float(value)), handle)


def zeros(shape: Sequence[int], dtype="float32", tile_shape=None) -> Tensor:
    return full(shape, 0.0, dtype, tile_shape)


def zeros_like(t: Tensor) -> Tensor:
    """Zeros of t's shape, tiles and dtype; sharded as t is (an optimizer's moments beside a sharded
    parameter: each rank fills and keeps its own shard)."""
    handle = tensor_mod.new_handle(t.shape, t.dtype, t.tile_shape)
    if t.handle.native and handle.native:
        _xla_ffi.tensor_shard_like(handle.id, t.handle.id)
    return Tensor(call("fill", [handle], [], value=0.0), handle)


def _random(shape, seed, normal, a, b, tile_shape, dtype) -> Tensor:
    name = dtype_name(dtype)
    if name not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"random values are float32 or bfloat16, got {name}")
    handle = tensor_mod.new_handle(tuple(shape), name, tile_shape)
    # The seed is data, not an attribute: one compiled call serves every seed. As an
    # attribute, each parameter of a model compiled its own program (1.6 MB of RSS each).
    seed = int(seed) % 2**64
    halves = [np.asarray(seed >> 32, np.uint32), np.asarray(seed & 0xFFFFFFFF, np.uint32)]
    token = call("random", [handle], [], inputs=halves, normal=bool(normal), a=float(a), b=float(b))
    return Tensor(token, handle)


def random_normal(shape, seed: int, std=1.0, mean=0.0, tile_shape=None, dtype="float32") -> Tensor:
    """Normal values that depend only on (seed, element index): same for any tiling. In bfloat16: the float32
    values rounded to nearest even, drawn tile by tile (no float32 tensor is made)."""
    return _random(shape, seed, True, mean, std, tile_shape, dtype)


def random_uniform(shape, seed: int, low=0.0, high=1.0, tile_shape=None, dtype="float32") -> Tensor:
    """Uniform values in [low, high), as `random_normal` draws them."""
    return _random(shape, seed, False, low, high, tile_shape, dtype)


def from_array(array, tile_shape=None, dtype=None) -> Tensor:
    """A new tensor holding `array` (numpy or JAX), cut into tiles of `tile_shape`."""
    if dtype is not None:
        array = jnp.asarray(array, dtype=dtype)
    elif not isinstance(array, jax.Array):
        array = np.asarray(array)
    handle = tensor_mod.new_handle(array.shape, dtype_name(array.dtype), tile_shape)
    return write(Tensor(None, handle), array)


def _write(t: Tensor, array, accumulate: bool):
    writes = () if accumulate else (t.handle,)
    ids = _ffi._ids([t.handle], writes)
    tokens = _ffi.prepare([t.handle], [] if t.token is None else [t.token], writes)
    fn = jax.ffi.ffi_call("jnntile_write", jax.ShapeDtypeStruct((), jnp.float32), has_side_effect=True)
    token = _ffi.on_host(fn, ids, array, *tokens, accumulate=np.int64(accumulate))
    if not accumulate:
        LEDGER.written(t.handle)
    _ffi.record(token, t.handle)
    return after(token, t.handle)


def write(t: Tensor, array) -> Tensor:
    """Overwrites every tile of `t` with `array` (same shape and dtype); blocks."""
    if tuple(array.shape) != t.shape:
        raise ValueError(f"cannot write an array of shape {tuple(array.shape)} into {t!r}")
    if np.dtype(array.dtype).name != t.dtype:
        raise TypeError(f"cannot write an array of dtype {np.dtype(array.dtype).name} into {t!r}")
    if tensor_mod.active_recording() is not None:  # the planner: nothing is written
        return t.with_token(_ffi.on_host(jnp.zeros, (), jnp.float32))
    if isinstance(array, np.ndarray):
        # Host data needs no XLA program (and int64 survives without jax x64).
        return write_chunks(t, lambda chunk: array, max_bytes=math.inf)
    return t.with_token(_write(t, array, accumulate=False))


# ---- a tensor block by block (checkpoints of tensors larger than RAM) ----------------

# Host buffers of checkpoint streaming hold at most this much, or one tile where a tile is larger.
CHUNK_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A block of whole tiles: tiles tile_lo[a] <= i < tile_hi[a], elements start[a] <= j < stop[a] on axis a."""

    tile_lo: tuple[int, ...]
    tile_hi: tuple[int, ...]
    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop))


def chunks(shape, tile_shape, itemsize: int, max_bytes: float | None = None) -> Iterator[Chunk]:
    """Blocks of whole tiles that cover a tensor in row-major order, each at most `max_bytes` (default
    CHUNK_BYTES) or one tile.

    The whole tensor when it fits; else its tile rows (the tiles sharing one
    index on axis 0, a contiguous part of the row-major array), and a row still
    too large is cut the same way on the next axis (a vocabulary or an (H, D, C)
    weight held in one tile row), down to single tiles.
    """
    shape, tile_shape = tuple(shape), tuple(tile_shape)
    max_bytes = CHUNK_BYTES if max_bytes is None else max_bytes
    grid = [-(-n // t) for n, t in zip(shape, tile_shape)]

    def split(lo, hi):
        axis = len(lo)
        start = tuple(i * t for i, t in zip(lo, tile_shape))
        stop = tuple(min(i * t, n) for i, t, n in zip(hi, tile_shape, shape))
        nbytes = itemsize * math.prod(b - a for a, b in zip(start, stop)) * math.prod(shape[axis:])
        if nbytes <= max_bytes or axis == len(shape):
            yield Chunk(lo + (0,) * (len(shape) - axis), hi + tuple(grid[axis:]), start + (0,) * (len(shape) - axis),
                        stop + shape[axis:])
            return
        for i in range(grid[axis]):
            yield from split(lo + (i,), hi + (i + 1,))

    return split((), ())


def read_chunks(t: Tensor, max_bytes: float | None = None) -> Iterator[tuple[Chunk, np.ndarray]]:
    """The values of `t` chunk by chunk (see `chunks`): one host buffer at a time, whatever the tensor's size."""
    tensor_mod.ready_on_host(t, "jnntile.to_array")
    for chunk in chunks(t.shape, t.tile_shape, np.dtype(t.dtype).itemsize, max_bytes):
        out = np.empty(chunk.shape, dtype=t.dtype)
        _xla_ffi.tensor_read(t.id, tensor_mod.native_view(out), list(chunk.tile_lo), list(chunk.tile_hi))
        yield chunk, out
        del out  # before the next one is made


def write_chunks(t: Tensor, values: Callable[[Chunk], np.ndarray], max_bytes: float | None = None) -> Tensor:
    """Overwrites every tile of `t`, chunk by chunk, with `values(chunk)` (an array of the chunk's shape); blocks."""
    tensor_mod.ready_on_host(t, "jnntile.from_array of a JAX array")
    for chunk in chunks(t.shape, t.tile_shape, np.dtype(t.dtype).itemsize, max_bytes):
        array = np.asarray(values(chunk), dtype=t.dtype, order="C")
        if array.shape != chunk.shape:
            raise ValueError(f"values of shape {array.shape} for tiles {chunk.tile_lo} to {chunk.tile_hi} of {t!r}, "
                             f"expected {chunk.shape}")
        _xla_ffi.tensor_write(t.id, tensor_mod.native_view(array), list(chunk.tile_lo), list(chunk.tile_hi))
        del array  # before the next one is read
    LEDGER.written(t.handle)
    return t.with_token(after(_ffi.on_host(jnp.zeros, (), jnp.float32), t.handle))


def _read(t: Tensor) -> jax.Array:
    ids = _ffi._ids([t.handle])
    tokens = _ffi.prepare([t.handle], [t.token])
    fn = jax.ffi.ffi_call("jnntile_read", jax.ShapeDtypeStruct(t.shape, jnp.dtype(t.dtype)),
                          has_side_effect=True)
    out = _ffi.on_host(fn, ids, *tokens)
    # A later invalidation of t in this step must wait for this read.
    if _ffi.current_step() is not None:
        _ffi.record(_ffi.read_token(out), t.handle)
    return out


def _read_forward(t, zero_grad):
    # The values are an array, not a tensor: there is no gradient companion to zero.
    return _read(t), t


def _read_backward(t, g):
    # The cotangent of the values is added into the tensor's gradient.
    grad = grad_target(t)
    if grad is None:
        return (t,)
    return (t.with_token(_write(Tensor(t.token, grad), g, accumulate=True)),)


_read_differentiable = differentiable(_read_forward, _read_backward)


def to_array(t: Tensor) -> jax.Array:
    """The values of `t` as a JAX array, after the op that produced `t.token` (blocks in a compiled program).

    Differentiable for float32 tensors: the gradient flows back into `t`.
    """
    return _read_differentiable(t) if t.dtype == "float32" else _read(t)


def _convert_forward(x, dtype, zero_grad):
    out = tensor_mod.new_handle(x.shape, dtype, x.tile_shape)
    token = call("convert", [x.handle, out], [x.token], zero_grads=[out] if zero_grad else [])
    return Tensor(token, out), (x, Tensor(token, out))


def _convert_backward(dtype, residuals, g):
    x, out = residuals  # the copy's gradient adds into x's, in x's dtype
    token = _ffi.accumulate(tensor_mod.grad_handle(out.handle), [grad_target(x)], [out.token, g.token, x.token],
                            [1.0])
    return (x.with_token(release(token, out)),)


_convert = differentiable(_convert_forward, _convert_backward, nondiff_argnums=(1,), name="convert")


def convert(x: Tensor, dtype) -> Tensor:
    """A copy of `x` (same shape and tiles) in another float dtype, float32 <-> bfloat16, rounded to nearest
    even; differentiable: the copy's gradient adds into x's in x's dtype (a bfloat16 compute copy of a
    float32 master weight hands its gradient to the master)."""
    name = dtype_name(dtype)
    if x.dtype not in tensor_mod.FLOAT_DTYPES or name not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"convert: needs float32 or bfloat16 on both sides, got {x!r} to {name}")
    return _convert(x, name)


def _compute_copy_forward(x, dtype, zero_grad):
    copy = tensor_mod.compute_copy_handle(x.handle, dtype)
    # Native: only the tiles that are not fresh are converted (none after an update that wrote the copy).
    # No zero_grads: the copy's gradient is x's, which its consumers' backward ops add into in float32.
    token = call("convert", [x.handle, copy], [x.token])
    return Tensor(token, copy), (x,)


def _compute_copy_backward(dtype, residuals, g):
    (x,) = residuals  # g's token follows every accumulation into the copy's gradient, that is x's
    return (x.with_token(join(g.token, x.token)),)


_compute_copy = differentiable(_compute_copy_forward, _compute_copy_backward, nondiff_argnums=(1,),
                               name="compute_copy")


def compute_copy(x: Tensor, dtype) -> Tensor:
    """`convert(x, dtype)` into x's persistent compute copy (`tensor.compute_copy_handle`): the weight of a
    model in bfloat16. Converted only where x changed since the copy was last written, and an optimizer
    update of x writes the copy in the same task, so a training step reads 2 bytes per weight, not 4 + 2.
    Differentiable: the copy's gradient companion is x's, so the products of the backward sum the weight's
    gradient in float32 straight into x's (more exact than rounding it to bfloat16 first, and no pass adds
    one into the other)."""
    name = dtype_name(dtype)
    if x.dtype != "float32" or name != "bfloat16":
        raise TypeError(f"compute_copy: makes bfloat16 copies of float32 tensors, got {x!r} to {name}")
    return _compute_copy(x, name)


def fill(t: Tensor, value: float) -> Tensor:
    """Sets every element of `t` to `value` in place (valid again if it was invalidated)."""
    return t.with_token(call("fill", [t.handle], [t.token], value=float(value), writes=[t.handle]))


def invalidate(t: Tensor) -> Tensor:
    """Drops the contents of `t`: memory freed (in RAM and swap), nothing written back.

    Reading it afterwards raises a ValueError; writing it (fill, write) makes it valid again.
    """
    return t.with_token(_ffi.invalidate([t.handle], [t.token]))
