"""Quantized frozen weights (jnntile.ops.quant): NF4 and int8 codes and scales, and NF4's scales double-quantized
(8-bit codes of bitsandbytes' dynamic map and their statistics), bit for bit against a NumPy reference of QLoRA's
and bitsandbytes' algorithms, and products on a quantized weight against dequantize-then-multiply, with the
gradient of x (the weight gets none)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import check_value_and_grads

import jnntile
from jnntile.ops import quant

pytestmark = pytest.mark.usefixtures("placement")

# bitsandbytes' NF4 code (csrc/kernels.cu `nf4_data`; QLoRA, Dettmers et al. 2023, appendix E).
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
f32 = np.float32


def _linspace(start, end, n):
    """torch.linspace(start, end, n) in float32 as its CPU kernel computes it: start + step * i for the first
    half, end - step * (n - 1 - i) for the rest."""
    start, end = f32(start), f32(end)
    step = f32((end - start) / f32(n - 1))
    return np.array([start + step * f32(i) if i < n // 2 else end - step * f32(n - 1 - i) for i in range(n)], f32)


def _dynamic_map():
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8) (functional.py): for each
    exponent e of -6 .. 0, the means of consecutive values of linspace(0.1, 1, 2^(e + 6) + 1) times +-10^e, in
    float32 (the scalar rounded to float32 first, as torch multiplies a float32 tensor by a Python float), then
    0 and 1, sorted."""
    data = [f32(0), f32(1)]
    for e in range(-6, 1):
        bounds = _linspace(0.1, 1.0, 2 ** (e + 6) + 1)
        means = (bounds[:-1] + bounds[1:]) / f32(2)
        data += list(f32(10.0 ** e) * means) + list(f32(-(10.0 ** e)) * means)
    return np.array(sorted(data), f32)


DYNAMIC = _dynamic_map()


def _double_quantized(absmax):
    """A tile's absmax scales (float32, row-major) double-quantized as bitsandbytes' quantize_4bit(...,
    compress_statistics=True) does (offset = their mean, then quantize_blockwise(absmax - offset, blocksize=256)
    with the dynamic map: x * (1 / block absmax) clamped to [-1, 1], bucketized on the map's midpoints): the
    8-bit codes, the statistics [offset, absmax of each block] and the scales dequantized (map value * block
    absmax + offset). The mean is summed in order in float64 (bitsandbytes takes torch's float32 mean)."""
    flat = absmax.reshape(-1)
    total = 0.0
    for value in flat.tolist():
        total += value
    offset = f32(total / flat.size)
    shifted = flat - offset
    mids = (DYNAMIC[:-1] + DYNAMIC[1:]) / f32(2)
    codes, stats, scales = np.zeros(flat.size, np.uint8), [offset], np.zeros(flat.size, np.float32)
    for start in range(0, flat.size, 256):
        block = shifted[start:start + 256]
        block_absmax = np.abs(block).max()
        scaled = np.clip(block * (f32(1) / max(block_absmax, f32(1e-38))), -1, 1)
        codes[start:start + 256] = np.searchsorted(mids, scaled, side="left")
        scales[start:start + 256] = DYNAMIC[codes[start:start + 256]] * block_absmax + offset
        stats.append(block_absmax)
    return codes.reshape(absmax.shape), np.array(stats, np.float32), scales.reshape(absmax.shape)


def _tiles(x, tile_shape):
    """(tile coordinates, the tile's values) of x cut into tiles, row-major."""
    grid = [range(0, n, t) for n, t in zip(x.shape, tile_shape)]
    for starts in np.ndindex(*(len(g) for g in grid)):
        lo = [g[i] for g, i in zip(grid, starts)]
        yield starts, x[tuple(slice(s, s + t) for s, t in zip(lo, tile_shape))]


