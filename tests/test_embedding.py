"""Embedding: values and table gradients against table[ids] in jnp, for every tiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BFLOAT16_TOL

import jnntile
from jnntile.ops.embedding import check_ids, embedding, position_ids

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

# (B, T, V, C, ids tile, table tile)
TILINGS = {
    "one_tile": (2, 8, 16, 8, (2, 8), (16, 8)),
    "many_tiles": (2, 8, 16, 8, (1, 4), (4, 4)),
    "uneven_tiles": (3, 7, 17, 10, (2, 3), (5, 3)),
    # More columns than a GPU warp (32), vocabulary tiles 40 + 40 + 20.
    "wide_tiles": (2, 16, 100, 40, (2, 8), (40, 40)),
}


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))


def make_case(B, T, V, C, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    ids[0, :3] = ids[-1, -1]  # repeated ids must add up in the gradient
    table = rng.standard_normal((V, C)).astype(np.float32)
    weight = rng.standard_normal((B, T, C)).astype(np.float32)
    return ids, table, weight


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_values_and_gradient(tiling, jit):
    B, T, V, C, ids_tile, table_tile = TILINGS[tiling]
    ids_np, table_np, weight = make_case(B, T, V, C)
    ids = jnntile.from_array(ids_np, ids_tile)
    table = jnntile.from_array(table_np, table_tile)

    out = embedding(ids, table)
    assert out.shape == (B, T, C) and out.tile_shape == ids_tile + table_tile[1:]
    forward = lambda ids, table: jnntile.to_array(embedding(ids, table))  # noqa: E731
    np.testing.assert_array_equal((jax.jit(forward) if jit else forward)(ids, table), table_np[ids_np])

    def loss(ids, table):
        return jnp.sum(jnntile.to_array(embedding(ids, table)) * weight)

    def reference(table):
        return jnp.sum(table[ids_np] * weight)

    fn = jnntile.value_and_grad(loss, argnums=1)
    value, grad = (jax.jit(fn) if jit else fn)(ids, table)
    ref_value, ref_grad = jax.value_and_grad(reference)(table_np)
    assert rel_err(value, ref_value) <= 1e-5
    assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


@pytest.mark.parametrize("tiling", TILINGS)
def test_bfloat16_output(tiling):
    """Rows of the float32 table rounded to bfloat16; the bfloat16 output gradient summed into float32."""
    B, T, V, C, ids_tile, table_tile = TILINGS[tiling]
    ids_np, table_np, weight = make_case(B, T, V, C)
    ids, table = jnntile.from_array(ids_np, ids_tile), jnntile.from_array(table_np, table_tile)

    def loss(ids, table):
        out = jnntile.to_array(jnntile.convert(embedding(ids, table, "bfloat16"), "float32"))
        return jnp.sum(out * weight), out

    def reference(table):
        return jnp.sum(table[ids_np].astype(jnp.bfloat16).astype(jnp.float32) * weight)

    (value, out), grad = jax.jit(jnntile.value_and_grad(loss, argnums=1, has_aux=True))(ids, table)
    ref_value, ref_grad = jax.value_and_grad(reference)(table_np)
    np.testing.assert_array_equal(out, np.asarray(jnp.asarray(table_np[ids_np]).astype(jnp.bfloat16), np.float32))
    assert rel_err(value, ref_value) <= 1e-5
    assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= BFLOAT16_TOL  # the gradient passed through bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_bfloat16_table(tiling, dtype):
    """A frozen bfloat16 table (nn.base_dtype) gives the rows of the float32 lookup of its values, in `dtype`."""
    B, T, V, C, ids_tile, table_tile = TILINGS[tiling]
    ids_np, table_np, _ = make_case(B, T, V, C)
    rounded = np.asarray(jnp.asarray(table_np).astype(jnp.bfloat16), np.float32)
    ids = jnntile.from_array(ids_np, ids_tile)
    table = jnntile.convert(jnntile.from_array(table_np, table_tile), "bfloat16")
    out = embedding(ids, table, dtype)
    assert out.dtype == dtype and out.tile_shape == ids_tile + table_tile[1:]
    looked_up = jax.jit(lambda ids, table: jnntile.to_array(embedding(ids, table, dtype)))(ids, table)
    float_lookup = embedding(ids, jnntile.from_array(rounded, table_tile), dtype).numpy()
    np.testing.assert_array_equal(np.asarray(looked_up, np.float32), np.asarray(float_lookup, np.float32))
    np.testing.assert_array_equal(np.asarray(looked_up, np.float32), rounded[ids_np])


def test_a_bfloat16_table_has_no_gradient():
    ids = jnntile.from_array(np.zeros((2, 3), np.int32))
    table = jnntile.convert(jnntile.zeros((5, 4)), "bfloat16")
    loss = jnntile.value_and_grad(lambda i, t: jnp.sum(jnntile.to_array(embedding(i, t))), argnums=1)
    with pytest.raises(TypeError, match=r"gradient of a bfloat16 table.*only a float32 table.*nn\.base_dtype"):
        loss(ids, table)
    # Differentiated in the other arguments alone, the same table is looked up as before.
    np.testing.assert_array_equal(embedding(ids, table).numpy(), np.zeros((2, 3, 4), np.float32))


def test_position_embedding():
    B, T, C = 3, 5, 4
    wpe = np.random.default_rng(1).standard_normal((8, C)).astype(np.float32)
    pos = position_ids(B, T, (2, 2))
    assert pos.dtype == "int32" and pos.tile_shape == (2, 2)
    out = embedding(pos, jnntile.from_array(wpe, (3, 4)))
    np.testing.assert_array_equal(out.numpy(), np.broadcast_to(wpe[:T], (B, T, C)))


def test_gradients_accumulate_across_uses():
    # A tied table used twice gets the sum of both gradients.
    ids_np, table_np, weight = make_case(2, 4, 6, 3, seed=2)
    ids, table = jnntile.from_array(ids_np, (1, 2)), jnntile.from_array(table_np, (4, 2))

    def loss(ids, table):
        return jnp.sum((jnntile.to_array(embedding(ids, table)) + jnntile.to_array(embedding(ids, table))) * weight)

    _, grad = jnntile.value_and_grad(loss, argnums=1)(ids, table)
    ref = jax.grad(lambda t: jnp.sum(2 * t[ids_np] * weight))(table_np)
    assert rel_err(jnntile.grad_of(grad).numpy(), ref) <= 1e-5


def test_out_of_range_ids_never_touch_memory_outside_the_table():
    # The native safety net: such ids give zero rows and no gradient, never a crash.
    ids_np = np.array([[0, 5, -1, 2]], dtype=np.int32)
    table_np = np.arange(10, dtype=np.float32).reshape(5, 2)
    ids, table = jnntile.from_array(ids_np, (1, 2)), jnntile.from_array(table_np, (2, 2))
    expected = np.stack([table_np[0], np.zeros(2), np.zeros(2), table_np[2]])[None]
    np.testing.assert_array_equal(embedding(ids, table).numpy(), expected)
    _, grad = jnntile.value_and_grad(lambda i, t: jnp.sum(jnntile.to_array(embedding(i, t))), argnums=1)(ids, table)
    expected_grad = np.zeros_like(table_np)
    expected_grad[[0, 2]] = 1.0
    np.testing.assert_array_equal(jnntile.grad_of(grad).numpy(), expected_grad)


def test_check_ids():
    check_ids(np.array([[0, 4]]), 5)
    check_ids(jnp.array([3, 1], dtype=jnp.int32), 5)
    with pytest.raises(ValueError, match=r"token id 5 at index \(1, 0\).*\[0, 5\)"):
        check_ids(np.array([[0, 1], [5, 2]]), 5)
    with pytest.raises(ValueError, match=r"token id -3 .*vocab_size=7"):
        check_ids(jnp.array([-3]), 7)
    with pytest.raises(TypeError, match="integers"):
        check_ids(np.array([0.5]), 5)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda ids: check_ids(ids, 5))(jnp.array([1]))


def test_bad_inputs():
    table = jnntile.zeros((5, 4))
    with pytest.raises(TypeError, match="ids must be int32"):
        embedding(jnntile.zeros((2, 3)), table)
    with pytest.raises(TypeError, match="table must be float32 or bfloat16"):
        embedding(jnntile.from_array(np.zeros((2, 3), np.int32)), jnntile.from_array(np.zeros((5, 4), np.int32)))
    with pytest.raises(ValueError, match=r"table must be \(vocab_size, channels\)"):
        embedding(jnntile.from_array(np.zeros((2, 3), np.int32)), jnntile.zeros((5, 4, 2)))
