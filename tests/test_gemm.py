"""Tiled GEMM: values and gradients against jnp, every transpose, batch axes, tilings."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BFLOAT16_TOL, check_op

import jnntile
from jnntile.ops import gemm

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

    from jnntile.ops import bias as bias_ops

    settings = jnntile.runtime.config()
    restart_runtime(memory_limit_mb=32, workers=4)
    jnntile.runtime.ensure_started()
    try:
        x = jnp.asarray(rng.standard_normal((256, 4096)), dtype)
        w = jnp.asarray(rng.standard_normal((4096, 256)) * 0.05, dtype)
        b = rng.standard_normal(256).astype(np.float32)
        before = jnntile.runtime.stats()["codelets"].get("gemm", {}).get("tasks", 0)
        product = gemm.matmul(jnntile.from_array(x, (256, 1024)), jnntile.from_array(w, (1024, 256)))
        np.testing.assert_allclose(np.asarray(product.numpy(), np.float32),
                                   np.asarray(jnp.matmul(x, w, preferred_element_type=jnp.float32)
                                              .astype(dtype), np.float32), rtol=2e-2, atol=2e-2)
        assert jnntile.runtime.stats()["codelets"]["gemm"]["tasks"] - before == tasks

        def reference(x, w, b):
            return (jnp.matmul(x, w, preferred_element_type=jnp.float32) + b).astype(x.dtype)

        check_op(lambda x, w, b: bias_ops.linear(x, w, b), reference,
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
