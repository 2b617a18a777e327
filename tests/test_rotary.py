"""rotary: values and gradients against the Llama reference's rotary embedding, for every tiling and offset."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BFLOAT16_TOL, check_op, rel_err

import jnntile
from jnntile.models.llama import LlamaConfig
from jnntile.models.llama import reference as ref
from jnntile.ops.rotary import rotary

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

SHAPE = (2, 12, 4, 3, 8)  # B, T, P (two query parts, keys, values), H, D
TILINGS = {
    "one_tile": (2, 12, 1, 3, 8),
    "many_tiles": (1, 4, 1, 1, 8),
    "uneven_tiles": (2, 5, 1, 2, 8),  # T = 5 + 5 + 2, H = 2 + 1
}
INV_FREQ = LlamaConfig(head_dim=8, hidden_size=32, num_attention_heads=4, rope_theta=100.0).inverse_frequencies()


def reference(x, pos, rotated_parts, positions=None):
    """The reference's rotation of parts < rotated_parts at positions pos, pos + 1, ... (or `positions` (B, T));
    the others as they are."""
    B, T, P, H, D = x.shape
    if positions is None:
        positions = jnp.broadcast_to(pos + jnp.arange(T), (B, T))
    turned = ref.rotary(x[:, :, :rotated_parts].reshape(B, T, rotated_parts * H, D), positions, jnp.asarray(INV_FREQ))
    return jnp.concatenate([turned.reshape(B, T, rotated_parts, H, D), x[:, :, rotated_parts:]], axis=2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("pos", [0, 37])
@pytest.mark.parametrize("tiling", TILINGS)
def test_values_and_gradients(tiling, pos, jit):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal(SHAPE).astype(np.float32)
    weight = rng.standard_normal(SHAPE).astype(np.float32)
    x = jnntile.from_array(x_np, TILINGS[tiling])

    def loss(x, pos):
        y = rotary(x, INV_FREQ, pos)
        assert y.shape == SHAPE and y.tile_shape == TILINGS[tiling]
        return jnp.sum(jnntile.to_array(y) * weight)

    fn = jnntile.value_and_grad(loss)
    value, grad = (jax.jit(fn) if jit else fn)(x, np.int32(pos))
    ref_value, ref_grad = jax.value_and_grad(lambda z: jnp.sum(reference(z, pos, 3) * weight))(x_np)
    assert rel_err(value, ref_value) <= 1e-5
    assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5
    np.testing.assert_allclose(rotary(x, INV_FREQ, pos).numpy(), reference(x_np, pos, 3), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("tiling", TILINGS)
def test_bfloat16(tiling):
    """bfloat16 x and y (and gradients), turned in float32."""
    x_np = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    check_op(lambda x: rotary(x, INV_FREQ, np.int32(37)),
             lambda z: reference(z.astype(jnp.float32), 37, 3).astype(jnp.bfloat16), [x_np], [TILINGS[tiling]],
             jit=True, dtype="bfloat16", tol=BFLOAT16_TOL)


def test_one_compiled_step_serves_every_offset():
    x_np = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    x = jnntile.from_array(x_np, TILINGS["uneven_tiles"])
    step = jax.jit(lambda x, pos: jnntile.to_array(rotary(x, INV_FREQ, pos, rotated_parts=4)))
    for pos in (0, 5, 1000):
        assert rel_err(step(x, np.int32(pos)), reference(x_np, pos, 4)) <= 1e-5
    assert step._cache_size() == 1


def test_rotating_by_p_then_q_is_rotating_by_p_plus_q():
    x_np = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    x = jnntile.from_array(x_np, TILINGS["many_tiles"])
    twice = rotary(rotary(x, INV_FREQ, 3, rotated_parts=4), INV_FREQ, 0, rotated_parts=4).numpy()
    # Positions add up row by row: row t turned by (3 + t) then by t is turned by 3 + 2t.
    B, T, P, H, D = SHAPE
    expected = ref.rotary(x_np.reshape(B, T, P * H, D), jnp.broadcast_to(3 + 2 * jnp.arange(T), (B, T)),
                          jnp.asarray(INV_FREQ))
    np.testing.assert_allclose(twice, np.asarray(expected).reshape(SHAPE), rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    x = jnntile.zeros(SHAPE, tile_shape=TILINGS["one_tile"])
    with pytest.raises(ValueError, match=r"must have shape \(B, T, P, H, D\)"):
        rotary(jnntile.zeros((2, 12, 8)), INV_FREQ)
    with pytest.raises(ValueError, match=r"use tile_shape \(2, 12, 1, 3, 8\)"):
        rotary(jnntile.zeros(SHAPE, tile_shape=(2, 12, 2, 3, 8)), INV_FREQ)
    with pytest.raises(ValueError, match=r"3 frequencies for head dimension D=8; it needs D / 2 = 4"):
        rotary(x, INV_FREQ[:3])
    with pytest.raises(ValueError, match=r"D=7 must be even"):
        rotary(jnntile.zeros((1, 2, 2, 1, 7), tile_shape=(1, 2, 1, 1, 7)), INV_FREQ)
    with pytest.raises(ValueError, match=r"rotated_parts=5 must be in \[0, 4\]"):
        rotary(x, INV_FREQ, rotated_parts=5)
    with pytest.raises(TypeError, match="pos must be an integer scalar"):
        rotary(x, INV_FREQ, 1.5)
    with pytest.raises(TypeError, match="float32"):
        rotary(jnntile.from_array(np.zeros(SHAPE, np.int32)), INV_FREQ)


def test_widest_head_dim_is_the_native_limit():
    """D up to the kernels' limit (kRotaryMaxHalf frequencies, read from the native module) turns; past it, an
    error names the limit."""
    D = jnntile._xla_ffi.rotary_max_head_dim
    inv_freq = 1.0 / 10000.0 ** (np.arange(D // 2) / (D // 2))
    x_np = np.random.default_rng(0).standard_normal((1, 3, 2, 1, D)).astype(np.float32)
    y = rotary(jnntile.from_array(x_np, (1, 3, 1, 1, D)), inv_freq, pos=5)
    positions = jnp.broadcast_to(5 + jnp.arange(3), (1, 3))
    expected = ref.rotary(x_np[:, :, :1].reshape(1, 3, 1, D), positions, jnp.asarray(inv_freq, jnp.float32))
    np.testing.assert_allclose(y.numpy()[:, :, 0], np.asarray(expected), rtol=1e-5, atol=1e-5)
    wider = jnntile.zeros((1, 3, 2, 1, D + 2), tile_shape=(1, 3, 1, 1, D + 2))
    with pytest.raises(ValueError, match=f"D={D + 2} must be even and at most {D}"):
        rotary(wider, np.ones((D + 2) // 2), pos=5)


# A packed batch: positions restart at 0 with each example, padding at 0; boundaries inside and across tiles.
PACKED_POSITIONS = np.array([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 0],
                             [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]], np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_positions_per_row(tiling, dtype):
    """Each row turned by its own position (a packed batch's), values and gradients, forward and backward."""
    x_np = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
    tiles = TILINGS[tiling]

    def op(x):
        return rotary(x, INV_FREQ, rotated_parts=3, positions=jnntile.from_array(PACKED_POSITIONS, tiles[:2]))

    def mixed_reference(x):
        return reference(x.astype(jnp.float32), 0, 3, PACKED_POSITIONS).astype(x.dtype)

    check_op(op, mixed_reference, [x_np], [tiles], jit=True, dtype=dtype,
             tol=BFLOAT16_TOL if dtype == "bfloat16" else 1e-5)


def test_positions_must_be_tiled_like_the_rows():
    x = jnntile.from_array(np.zeros(SHAPE, np.float32), TILINGS["many_tiles"])
    with pytest.raises(ValueError, match=r"positions must be an int32 Tensor of shape \(2, 12\) tiled \(1, 4\)"):
        rotary(x, INV_FREQ, positions=jnntile.from_array(PACKED_POSITIONS, (2, 4)))
