"""Quantized frozen weights: `quantize(w, "nf4" | "int8")` stores a float tensor as uint8 codes and float32
absmax scales (xla_ffi/kernels/quant.h), `dequantize` reads it back, and `linear(x, q, b)` is `gemm.linear`
on a quantized weight: each product task dequantizes its weight tile into its own scratch, so no float copy
of the weight exists outside a task. The weight is frozen: its backward gives x (and b, the residual) a
gradient, never the weight.

NF4 is QLoRA's 4-bit NormalFloat (blocks of 64 values along the contiguous axis, one absmax each, two codes a
byte); int8 has one scale per row of each tile (per output row of a weight stored (out, in) whose input axis
is one tile). A block never spans two tiles: an NF4 weight's contiguous axis and its tiles are multiples of 64.
"nf4_dq" is NF4 with QLoRA's double quantization as bitsandbytes has it (`quantize_4bit(...,
compress_statistics=True)`), per tile: the scales less their mean in blocks of 256, as 8-bit codes of
bitsandbytes' dynamic map, each block with a float32 absmax; `stats` holds each tile's mean and absmaxes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jnntile import _xla_ffi
from jnntile.core import tensor as tensor_mod
from jnntile.core.tensor import Tensor
from jnntile.ops import gemm
from jnntile.ops import values as values_ops
from jnntile.ops._ffi import call, differentiable, fresh_targets, grad_target

QUANTIZATIONS = tuple(_xla_ffi.Quant.__members__)
NF4_BLOCK = _xla_ffi.nf4_block
SCALE_BLOCK = _xla_ffi.scale_block  # nf4_dq: scales per 8-bit block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A float tensor of `shape`, `tile_shape` stored quantized as `quant`: `codes` (uint8), `scales` (float32;
    uint8 for nf4_dq) and for nf4_dq `stats` (float32), laid out as `layouts` gives."""

    codes: Tensor
    scales: Tensor
    quant: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple = dataclasses.field(metadata=dict(static=True))
    tile_shape: tuple = dataclasses.field(metadata=dict(static=True))
    stats: Tensor | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def stored(self) -> list[tuple[str, Tensor]]:
        """(name, tensor) of what it is stored as: "codes", "scales", and for nf4_dq "stats"."""
        return [(name, t) for name, t in (("codes", self.codes), ("scales", self.scales), ("stats", self.stats))
                if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.size * np.dtype(t.dtype).itemsize for _, t in self.stored())


