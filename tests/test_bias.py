"""add_bias and linear: values and gradients against jnp, for every tiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BFLOAT16_TOL, check_op

import jnntile
from jnntile.ops.bias import add_bias, linear

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

# x shape, x tile; b is x's trailing axes (given by their count) with x's tiles on them
BIAS_TILINGS = {
    "one_tile": ((2, 4, 6), (2, 4, 6), 1),
    "many_tiles": ((2, 4, 6), (1, 2, 3), 1),
    "uneven_tiles": ((3, 5, 7), (2, 2, 3), 1),
    "vector_x": ((7,), (3,), 1),
    "several_bias_axes": ((3, 5, 3, 2, 4), (2, 3, 1, 2, 3), 3),
    # tiles of more rows and columns than a CUDA block of the bias gradient spans (16 x 32)
    "wide_tiles": ((3, 40, 70), (2, 24, 40), 1),
}

# x shape, x tile, w shape, w tile
LINEAR_TILINGS = {
    "one_tile": ((2, 4, 6), (2, 4, 6), (6, 5), (6, 5)),
    "many_tiles": ((2, 4, 6), (1, 2, 3), (6, 4), (3, 2)),
    "uneven_tiles": ((3, 5, 7), (2, 3, 3), (7, 5), (3, 2)),
    "fused_qkv": ((2, 5, 6), (1, 3, 4), (6, 3, 2, 3), (4, 1, 2, 2)),
}


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))


def normal(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def check_value_and_grads(loss, reference, tensors, arrays, jit):
    argnums = tuple(range(len(tensors)))
    fn = jnntile.value_and_grad(loss, argnums=argnums)
    value, grads = (jax.jit(fn) if jit else fn)(*tensors)
    ref_value, ref_grads = jax.value_and_grad(reference, argnums=argnums)(*arrays)
    assert rel_err(value, ref_value) <= 1e-5
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", BIAS_TILINGS)
def test_add_bias(tiling, jit):
    shape, tile, k = BIAS_TILINGS[tiling]
    x_np, b_np, weight = normal(shape, 0), normal(shape[-k:], 1), normal(shape, 2)
    x, b = jnntile.from_array(x_np, tile), jnntile.from_array(b_np, tile[-k:])

    out = add_bias(x, b)
    assert out.shape == shape and out.tile_shape == tile
    forward = lambda x, b: jnntile.to_array(add_bias(x, b))  # noqa: E731
    assert rel_err((jax.jit(forward) if jit else forward)(x, b), x_np + b_np) <= 1e-6

    def loss(x, b):
        return jnp.sum(jnntile.to_array(add_bias(x, b)) * weight)

    def reference(x, b):
        return jnp.sum((x + b) * weight)

    check_value_and_grads(loss, reference, (x, b), (x_np, b_np), jit)


@pytest.mark.parametrize("tiling", BIAS_TILINGS)
def test_add_bias_bfloat16(tiling):
    """x and out bfloat16, b float32; the sum in float32 rounded once, db summed from bfloat16 dy in float."""
    shape, tile, k = BIAS_TILINGS[tiling]

    def reference(x, b):
        return (x.astype(jnp.float32) + b).astype(jnp.bfloat16)

    check_op(add_bias, reference, [normal(shape, 0), normal(shape[-k:], 1)], [tile, tile[-k:]], jit=True,
             dtype=["bfloat16", "float32"], tol=BFLOAT16_TOL)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", LINEAR_TILINGS)
def test_linear(tiling, jit, with_bias):
    x_shape, x_tile, w_shape, w_tile = LINEAR_TILINGS[tiling]
    out_shape = x_shape[:-1] + w_shape[1:]
    x_np, w_np, b_np, weight = normal(x_shape, 0), normal(w_shape, 1), normal(w_shape[1:], 2), normal(out_shape, 3)
    tensors = [jnntile.from_array(x_np, x_tile), jnntile.from_array(w_np, w_tile)]
    arrays = [x_np, w_np]
    if with_bias:
        tensors.append(jnntile.from_array(b_np, w_tile[1:]))
        arrays.append(b_np)

    out = linear(*tensors)
    assert out.shape == out_shape and out.tile_shape == x_tile[:-1] + w_tile[1:]

    def loss(*tensors):
        return jnp.sum(jnntile.to_array(linear(*tensors)) * weight)

    def reference(x, w, b=0.0):
        return jnp.sum((jnp.tensordot(x, w, axes=1) + b) * weight)

    check_value_and_grads(loss, reference, tensors, arrays, jit)


@pytest.mark.parametrize("tiling", LINEAR_TILINGS)
def test_linear_bfloat16(tiling):
    """x and W bfloat16, b float32: the product summed in float32 over the K tiles, the bias added to it in
    float32 by the last K tile's task, rounded once; db summed from bfloat16 dy in float."""
    x_shape, x_tile, w_shape, w_tile = LINEAR_TILINGS[tiling]

    def reference(x, w, b):
        product = jnp.tensordot(x.astype(jnp.float32), w.astype(jnp.float32), axes=1)
        return (product + b).astype(jnp.bfloat16)

    check_op(linear, reference, [normal(x_shape, 0), normal(w_shape, 1), normal(w_shape[1:], 2)],
             [x_tile, w_tile, w_tile[1:]], jit=True, dtype=["bfloat16", "bfloat16", "float32"], tol=BFLOAT16_TOL)


def test_linear_with_the_weight_out_first_and_two_input_axes():
    """W stored (N, C1, C2) as torch stores a Linear's weight, contracting x's last two axes, uneven tiles."""
    x_np, w_np, b_np = normal((3, 4, 2, 5), 0), normal((6, 2, 5), 1), normal((6,), 2)

    def op(x, w, b):
        return linear(x, w, b, ndim=2, trans_b=True)

    def reference(x, w, b):
        return jnp.tensordot(x, w, axes=((2, 3), (1, 2))) + b

    check_op(op, reference, [x_np, w_np, b_np], [(2, 3, 1, 3), (4, 1, 3), (4,)], jit=True)


