"""swiglu: values and gradients against jax.nn.silu(gate) * up, for every tiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BFLOAT16_TOL, check_op, rel_err

import jnntile
from jnntile.ops.gated import swiglu

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

TILINGS = {  # x shape (..., 2, I), x tile (..., 1, ti)
    "one_tile": ((4, 2, 6), (4, 1, 6)),
    "many_tiles": ((4, 2, 6), (2, 1, 3)),
    "uneven_tiles": ((3, 5, 2, 10), (2, 2, 1, 3)),
    "two_axes": ((2, 7), (1, 3)),
}


def reference(x):
    return jax.nn.silu(x[..., 0, :]) * x[..., 1, :]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_values_and_gradients(tiling, jit):
    shape, tile = TILINGS[tiling]
    rng = np.random.default_rng(0)
    x_np = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    weight = rng.standard_normal(shape[:-2] + shape[-1:]).astype(np.float32)
    x = jnntile.from_array(x_np, tile)

    def loss(x):
        y = swiglu(x)
        assert y.shape == weight.shape and y.tile_shape == tile[:-2] + tile[-1:]
        return jnp.sum(jnntile.to_array(y) * weight)

    fn = jnntile.value_and_grad(loss)
    value, grad = (jax.jit(fn) if jit else fn)(x)
    ref_value, ref_grad = jax.value_and_grad(lambda z: jnp.sum(reference(z) * weight))(x_np)
    assert rel_err(value, ref_value) <= 1e-5
    assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


@pytest.mark.parametrize("tiling", TILINGS)
def test_bfloat16(tiling):
    shape, tile = TILINGS[tiling]
    x_np = (3.0 * np.random.default_rng(1).standard_normal(shape)).astype(np.float32)
    check_op(swiglu, lambda z: reference(z.astype(jnp.float32)).astype(jnp.bfloat16), [x_np], [tile], jit=True,
             dtype="bfloat16", tol=BFLOAT16_TOL)


def test_extreme_inputs_stay_finite_and_exact():
    gate = np.array([-100.0, -30.0, -1.0, 0.0, 1.0, 30.0, 100.0], np.float32)
    x_np = np.stack([gate, np.full_like(gate, 2.0)])
    x = jnntile.from_array(x_np, (1, 4))
    y = swiglu(x).numpy()
    np.testing.assert_allclose(y, reference(x_np), rtol=1e-6, atol=1e-30)
    _, grad = jnntile.value_and_grad(lambda x: jnp.sum(jnntile.to_array(swiglu(x))))(x)
    ref_grad = jax.grad(lambda z: jnp.sum(reference(z)))(x_np)
    dx = jnntile.grad_of(grad).numpy()
    assert np.all(np.isfinite(dx))
    np.testing.assert_allclose(dx, ref_grad, rtol=1e-6, atol=1e-30)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"must have shape \(\.\.\., 2, I\)"):
        swiglu(jnntile.zeros((4, 3, 6)))
    with pytest.raises(ValueError, match=r"use tile_shape \(4, 1, 6\)"):
        swiglu(jnntile.zeros((4, 2, 6)))
    with pytest.raises(TypeError, match="float32"):
        swiglu(jnntile.from_array(np.zeros((4, 2, 6), np.int32), (4, 1, 6)))
