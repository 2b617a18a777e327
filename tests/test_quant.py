"""Quantized frozen weights (jnntile.ops.quant): NF4 and int8 codes and scales bit for bit against a NumPy
reference of QLoRA's algorithm, and products on a quantized weight against dequantize-then-multiply, with the
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


def _tiles(x, tile_shape):
    """(tile coordinates, the tile's values) of x cut into tiles, row-major."""
    grid = [range(0, n, t) for n, t in zip(x.shape, tile_shape)]
    for starts in np.ndindex(*(len(g) for g in grid)):
        lo = [g[i] for g, i in zip(grid, starts)]
        yield starts, x[tuple(slice(s, s + t) for s, t in zip(lo, tile_shape))]


def reference(x, tile_shape, kind):
    """NumPy codes, scales and dequantized values: absmax per block of the contiguous axis of each tile (64
    values for nf4, the tile's row for int8); nf4: x / absmax to the nearest code value (x > midpoint goes up,
    as bitsandbytes compares), two codes a byte, the first high; int8: rint(x / (absmax / 127))."""
    (codes_shape, _), (scales_shape, scales_tiles) = quant.layouts(x.shape, tile_shape, kind)
    codes, scales = np.zeros(codes_shape, np.uint8), np.zeros(scales_shape, np.float32)
    values = np.zeros(x.shape, np.float32)
    mids = (NF4[:-1] + NF4[1:]) * np.float32(0.5)
    for coord, tile in _tiles(x.astype(np.float32), tile_shape):
        block = 64 if kind == "nf4" else tile.shape[-1]
        blocks = tile.reshape(tile.shape[:-1] + (-1, block))
        absmax = np.abs(blocks).max(-1, keepdims=True)
        safe = np.where(absmax == 0, np.float32(1), absmax)
        if kind == "nf4":
            idx = np.searchsorted(mids, np.where(absmax == 0, np.float32(0), blocks / safe), side="left")
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
        code_lo = lo[:-1] + [lo[-1] // (2 if kind == "nf4" else 1)]
        codes[tuple(slice(s, s + n) for s, n in zip(code_lo, tile_codes.shape))] = tile_codes
        scale_lo = [c * t for c, t in zip(coord, scales_tiles)]
        tile_scales = absmax.reshape(tile.shape[:-1] + (-1,))
        scales[tuple(slice(s, s + n) for s, n in zip(scale_lo, tile_scales.shape))] = tile_scales
        values[tuple(slice(s, s + n) for s, n in zip(lo, tile.shape))] = deq.reshape(tile.shape)
    return codes, scales, values


# (shape, tiles) of a weight: one tile, many, uneven (the last tile of each axis shorter, by 64 on the contiguous
# axis, so nf4's blocks stay whole)
LAYOUTS = {
    "one tile": ((6, 128), (6, 128)),
    "many tiles": ((8, 256), (4, 64)),
    "uneven tiles": ((7, 192), (3, 128)),
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
    codes, scales, values = reference(np.asarray(jnp.asarray(w, dtype)).astype(np.float32), tiles, kind)
    np.testing.assert_array_equal(q.codes.numpy(), codes)
    np.testing.assert_array_equal(q.scales.numpy(), scales)
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
    _, _, w_deq = reference(w, (t_out, t_in), kind)
    q = quant.quantize(jnntile.from_array(w, (t_out, t_in)), kind)

    def loss(x, b):
        return jnp.sum(jnntile.to_array(quant.linear(x, q, b, trans_b=True)) * g_host)

    def dequantized_reference(x, b):
        return jnp.sum((x @ w_deq.T + b) * g_host)

    check_value_and_grads(loss, dequantized_reference, [jnntile.from_array(x_host, (2, t_in)),
                                                        jnntile.from_array(b_host, (t_out,))], [x_host, b_host],
                          jit=False)