def reference(x, tile_shape, kind):
    """NumPy codes, scales, statistics (nf4_dq; else None) and dequantized values: absmax per block of the
    contiguous axis of each tile (64 values for nf4, the tile's row for int8); nf4: x / absmax to the nearest
    code value (x > midpoint goes up, as bitsandbytes compares), two codes a byte, the first high; int8:
    rint(x / (absmax / 127)); nf4_dq: nf4's codes, its scales double-quantized per tile (`_double_quantized`)."""
    (codes_shape, _, _), (scales_shape, scales_dtype, scales_tiles), *stats_layout = \
        quant.layouts(x.shape, tile_shape, kind)
    codes, scales = np.zeros(codes_shape, np.uint8), np.zeros(scales_shape, scales_dtype)
    stats = np.zeros(stats_layout[0][0], np.float32) if stats_layout else None
    values = np.zeros(x.shape, np.float32)
    mids = (NF4[:-1] + NF4[1:]) * np.float32(0.5)
    for coord, tile in _tiles(x.astype(np.float32), tile_shape):
        block = tile.shape[-1] if kind == "int8" else 64
        blocks = tile.reshape(tile.shape[:-1] + (-1, block))
        absmax = np.abs(blocks).max(-1, keepdims=True)
        safe = np.where(absmax == 0, np.float32(1), absmax)
        tile_scales = absmax.reshape(tile.shape[:-1] + (-1,))
        if kind in ("nf4", "nf4_dq"):
            idx = np.searchsorted(mids, np.where(absmax == 0, np.float32(0), blocks / safe), side="left")
            if kind == "nf4_dq":
                tile_scales, tile_stats, absmax = _double_quantized(tile_scales)
                absmax = absmax.reshape(idx.shape[:-1] + (1,))
                stats[coord][:tile_stats.size] = tile_stats
            deq = NF4[idx] * absmax
            flat = idx.reshape(tile.shape).astype(np.uint8)
            tile_codes = (flat[..., 0::2] << 4) | flat[..., 1::2]
        else:
            step = absmax / np.float32(127)
            idx = np.clip(np.rint(np.where(absmax == 0, np.float32(0), blocks / np.where(absmax == 0, 1, step))),
                          -127, 127)
            deq = idx.astype(np.float32) * step
            tile_codes = idx.reshape(tile.shape).astype(np.int8).view(np.uint8)
        lo = [c * t for c, t in zip(coord, tile_shape)]
        code_lo = lo[:-1] + [lo[-1] // (1 if kind == "int8" else 2)]
        codes[tuple(slice(s, s + n) for s, n in zip(code_lo, tile_codes.shape))] = tile_codes
        scale_lo = [c * t for c, t in zip(coord, scales_tiles)]
        scales[tuple(slice(s, s + n) for s, n in zip(scale_lo, tile_scales.shape))] = tile_scales
        values[tuple(slice(s, s + n) for s, n in zip(lo, tile.shape))] = deq.reshape(tile.shape)
    return codes, scales, stats, values


# (shape, tiles) of a weight: one tile, many, uneven (the last tile of each axis shorter, by 64 on the contiguous
# axis, so nf4's blocks stay whole), and uneven tiles of 320 scales (nf4_dq: two blocks of scales, the second
# short; the last tiles' 20 to 160 scales one block)
LAYOUTS = {
    "one tile": ((6, 128), (6, 128)),
    "many tiles": ((8, 256), (4, 64)),
    "uneven tiles": ((7, 192), (3, 128)),
    "blocks of scales": ((60, 576), (40, 512)),
}


def _weights(rng, shape):
    w = rng.standard_normal(shape).astype(np.float32) * np.float32(0.05)
    w[0, :64] = 0.0  # a block of zeros: scale 0, every value 0
    w[1, 3] = 0.4  # a block's absmax far from the rest
    return w


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", quant.QUANTIZATIONS)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_quantize_bit_exact(rng, layout, kind, dtype):
    shape, tiles = layout
    w = _weights(rng, shape)
    x = jnntile.from_array(jnp.asarray(w, dtype), tiles)
    q = quant.quantize(x, kind)
    codes, scales, stats, values = reference(np.asarray(jnp.asarray(w, dtype)).astype(np.float32), tiles, kind)
    np.testing.assert_array_equal(q.codes.numpy(), codes)
    np.testing.assert_array_equal(q.scales.numpy(), scales)
    if stats is not None:
        np.testing.assert_array_equal(q.stats.numpy(), stats)
    np.testing.assert_array_equal(quant.dequantize(q).numpy(), values)


def test_nf4_refuses_blocks_across_tiles():
    x = jnntile.zeros((4, 96), tile_shape=(4, 96))
    with pytest.raises(ValueError, match="length 96 in tiles of 96.*multiples of 64"):
        quant.quantize(x, "nf4")


@pytest.mark.parametrize("kind", quant.QUANTIZATIONS)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_linear_on_quantized_weight(rng, layout, kind):
    """y = x W^T + b with W (out, in) quantized, against the product on W dequantized; dx = dy W, db = sum dy,
    and the weight gets no gradient."""
    (n_out, n_in), (t_out, t_in) = layout
    w = _weights(rng, (n_out, n_in))
    x_host = rng.standard_normal((5, n_in)).astype(np.float32)
    b_host = rng.standard_normal(n_out).astype(np.float32)
    g_host = rng.standard_normal((5, n_out)).astype(np.float32)
    *_, w_deq = reference(w, (t_out, t_in), kind)
    q = quant.quantize(jnntile.from_array(w, (t_out, t_in)), kind)

    def loss(x, b):
        return jnp.sum(jnntile.to_array(quant.linear(x, q, b, trans_b=True)) * g_host)

    def dequantized_reference(x, b):
        return jnp.sum((x @ w_deq.T + b) * g_host)

    check_value_and_grads(loss, dequantized_reference, [jnntile.from_array(x_host, (2, t_in)),
                                                        jnntile.from_array(b_host, (t_out,))], [x_host, b_host],
                          jit=False)
