"""layer_norm and rms_norm: values and gradients against a jnp reference, for every tiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BFLOAT16_TOL, check_op

import jnntile
from jnntile.ops.layernorm import layer_norm, rms_norm

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

EPS = 1e-5

# x shape, x tile (weight and bias take x's tile on the last axis)
TILINGS = {
    "one_tile": ((2, 4, 8), (2, 4, 8)),
    "many_tiles": ((2, 4, 8), (1, 2, 4)),
    "uneven_tiles": ((3, 5, 10), (2, 2, 3)),
    "vector_x": ((10,), (4,)),
    # Rows longer than a GPU warp (32), C tiles 40 + 40 + 20.
    "long_rows": ((3, 100), (2, 40)),
    # C whole (one task per leading tile in the forward and for dx), leading tiles uneven.
    "whole_rows": ((3, 5, 10), (2, 2, 10)),
    "whole_long_rows": ((3, 100), (2, 100)),
}


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))


def reference(x, w, b):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + EPS) * w + b


def make_case(shape, tile, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[-1]
    x_np = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    w_np = (1 + 0.3 * rng.standard_normal(C)).astype(np.float32)
    b_np = rng.standard_normal(C).astype(np.float32)
    weight = rng.standard_normal(shape).astype(np.float32)
    tensors = (jnntile.from_array(x_np, tile), jnntile.from_array(w_np, tile[-1:]), jnntile.from_array(b_np, tile[-1:]))
    return tensors, (x_np, w_np, b_np), weight


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_values_and_gradients(tiling, jit):
    shape, tile = TILINGS[tiling]
    tensors, arrays, weight = make_case(shape, tile)

    out = layer_norm(*tensors, EPS)
    assert out.shape == shape and out.tile_shape == tile
    forward = lambda *t: jnntile.to_array(layer_norm(*t, EPS))  # noqa: E731
    assert rel_err((jax.jit(forward) if jit else forward)(*tensors), reference(*arrays)) <= 1e-5

    def loss(x, w, b):
        return jnp.sum(jnntile.to_array(layer_norm(x, w, b, EPS)) * weight)

    def ref_loss(x, w, b):
        return jnp.sum(reference(x, w, b) * weight)

    fn = jnntile.value_and_grad(loss, argnums=(0, 1, 2))
    value, grads = (jax.jit(fn) if jit else fn)(*tensors)
    ref_value, ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(*arrays)
    assert rel_err(value, ref_value) <= 1e-5
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


@pytest.mark.parametrize("argnums", [(0,), (1, 2), (2,)])
def test_gradient_of_some_arguments(argnums):
    tensors, arrays, weight = make_case((3, 4, 10), (2, 3, 4), seed=1)

    def loss(x, w, b):
        return jnp.sum(jnntile.to_array(layer_norm(x, w, b, EPS)) * weight)

    _, grads = jnntile.value_and_grad(loss, argnums=argnums)(*tensors)
    ref_grads = jax.grad(lambda *a: jnp.sum(reference(*a) * weight), argnums=argnums)(*arrays)
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


def test_large_mean_is_as_accurate_as_float32_reference():
    # Per-tile (mean, M2) partials in double combine without cancellation; what
    # is left is the float32 rounding of x and of the stored mean, which the
    # float32 jnp reference has too.
    rng = np.random.default_rng(2)
    x_np = (1000.0 + rng.standard_normal((4, 12))).astype(np.float32)
    w_np, b_np = np.ones(12, np.float32), np.zeros(12, np.float32)
    out = layer_norm(jnntile.from_array(x_np, (2, 5)), jnntile.from_array(w_np, (5,)), jnntile.from_array(b_np, (5,)))
    x64 = x_np.astype(np.float64)
    exact = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + EPS)
    assert rel_err(out.numpy(), exact) <= rel_err(reference(x_np, w_np, b_np), exact)


def test_bad_inputs():
    x = jnntile.zeros((4, 6), tile_shape=(2, 3))
    w, b = jnntile.zeros((6,), tile_shape=(3,)), jnntile.zeros((6,), tile_shape=(3,))
    with pytest.raises(ValueError, match=r"weight has shape \(5,\) but x \(4, 6\) needs \(6,\)"):
        layer_norm(x, jnntile.zeros((5,)), b)
    with pytest.raises(ValueError, match=r"bias tile_shape \(2,\) must equal x's tile on the normalized axis \(3,\)"):
        layer_norm(x, w, jnntile.zeros((6,), tile_shape=(2,)))
    with pytest.raises(TypeError, match="x must be float32"):
        layer_norm(jnntile.from_array(np.zeros((4, 6), np.int32), (2, 3)), w, b)
    with pytest.raises(ValueError, match="eps=-1.0 must be non-negative"):
        layer_norm(x, w, b, -1.0)


# ---- RMS normalization (Llama's RMSNorm): the same kernels, uncentered ---------------------------

def rms_reference(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_rms_norm_values_and_gradients(tiling, jit):
    shape, tile = TILINGS[tiling]
    (x, w, _), (x_np, w_np, _), weight = make_case(shape, tile, seed=3)
    out = rms_norm(x, w, EPS)
    assert out.shape == shape and out.tile_shape == tile
    assert rel_err(out.numpy(), rms_reference(x_np, w_np)) <= 1e-5

    def loss(x, w):
        return jnp.sum(jnntile.to_array(rms_norm(x, w, EPS)) * weight)

    fn = jnntile.value_and_grad(loss, argnums=(0, 1))
    value, grads = (jax.jit(fn) if jit else fn)(x, w)
    ref_value, ref_grads = jax.value_and_grad(lambda x, w: jnp.sum(rms_reference(x, w) * weight),
                                              argnums=(0, 1))(x_np, w_np)
    assert rel_err(value, ref_value) <= 1e-5
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_bfloat16_activations(tiling, centered):
    """x, y, dy and dx bfloat16; statistics, parameters and their gradients in float32."""
    shape, tile = TILINGS[tiling]
    _, (x_np, w_np, b_np), _ = make_case(shape, tile, seed=5)

    def mixed(f):
        return lambda x, *params: f(x.astype(jnp.float32), *params).astype(jnp.bfloat16)

    if centered:
        check_op(lambda x, w, b: layer_norm(x, w, b, EPS), mixed(reference), [x_np, w_np, b_np],
                 [tile, tile[-1:], tile[-1:]], jit=True, dtype=["bfloat16", "float32", "float32"], tol=BFLOAT16_TOL)
    else:
        check_op(lambda x, w: rms_norm(x, w, EPS), mixed(rms_reference), [x_np, w_np], [tile, tile[-1:]], jit=True,
                 dtype=["bfloat16", "float32"], tol=BFLOAT16_TOL)


def test_rms_norm_of_a_large_mean_keeps_it():
    # Unlike layer norm, RMS normalization keeps the mean: a row of 1000 + noise comes out near 1.
    rng = np.random.default_rng(4)
    x_np = (1000.0 + rng.standard_normal((4, 12))).astype(np.float32)
    w_np = np.ones(12, np.float32)
    out = rms_norm(jnntile.from_array(x_np, (2, 5)), jnntile.from_array(w_np, (5,)), EPS).numpy()
    x64 = x_np.astype(np.float64)
    exact = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + EPS)
    assert rel_err(out, exact) <= 1e-6


def test_rms_norm_bad_inputs():
    x = jnntile.zeros((4, 6), tile_shape=(2, 3))
    with pytest.raises(ValueError, match=r"rms_norm: weight has shape \(5,\) but x \(4, 6\) needs \(6,\)"):
        rms_norm(x, jnntile.zeros((5,)))
    with pytest.raises(ValueError, match=r"rms_norm: weight tile_shape \(2,\) must equal x's tile"):
        rms_norm(x, jnntile.zeros((6,), tile_shape=(2,)))
    with pytest.raises(ValueError, match="eps=-1.0 must be non-negative"):
        rms_norm(x, jnntile.zeros((6,), tile_shape=(3,)), -1.0)
