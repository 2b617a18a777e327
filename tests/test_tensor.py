"""Tiled tensors: creation, round trips, random init, lifetime and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnntile
from conftest import counter_uniform01

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

TILINGS = {"one tile": None, "many tiles": (2, 3), "uneven tiles": (4, 5)}


@pytest.mark.parametrize("tile_shape", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_round_trip(rng, tile_shape, dtype):
    array = (rng.standard_normal((6, 12)) * 100).astype(dtype)
    t = jnntile.from_array(array, tile_shape)
    assert t.shape == (6, 12) and t.dtype == dtype
    np.testing.assert_array_equal(t.numpy(), array)


def test_tiles_per_axis_and_leftover():
    t = jnntile.zeros((10, 7, 3), tile_shape=(4, 7, 2))
    assert t.grid == (3, 1, 2)
    assert t.tile_shape == (4, 7, 2)
    # A tile larger than the axis is clipped to the axis.
    assert jnntile.zeros((3, 5), tile_shape=(8, 8)).tile_shape == (3, 5)


def test_zeros_full_and_scalar():
    np.testing.assert_array_equal(jnntile.zeros((3, 4), tile_shape=2).numpy(), np.zeros((3, 4)))
    np.testing.assert_array_equal(jnntile.full((5,), 2.5, tile_shape=2).numpy(), np.full(5, 2.5))
    np.testing.assert_array_equal(jnntile.full((4,), 7, dtype="int32").numpy(), np.full(4, 7))
    assert jnntile.full((), 3.0).numpy() == 3.0


@pytest.mark.parametrize("tile_shape", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("dtype, value", [("int32", -3), ("int64", 2**40 + 3)])
def test_integer_fills(tile_shape, dtype, value):
    t = jnntile.full((6, 12), value, dtype=dtype, tile_shape=tile_shape)
    assert t.numpy().dtype == dtype
    np.testing.assert_array_equal(t.numpy(), np.full((6, 12), value, dtype))


def test_int64_tensor_round_trip():
    array = np.arange(10, dtype=np.int64) * (2**40)
    np.testing.assert_array_equal(jnntile.from_array(array, 3).numpy(), array)


@pytest.mark.parametrize("normal", [True, False])
def test_random_is_independent_of_tiling(normal):
    make = jnntile.random_normal if normal else jnntile.random_uniform
    whole = make((33, 17), seed=7).numpy()
    tiled = make((33, 17), seed=7, tile_shape=(5, 4)).numpy()
    np.testing.assert_array_equal(whole, tiled)
    assert not np.array_equal(whole, make((33, 17), seed=8).numpy())
    if normal:
        assert abs(whole.mean()) < 0.1 and abs(whole.std() - 1) < 0.1
    else:
        assert whole.min() >= 0 and whole.max() < 1 and abs(whole.mean() - 0.5) < 0.05


@pytest.mark.parametrize("normal", [True, False])
def test_random_bfloat16_is_the_float32_draw_rounded(normal):
    make = jnntile.random_normal if normal else jnntile.random_uniform
    rounded = jnntile.convert(make((33, 17), seed=7, tile_shape=(5, 4)), "bfloat16").numpy()
    drawn = make((33, 17), seed=7, tile_shape=(8, 6), dtype="bfloat16")
    assert drawn.dtype == "bfloat16"
    np.testing.assert_array_equal(drawn.numpy().view(np.uint16), rounded.view(np.uint16))


def test_random_is_independent_of_worker_count():
    values = jnntile.random_normal((40, 40), seed=3, tile_shape=8).numpy()
    jnntile.runtime.stop()
    jnntile.runtime.start(workers=1)
    try:
        np.testing.assert_array_equal(jnntile.random_normal((40, 40), seed=3, tile_shape=8).numpy(), values)
    finally:
        jnntile.runtime.stop()
        jnntile.runtime.configure(workers=2)


def test_random_values_follow_the_counter_based_formula():
    """Every device computes element g from (seed, g) alone, with the same arithmetic."""
    shape, seed, tile = (9, 13), 2**40 + 5, (4, 5)
    g = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
    u1, u2 = counter_uniform01(seed, np.uint64(2) * g), counter_uniform01(seed, np.uint64(2) * g + np.uint64(1))
    uniform = jnntile.random_uniform(shape, seed, low=-2.0, high=3.0, tile_shape=tile).numpy()
    np.testing.assert_array_equal(uniform, (-2.0 + 5.0 * u1).astype(np.float32))  # exact in double
    normal = jnntile.random_normal(shape, seed, std=2.0, mean=0.5, tile_shape=tile).numpy()
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)  # libm may differ from the GPU's in the last bit
    np.testing.assert_allclose(normal, (0.5 + 2.0 * z).astype(np.float32), rtol=1e-6, atol=1e-6)


def test_write_and_read_under_jit(rng):
    array = rng.standard_normal((5, 6)).astype(np.float32)

    @jax.jit
    def round_trip(x):
        t = jnntile.from_array(x, (2, 4))
        return jnntile.to_array(t) * 2

    np.testing.assert_array_equal(round_trip(array), array * 2)
    np.testing.assert_array_equal(round_trip(array + 1), (array + 1) * 2)


def test_packed_tensors_cross_jit_as_one_token(rng):
    """A tree of Tensors packed crosses a jitted call as one token leaf (other leaves stay leaves); the calls
    inside see every Tensor's tiles written before the call, the tree comes back with its handles, and the
    program compiles once for the same Tensors."""
    from jnntile.ops import elementwise
    from jnntile.core.tensor import pack

    a_np, b_np = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    # Eager writes, maybe still pending when packed: pack waits for their tokens.
    tree = {"a": jnntile.from_array(a_np, (2, 4)), "b": jnntile.from_array(b_np, (2, 4)), "count": jnp.int32(3)}
    packed = pack(tree)
    assert len(jax.tree.leaves(packed)) == 2  # the token and the count

    @jax.jit
    def step(packed):
        t = packed.unpack()
        total = elementwise.add(t["a"], t["b"])
        return pack({"a": t["a"], "b": t["b"], "count": t["count"] + 1, "total": total})

    out = step(packed).unpack()
    assert out["a"].id == tree["a"].id and out["b"].id == tree["b"].id and int(out["count"]) == 4
    np.testing.assert_allclose(out["total"].numpy(), a_np + b_np, rtol=1e-6)
    again = step(pack({k: out[k] for k in ("a", "b", "count")})).unpack()
    assert int(again["count"]) == 5 and step._cache_size() == 1


def test_pack_needs_a_tensor():
    from jnntile.core.tensor import pack

    with pytest.raises(ValueError, match="holds no Tensor"):
        pack({"count": jnp.int32(0)})


def test_free_releases_and_use_after_free_raises():
    t = jnntile.zeros((4, 4))
    before = jnntile.runtime.stats()["tensors"]
    t.free()
    assert jnntile.runtime.stats()["tensors"] == before - 1
    with pytest.raises(ValueError, match="was freed"):
        t.numpy()


def test_empty_tensor_holds_nothing_until_written(rng):
    t = jnntile.empty((6, 12), tile_shape=(4, 5))
    with pytest.raises(ValueError, match="read before anything wrote it"):
        t.numpy()
    array = rng.standard_normal((6, 12)).astype(np.float32)
    from jnntile.io import tensorfile

    np.testing.assert_array_equal(tensorfile.load_into(t, array).numpy(), array)


def test_unreachable_eager_tensor_is_released():
    before = jnntile.runtime.stats()["tensors"]
    t = jnntile.full((8, 8), 1.0, tile_shape=4)
    assert jnntile.runtime.stats()["tensors"] == before + 1
    del t
    assert jnntile.runtime.stats()["tensors"] == before


def test_tensors_made_while_tracing_live_as_long_as_the_program():
    @jax.jit
    def f(x):
        t = jnntile.full((4,), 1.0)
        return jnntile.to_array(t) + x

    np.testing.assert_array_equal(f(1.0), np.full(4, 2.0))
    import gc

    gc.collect()
    np.testing.assert_array_equal(f(2.0), np.full(4, 3.0))  # same compiled program, same tensor id
    assert jnntile.release_traced() >= 1


@pytest.mark.parametrize("shape, tile_shape, error, message", [
    ((4, 4), (2,), ValueError, "has 1 axes"),
    ((4, 0), None, ValueError, "must be positive"),
    ((4, 4), (0, 2), ValueError, "must be positive"),
])
def test_bad_shapes(shape, tile_shape, error, message):
    with pytest.raises(error, match=message):
        jnntile.zeros(shape, tile_shape=tile_shape)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="not supported"):
        jnntile.from_array(np.zeros(3, dtype=np.float16))


def test_write_of_wrong_shape_is_refused_before_submission():
    from jnntile.ops import values

    t = jnntile.zeros((3, 3))
    submitted = jnntile.runtime.stats()["tasks_submitted"]
    with pytest.raises(ValueError, match="shape"):
        values.write(t, np.zeros((3, 4), np.float32))
    assert jnntile.runtime.stats()["tasks_submitted"] == submitted


def test_tile_larger_than_memory_limit_is_refused():
    limit = jnntile.runtime.config().memory_limit_mb
    side = int((limit * 2**20 / 4) ** 0.5) + 64
    with pytest.raises(ValueError, match="larger than the memory limit"):
        jnntile.zeros((side, side))


@pytest.mark.parametrize("tiles", [None, (2, 3), (4, 5)], ids=["one tile", "many tiles", "uneven tiles"])
def test_convert_rounds_as_jax_and_back(rng, tiles):
    """float32 -> bfloat16 rounds to nearest even, bit for bit as JAX, special values included; back is exact."""
    x = (rng.standard_normal((6, 7)) * 10).astype(np.float32)
    x.flat[:8] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, 3.0e38, 1.00390625]  # a tie: 1 + 2^-8
    # NaNs that rounding their bits would turn into -0.0 (all payload bits set) and into infinity (signaling)
    x.view(np.uint32).flat[8:10] = [0x7FFFFFFF, 0x7F800001]
    t = jnntile.from_array(x, tiles)
    half = jnntile.convert(t, "bfloat16")
    assert half.dtype == "bfloat16" and half.tile_shape == t.tile_shape
    expected = np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
    np.testing.assert_array_equal(half.numpy().view(np.uint16)[~np.isnan(x)], expected.view(np.uint16)[~np.isnan(x)])
    assert np.isnan(half.numpy().astype(np.float32).flat[[2, 8, 9]]).all()
    back = jnntile.convert(half, "float32").numpy()
    np.testing.assert_array_equal(back, expected.astype(np.float32))


def test_convert_gradient_reaches_the_master(rng):
    """The bfloat16 copy's gradient adds into the float32 tensor's, as JAX's cast does."""
    x = rng.standard_normal((5, 6)).astype(np.float32)
    w = rng.standard_normal((5, 6)).astype(np.float32)

    def loss(t):
        copy = jnntile.convert(jnntile.convert(t, "bfloat16"), "float32")
        return jnp.sum(jnntile.to_array(copy) * w)

    grads = jax.jit(jnntile.grad(loss))(jnntile.from_array(x, (2, 4)))
    expected = jax.grad(lambda a: jnp.sum(a.astype(jnp.bfloat16).astype(jnp.float32) * w))(x)
    np.testing.assert_array_equal(jnntile.grad_of(grads).numpy(), expected)


def test_bfloat16_tensors_round_trip(rng):
    x = jnp.asarray(rng.standard_normal((4, 9)), jnp.bfloat16)
    for array in (x, np.asarray(x)):  # through XLA, and through the host copy
        t = jnntile.from_array(array, (3, 4))
        assert t.dtype == "bfloat16"
        np.testing.assert_array_equal(t.numpy().view(np.uint16), np.asarray(x).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(jnntile.to_array(t)).view(np.uint16), np.asarray(x).view(np.uint16))
    zeros = jnntile.zeros((3, 3), dtype="bfloat16").numpy()
    assert zeros.dtype.name == "bfloat16" and not zeros.astype(np.float32).any()
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        jnntile.convert(jnntile.zeros((2,), dtype="int32"), "bfloat16")
