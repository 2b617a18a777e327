"""add_bias: values and gradients against jnp, for every tiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BFLOAT16_TOL, check_op, check_value_and_grads, normal, rel_err

import jnntile
from jnntile.ops.bias import add_bias

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
