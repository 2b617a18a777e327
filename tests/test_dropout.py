"""dropout: mask independent of tiling, keep rate, gradients from the same mask, seed as a runtime value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnntile
from conftest import BFLOAT16_TOL, check_op, counter_uniform01
from jnntile.ops.dropout import dropout

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

RATE = 0.3

# shape, tile
TILINGS = {
    "one_tile": ((2, 6, 8), (2, 6, 8)),
    "many_tiles": ((2, 6, 8), (1, 3, 4)),
    "uneven_tiles": ((3, 7, 10), (2, 3, 4)),
}


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))


def mask_of(shape, tile, rate, seed):
    """The keep mask, read back by running dropout on a tensor of ones."""
    return dropout(jnntile.full(shape, 1.0, tile_shape=tile), rate, seed).numpy() != 0


def test_mask_is_the_same_for_any_tiling():
    shape = (3, 7, 10)
    reference = mask_of(shape, shape, RATE, 11)
    for tile in [(1, 1, 10), (2, 3, 4), (3, 7, 1), (1, 5, 3)]:
        np.testing.assert_array_equal(mask_of(shape, tile, RATE, 11), reference)
    assert not np.array_equal(mask_of(shape, shape, RATE, 12), reference)  # another seed, another mask


def test_mask_follows_the_counter_based_formula():
    """Every device keeps element g when uniform01(seed ^ stream, g) >= rate (kernels/dropout.h)."""
    shape, seed = (3, 7, 10), -5
    g = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
    expected = counter_uniform01(seed ^ 0xD60F0A7E5EED, g) >= RATE
    for tile in [shape, (2, 3, 4)]:
        np.testing.assert_array_equal(mask_of(shape, tile, RATE, jnp.int32(seed)), expected)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kept_fraction_is_close_to_one_minus_rate(rate):
    shape = (64, 1024)
    kept = mask_of(shape, (16, 256), rate, 5).mean()
    # 65536 draws: the standard deviation of the fraction is below 0.002.
    assert abs(kept - (1 - rate)) < 0.01


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_values_and_gradient(tiling, jit):
    shape, tile = TILINGS[tiling]
    rng = np.random.default_rng(0)
    x_np, weight = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    seed = jnp.int32(7)
    mask = mask_of(shape, shape, RATE, seed)
    x = jnntile.from_array(x_np, tile)

    forward = lambda x, seed: jnntile.to_array(dropout(x, RATE, seed))  # noqa: E731
    out = (jax.jit(forward) if jit else forward)(x, seed)
    assert rel_err(out, x_np * mask / (1 - RATE)) <= 1e-6

    def loss(x, seed):
        return jnp.sum(jnntile.to_array(dropout(x, RATE, seed)) * weight)

    def reference(x):
        return jnp.sum(x * mask / (1 - RATE) * weight)

    fn = jnntile.value_and_grad(loss, argnums=0)
    value, grad = (jax.jit(fn) if jit else fn)(x, seed)
    ref_value, ref_grad = jax.value_and_grad(reference)(x_np)
    assert rel_err(value, ref_value) <= 1e-5
    assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


@pytest.mark.parametrize("tiling", TILINGS)
def test_bfloat16_uses_the_same_mask(tiling):
    shape, tile = TILINGS[tiling]
    x_np = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    mask = mask_of(shape, shape, RATE, 7)

    def reference(x):
        return (x.astype(jnp.float32) * mask * np.float32(1 / (1 - RATE))).astype(jnp.bfloat16)

    check_op(lambda x: dropout(x, RATE, jnp.int32(7)), reference, [x_np], [tile], jit=True, dtype="bfloat16",
             tol=BFLOAT16_TOL)


def test_new_seed_does_not_recompile():
    shape, tile = (4, 16), (2, 8)
    x = jnntile.full(shape, 1.0, tile_shape=tile)
    traces = []

    def step(x, seed):
        traces.append(1)
        value, grad = jnntile.value_and_grad(lambda x: jnp.sum(jnntile.to_array(dropout(x, 0.5, seed))))(x)
        return value, jnntile.to_array(jnntile.grad_of(grad))

    step = jax.jit(step)
    masks = []
    for seed in range(3):
        value, grad = step(x, jnp.int32(seed))
        masks.append(np.asarray(grad) != 0)
        np.testing.assert_array_equal(masks[-1], mask_of(shape, tile, 0.5, seed))
        assert value == pytest.approx(2.0 * masks[-1].sum())
    assert len(traces) == 1 and step._cache_size() == 1
    assert not np.array_equal(masks[0], masks[1])


def test_rate_zero_returns_x():
    x = jnntile.full((3, 4), 2.0)
    assert dropout(x, 0.0, 1) is x


def test_bad_inputs():
    x = jnntile.full((3, 4), 1.0)
    for rate in (1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"rate=.* must be in \[0, 1\)"):
            dropout(x, rate, 1)
    with pytest.raises(TypeError, match="seed must be an integer scalar"):
        dropout(x, 0.5, 1.5)
    with pytest.raises(TypeError, match="seed must be an integer scalar"):
        dropout(x, 0.5, jnp.arange(2))
    with pytest.raises(TypeError, match="float32"):
        dropout(jnntile.from_array(np.zeros((3, 4), np.int32)), 0.5, 1)