def test_a_bias_shared_by_two_layers_sums_both_gradients():
    """The second layer's bias gradient adds to the first's (the first wrote it: it held nothing yet)."""
    x_np, w1_np, w2_np, b_np = normal((4, 6), 0), normal((6, 6), 1), normal((6, 6), 2), normal((6,), 3)

    def op(x, w1, w2, b):
        return linear(linear(x, w1, b), w2, b)

    def reference(x, w1, w2, b):
        return (x @ w1 + b) @ w2 + b

    check_op(op, reference, [x_np, w1_np, w2_np, b_np], [(2, 3), (3, 3), (3, 3), (3,)], jit=False)


@pytest.mark.parametrize("tiling", LINEAR_TILINGS)
def test_the_bias_gradient_is_summed_in_the_weight_gradient_tasks(tiling):
    """With w's gradient wanted, db is summed by the tasks of dw (no add_bias_db task); with w frozen, by a
    pass of its own over dy, in the same order: the same bits. Gradients against jnp either way."""
    x_shape, x_tile, w_shape, w_tile = LINEAR_TILINGS[tiling]
    out_shape = x_shape[:-1] + w_shape[1:]
    x_np, w_np, b_np, weight = normal(x_shape, 0), normal(w_shape, 1), normal(w_shape[1:], 2), normal(out_shape, 3)

    def loss(x, w, b):
        return jnp.sum(jnntile.to_array(linear(x, w, b)) * weight)

    def reference(x, w, b):
        return jnp.sum((jnp.tensordot(x, w, axes=1) + b) * weight)

    def db_tasks():
        jnntile.runtime.wait_all()
        return jnntile.runtime.stats()["codelets"].get("add_bias_db", {}).get("tasks", 0)

    db = {}
    for argnums in [(0, 1, 2), (0, 2)]:  # w trained, w frozen
        tensors = [jnntile.from_array(x_np, x_tile), jnntile.from_array(w_np, w_tile),
                   jnntile.from_array(b_np, w_tile[1:])]
        before = db_tasks()
        _, grads = jnntile.value_and_grad(loss, argnums=argnums)(*tensors)
        grads = [jnntile.grad_of(g).numpy() for g in grads]
        assert (db_tasks() > before) == (argnums == (0, 2))
        _, ref_grads = jax.value_and_grad(reference, argnums=argnums)(x_np, w_np, b_np)
        for grad, ref_grad in zip(grads, ref_grads):
            assert rel_err(grad, ref_grad) <= 1e-5
        db[argnums] = grads[-1]
    np.testing.assert_array_equal(db[(0, 1, 2)], db[(0, 2)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("tiling", LINEAR_TILINGS)
def test_linear_with_a_residual(tiling, with_bias, dtype):
    """r + x @ W (+ b), the residual added by the product's tasks (its first task on each tile starts from r's
    tile): values, and the gradients of x, W, b and r (r's is the output's, copied)."""
    x_shape, x_tile, w_shape, w_tile = LINEAR_TILINGS[tiling]
    out_shape, out_tile = x_shape[:-1] + w_shape[1:], x_tile[:-1] + w_tile[1:]
    arrays = [normal(x_shape, 0), normal(w_shape, 1), normal(out_shape, 4)] + ([normal(w_shape[1:], 2)]
                                                                              if with_bias else [])

    def op(x, w, r, b=None):
        return linear(x, w, b, residual=r)

    def reference(x, w, r, b=0.0):
        product = jnp.tensordot(x.astype(jnp.float32), w.astype(jnp.float32), axes=1)
        return (r.astype(jnp.float32) + product + b).astype(x.dtype)

    dtypes = [dtype] * 3 + ["float32"] * with_bias
    check_op(op, reference, arrays, [x_tile, w_tile, out_tile] + [w_tile[1:]] * with_bias, jit=True, dtype=dtypes,
             tol=BFLOAT16_TOL if dtype == "bfloat16" else 1e-5)


def test_bad_inputs():
    x = jnntile.zeros((4, 6), tile_shape=(2, 3))
    with pytest.raises(ValueError, match=r"b of shape \(5,\) must equal the trailing axes of x \(4, 6\)"):
        add_bias(x, jnntile.zeros((5,)))
    with pytest.raises(ValueError, match=r"b's tile_shape \(2,\) must equal x's tiles on its trailing axes \(3,\)"):
        add_bias(x, jnntile.zeros((6,), tile_shape=(2,)))
    with pytest.raises(ValueError, match="trailing axes"):
        add_bias(x, jnntile.zeros((2, 4, 6)))
    with pytest.raises(TypeError, match="float32"):
        add_bias(x, jnntile.from_array(np.zeros(6, np.int32), (3,)))
    with pytest.raises(TypeError, match="b float32"):
        add_bias(x, jnntile.zeros((6,), dtype="bfloat16", tile_shape=(3,)))
    w = jnntile.zeros((6, 5), tile_shape=(3, 5))
    with pytest.raises(ValueError, match=r"linear: b .* must match w's output axes"):
        linear(x, w, jnntile.zeros((4,)))
    with pytest.raises(ValueError, match="contraction axes"):
        linear(x, jnntile.zeros((6, 5), tile_shape=(2, 5)))
    with pytest.raises(ValueError, match=r"linear: the residual .* must have the result's shape \(4, 5\), tiles "
                                         r"\(2, 5\) and dtype float32"):
        linear(x, w, residual=jnntile.zeros((4, 5), tile_shape=(4, 5)))