def layouts(shape, tile_shape, quant: str) -> list[tuple[tuple, str, tuple]]:
    """(shape, dtype, tiles) of the codes, the scales and for nf4_dq the statistics of a float tensor quantized
    as `quant`; raises naming the axis and the fix where NF4's blocks of 64 would span two tiles."""
    if quant not in QUANTIZATIONS:
        raise ValueError(f"quantization {quant!r}: use one of {', '.join(QUANTIZATIONS)}")
    shape, tile_shape = tuple(shape), tuple(tile_shape)
    if not shape:
        raise ValueError("quantize: a quantized tensor has at least one axis")
    head, tiles_head, n, tn = shape[:-1], tile_shape[:-1], shape[-1], tile_shape[-1]
    if quant == "int8":
        return [(shape, "uint8", tile_shape), (head + (-(-n // tn),), "float32", tiles_head + (1,))]
    if n % NF4_BLOCK or tn % NF4_BLOCK:
        raise ValueError(f"quantize: nf4 stores blocks of {NF4_BLOCK} values that must not span two tiles, but the "
                         f"contiguous axis has length {n} in tiles of {tn} (shape {shape}, tile_shape "
                         f"{tile_shape}): use a length and a tile that are multiples of {NF4_BLOCK}")
    codes = (head + (n // 2,), "uint8", tiles_head + (tn // 2,))
    scales_tiles = tiles_head + (tn // NF4_BLOCK,)
    if quant == "nf4":
        return [codes, (head + (n // NF4_BLOCK,), "float32", scales_tiles)]
    grid = tuple(-(-a // t) for a, t in zip(shape, tile_shape))
    stats = 1 + -(-int(np.prod(scales_tiles)) // SCALE_BLOCK)  # a tile's mean, then an absmax per block
    return [codes, (head + (n // NF4_BLOCK,), "uint8", scales_tiles), (grid + (stats,), "float32",
                                                                        (1,) * len(grid) + (stats,))]


def quantize(x: Tensor, quant: str) -> Quantized:
    """`x` (float32 or bfloat16) quantized as `quant` ("nf4" or "int8"), tile by tile."""
    if x.dtype not in tensor_mod.FLOAT_DTYPES:
        raise TypeError(f"quantize needs a float32 or bfloat16 tensor, got {x!r}")
    handles = [tensor_mod.new_handle(*part) for part in layouts(x.shape, x.tile_shape, quant)]
    token = call("quantize", [x.handle, *handles], [x.token], quant=_xla_ffi.Quant[quant].value)
    return Quantized(*(Tensor(token, h) for h in handles[:2]), quant, x.shape, x.tile_shape,
                     *(Tensor(token, h) for h in handles[2:]))


def empty(shape, tile_shape, quant: str) -> Quantized:
    """A quantized tensor whose tiles hold nothing yet (`values.empty`), for a loader that writes every tile."""
    parts = [values_ops.empty(*part) for part in layouts(shape, tile_shape, quant)]
    return Quantized(*parts[:2], quant, tuple(shape), tuple(tile_shape), *parts[2:])


def dequantize(q: Quantized, dtype: str = "float32") -> Tensor:
    """The float values `q` stands for, in `dtype`."""
    out = tensor_mod.new_handle(q.shape, dtype, q.tile_shape)
    stored = [t for _, t in q.stored()]
    token = call("dequantize", [q.codes.handle, q.scales.handle, out, *(t.handle for t in stored[2:])],
                 [t.token for t in stored], quant=_code(q))
    return Tensor(token, out)


def _code(q: Quantized) -> int:
    return _xla_ffi.Quant[q.quant].value


def _scales(q: Quantized) -> list:
    """The handles of q's scales and (nf4_dq) their statistics, as a product takes them after its operands."""
    return [t.handle for name, t in q.stored() if name != "codes"]


@dataclasses.dataclass(frozen=True)
class _Weight:
    """The float operand a quantized weight stands for, as `gemm.layout` checks it."""
    shape: tuple
    tile_shape: tuple
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _forward(x, q, b, residual, params, zero_grad):
    trans_b, ndim = params
    shape, tile_shape = gemm.layout(x, _Weight(q.shape, q.tile_shape, x.dtype), False, trans_b, ndim, 0)
    out = tensor_mod.new_handle(shape, x.dtype, tile_shape)
    token = call("gemm", [x.handle, q.codes.handle, out, None if b is None else b.handle,
                          None if residual is None else residual.handle, *_scales(q)],
                 [t.token for t in (x, q.codes, q.scales, q.stats, b, residual) if t is not None],
                 zero_grads=[out] if zero_grad else [], quant_b=_code(q), trans_a=False, trans_b=trans_b,
                 alpha=1.0, beta=0.0, ndim=ndim, batch_ndim=0)
    return Tensor(token, out), (x, q, b, residual, Tensor(token, out))


def _backward(params, residuals, g):
    trans_b, ndim = params
    x, q, b, residual, out = residuals
    (fresh,), written = fresh_targets(grad_target(x))
    token = call("gemm_backward", [x.handle, q.codes.handle, grad_target(x), None,
                                   tensor_mod.grad_handle(out.handle), *_scales(q)],
                 [out.token, g.token, x.token, *(t.token for _, t in q.stored())], writes=written, fresh_a=fresh,
                 fresh_b=0, quant_b=_code(q), trans_a=False, trans_b=trans_b, alpha=1.0, ndim=ndim, batch_ndim=0)
    token = gemm.linear_backward_rest(token, out, g, b, residual, bias_summed=False)
    frozen = Quantized(q.codes.with_token(token), q.scales.with_token(token), q.quant, q.shape, q.tile_shape,
                       None if q.stats is None else q.stats.with_token(token))
    x, b, residual = (None if t is None else t.with_token(token) for t in (x, b, residual))
    return x, frozen, b, residual


_linear = differentiable(_forward, _backward, nondiff_argnums=(4,), name="quantized_linear")


def linear(x: Tensor, q: Quantized, b: Tensor | None = None, *, ndim: int = 1, trans_b: bool = False,
           residual: Tensor | None = None) -> Tensor:
    """`gemm.linear(x, w, b, ...)` with w quantized (frozen): the same layouts, the products read q's tiles
    dequantized to x's dtype inside their tasks."""
    if b is not None and b.dtype != "float32":
        raise TypeError(f"linear: b must be float32 (a bias stays a float32 master), got {b!r}")
    return _linear(x, q, b, residual, (bool(trans_b), int(ndim)))
