"""Tiled GEMM and the linear layer on it (bias and residual added by the product's tasks): values and
gradients against jnp, every transpose, batch axes, tilings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BFLOAT16_TOL, check_op, check_value_and_grads, normal, rel_err, tasks_run

import jnntile
from jnntile.ops import gemm
from jnntile.ops.gemm import linear

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

# (shape of a, tiles of a, shape of b, tiles of b) for C = A @ B with M=6, K=10, N=7
TILINGS = {
    "one tile": (None, None),
    "many tiles": ((3, 5), (5, 7)),
    "uneven tiles": ((4, 3), (3, 4)),
}


def _transpose_layout(shape, tiles, trans):
    if not trans:
        return shape, tiles
    return shape[::-1], None if tiles is None else tiles[::-1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiles", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul(rng, jit, tiles, trans_a, trans_b, dtype):
    """bfloat16: operands and result bfloat16, products summed in float32 and rounded once, also over
    several K tiles (many tiles)."""
    a_shape, a_tiles = _transpose_layout((6, 10), tiles[0], trans_a)
    b_shape, b_tiles = _transpose_layout((10, 7), tiles[1], trans_b)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)

    def reference(x, y):
        product = jnp.matmul(x.T if trans_a else x, y.T if trans_b else y, preferred_element_type=jnp.float32)
        return (0.5 * product).astype(x.dtype)

    check_op(lambda x, y: gemm.matmul(x, y, trans_a=trans_a, trans_b=trans_b, alpha=0.5), reference,
             [a, b], [a_tiles, b_tiles], jit=jit, dtype=dtype, tol=BFLOAT16_TOL if dtype == "bfloat16" else 1e-5)


@pytest.mark.parametrize("k_tile", [None, 300], ids=["one K tile", "uneven K tiles"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_bfloat16_across_the_packed_blocks(rng, k_tile, trans_a, trans_b):
    """Without oneMKL the CPU multiplies bfloat16 tiles in its own product (kernels/cpu/gemm.cc), which packs
    blocks of 144 rows of A, 256 of K and 3072 columns of B into register blocks of 6 x 16, converting 8
    values at a time: M = 150, K = 603 and N = 3100 end each block short and each register block and group
    of 8 with a remainder, in one K tile (K blocks 256 + 256 + 91) and in tiles of 300 (300 + 300 + 3)."""
    a_shape, a_tiles = _transpose_layout((150, 603), (150, k_tile) if k_tile else None, trans_a)
    b_shape, b_tiles = _transpose_layout((603, 3100), (k_tile, 3100) if k_tile else None, trans_b)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)

    def reference(x, y):
        product = jnp.matmul(x.T if trans_a else x, y.T if trans_b else y, preferred_element_type=jnp.float32)
        return (0.5 * product).astype(x.dtype)

    check_op(lambda x, y: gemm.matmul(x, y, trans_a=trans_a, trans_b=trans_b, alpha=0.5), reference, [a, b],
             [a_tiles, b_tiles], jit=True, dtype="bfloat16", tol=BFLOAT16_TOL)


@pytest.mark.parametrize("dtype, tasks", [("float32", 4), ("bfloat16", 2)])
def test_k_tiles_in_several_tasks_where_one_would_not_fit(rng, dtype, tasks):
    """A C tile's K tiles go to one task where their tiles fit the runtime's bytes per task together
    (task_group_bytes_limit: an eighth of 32 MB with four CPU workers here), else to tasks of consecutive
    ones: 256 x 4096 @ 4096 x 256 in K tiles of 1024 (2 MB each in float32, 1 MB in bfloat16) is 4 tasks in
    float32, 2 in bfloat16, whose bfloat16 C is summed in a float32 tile between them; with a bias (added
    by the last) and its gradient (summed in the first row of dW's tasks)."""
    from conftest import restart_runtime

    settings = jnntile.runtime.config()
    restart_runtime(memory_limit_mb=32, workers=4)
    jnntile.runtime.ensure_started()
    try:
        x = jnp.asarray(rng.standard_normal((256, 4096)), dtype)
        w = jnp.asarray(rng.standard_normal((4096, 256)) * 0.05, dtype)
        b = rng.standard_normal(256).astype(np.float32)
        before = tasks_run()["gemm"]
        product = gemm.matmul(jnntile.from_array(x, (256, 1024)), jnntile.from_array(w, (1024, 256)))
        np.testing.assert_allclose(np.asarray(product.numpy(), np.float32),
                                   np.asarray(jnp.matmul(x, w, preferred_element_type=jnp.float32)
                                              .astype(dtype), np.float32), rtol=2e-2, atol=2e-2)
        assert tasks_run()["gemm"] - before == tasks

        def reference(x, w, b):
            return (jnp.matmul(x, w, preferred_element_type=jnp.float32) + b).astype(x.dtype)

        check_op(lambda x, w, b: linear(x, w, b), reference,
                 [np.asarray(x, np.float32), np.asarray(w, np.float32), b], [(256, 1024), (1024, 256), 256],
                 jit=True, dtype=[dtype, dtype, "float32"], tol=BFLOAT16_TOL if dtype == "bfloat16" else 1e-5)
    finally:
        restart_runtime(memory_limit_mb=settings.memory_limit_mb, workers=settings.workers)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_leading_axes_fold_into_rows(rng, jit):
    # A linear layer: x (B, T, C) @ w (C, 3, H) -> (B, T, 3, H); several row and column axes.
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3, 4)).astype(np.float32)
    check_op(gemm.matmul, lambda x, w: jnp.einsum("btc,cjh->btjh", x, w), [x, w],
             [(1, 3, 4), (4, 1, 3)], jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_contraction_over_several_axes(rng, jit):
    # The weight gradient of a linear layer: x^T (B, T, C) contracted over (B, T) with dy (B, T, N).
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    y = rng.standard_normal((3, 4, 6)).astype(np.float32)
    check_op(lambda a, b: gemm.matmul(a, b, trans_a=True, ndim=2), lambda a, b: jnp.einsum("btc,btn->cn", a, b),
             [x, y], [(2, 3, 2), (2, 3, 4)], jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("trans_b", [False, True])
def test_batched(rng, jit, trans_b):
    a = rng.standard_normal((4, 5, 6)).astype(np.float32)
    b_shape = (4, 7, 6) if trans_b else (4, 6, 7)
    b = rng.standard_normal(b_shape).astype(np.float32)
    b_tiles = (3, 4, 4) if trans_b else (3, 4, 4)

    def reference(x, y):
        return x @ (jnp.swapaxes(y, 1, 2) if trans_b else y)

    check_op(lambda x, y: gemm.matmul(x, y, trans_b=trans_b, batch_ndim=1), reference, [a, b],
             [(3, 2, 4), b_tiles], jit=jit)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_input_twice_accumulates_both_gradients(rng, dtype):
    """d/dA sum((A @ A) * W) needs both uses of A: the gradients must add up. In bfloat16 the second
    product's tiles (three K tiles each) start from the first one's rounded values, widened by their first
    task, and sum in float32 until their last task rounds them."""
    a = rng.standard_normal((5, 5)).astype(np.float32)

    def reference(x):
        return jnp.matmul(x, x, preferred_element_type=jnp.float32).astype(x.dtype)

    check_op(lambda x: gemm.matmul(x, x), reference, [a], [(2, 2)], jit=True, dtype=dtype,
             tol=BFLOAT16_TOL if dtype == "bfloat16" else 1e-5)


def test_mismatched_inner_axes():
    a, b = jnntile.zeros((4, 5)), jnntile.zeros((6, 3))
    with pytest.raises(ValueError, match="contraction axes differ"):
        gemm.matmul(a, b)


def test_mismatched_tiles_on_the_contraction():
    a, b = jnntile.zeros((4, 6), tile_shape=(4, 3)), jnntile.zeros((6, 3), tile_shape=(2, 3))
    with pytest.raises(ValueError, match="tiles on the contraction axes differ"):
        gemm.matmul(a, b)


def test_int_tensors_are_refused():
    a = jnntile.from_array(np.ones((2, 2), np.int32))
    with pytest.raises(TypeError, match="float32"):
        gemm.matmul(a, a)


def test_too_few_axes():
    with pytest.raises(ValueError, match="too few axes"):
        gemm.matmul(jnntile.zeros((4,)), jnntile.zeros((4, 2)), ndim=1, batch_ndim=1)


def test_matmul_needs_one_float_dtype(rng):
    a = jnntile.from_array(rng.standard_normal((4, 4)).astype(np.float32))
    b = jnntile.convert(a, "bfloat16")
    with pytest.raises(TypeError, match="two float32 or two bfloat16"):
        gemm.matmul(a, b)


# x shape, x tile, w shape, w tile
LINEAR_TILINGS = {
    "one_tile": ((2, 4, 6), (2, 4, 6), (6, 5), (6, 5)),
    "many_tiles": ((2, 4, 6), (1, 2, 3), (6, 4), (3, 2)),
    "uneven_tiles": ((3, 5, 7), (2, 3, 3), (7, 5), (3, 2)),
    "fused_qkv": ((2, 5, 6), (1, 3, 4), (6, 3, 2, 3), (4, 1, 2, 2)),
}



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

    db = {}
    for argnums in [(0, 1, 2), (0, 2)]:  # w trained, w frozen
        tensors = [jnntile.from_array(x_np, x_tile), jnntile.from_array(w_np, w_tile),
                   jnntile.from_array(b_np, w_tile[1:])]
        before = tasks_run()["add_bias_db"]
        _, grads = jnntile.value_and_grad(loss, argnums=argnums)(*tensors)
        grads = [jnntile.grad_of(g).numpy() for g in grads]
        assert (tasks_run()["add_bias_db"] > before) == (argnums == (0, 2))
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


def test_linear_bad_inputs():
    x = jnntile.zeros((4, 6), tile_shape=(2, 3))
    w = jnntile.zeros((6, 5), tile_shape=(3, 5))
    with pytest.raises(ValueError, match=r"linear: b .* must match w's output axes"):
        linear(x, w, jnntile.zeros((4,)))
    with pytest.raises(ValueError, match="contraction axes"):
        linear(x, jnntile.zeros((6, 5), tile_shape=(2, 5)))
    with pytest.raises(ValueError, match=r"linear: the residual .* must have the result's shape \(4, 5\), tiles "
                                         r"\(2, 5\) and dtype float32"):
        linear(x, w, residual=jnntile.zeros((4, 5), tile_shape=(4, 5)))
