"""Sum of squares and norm into a scalar tensor, values and gradients."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import check_op, rel_err

import jnntile
from jnntile.ops import reduce

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

TILINGS = {"one tile": None, "many tiles": (2, 4, 3), "uneven tiles": (3, 3, 5)}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiles", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("name", ["sumsq", "norm"])
def test_reductions(rng, jit, tiles, name):
    x = rng.standard_normal((4, 8, 6)).astype(np.float32)
    reference = {"sumsq": lambda a: jnp.sum(a * a), "norm": lambda a: jnp.sqrt(jnp.sum(a * a))}[name]
    check_op(getattr(reduce, name), reference, [x], [tiles], jit=jit)


def test_large_sum_is_accurate():
    x = np.full((1000, 1000), 0.1, dtype=np.float32)
    t = jnntile.from_array(x, (100, 300))
    assert rel_err(reduce.sumsq(t).numpy(), np.sum(x.astype(np.float64) ** 2)) < 1e-7


def test_norm_of_zero_has_zero_gradient():
    t = jnntile.zeros((3, 3))
    _, g = jnntile.value_and_grad(reduce.norm)(t)
    np.testing.assert_array_equal(jnntile.grad_of(g).numpy(), np.zeros((3, 3)))


def test_int_tensor_is_refused():
    with pytest.raises(TypeError, match="float32"):
        reduce.norm(jnntile.from_array(np.ones(3, np.int32)))
