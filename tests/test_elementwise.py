"""Elementwise ops: the unary family and the linear family, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BFLOAT16_TOL, check_op, tasks_run

import jnntile
from jnntile.ops import elementwise as ew

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

# Every native unary function (the enum of xla_ffi/kernels/elementwise.h): each needs its op and its reference.
UNARY_NAMES = sorted(jnntile._xla_ffi.Unary.__members__)
TILINGS = {"one tile": None, "many tiles": (2, 4), "uneven tiles": (3, 5)}
SHAPE = (6, 8)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiles", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("name", UNARY_NAMES)
def test_unary(rng, jit, tiles, name):
    x = rng.standard_normal(SHAPE).astype(np.float32) * 2
    check_op(getattr(ew, name), ew.UNARY[name], [x], [tiles], jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiles", TILINGS.values(), ids=TILINGS.keys())
def test_axpby(rng, jit, tiles):
    x, y = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    check_op(lambda a, b: ew.axpby(2.0, a, -0.5, b), lambda a, b: 2.0 * a - 0.5 * b, [x, y], [tiles, tiles], jit=jit)


def _in_float32(f):
    """The pure-JAX op in mixed precision: bfloat16 arrays computed in float32, the result rounded to bfloat16."""
    return lambda *xs: f(*(x.astype(jnp.float32) for x in xs)).astype(jnp.bfloat16)


@pytest.mark.parametrize("tiles", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("name", UNARY_NAMES)
def test_unary_bfloat16(rng, tiles, name):
    x = rng.standard_normal(SHAPE).astype(np.float32) * 2
    check_op(getattr(ew, name), _in_float32(ew.UNARY[name]), [x], [tiles], jit=True, dtype="bfloat16",
             tol=BFLOAT16_TOL)


@pytest.mark.parametrize("tiles", TILINGS.values(), ids=TILINGS.keys())
def test_axpby_bfloat16(rng, tiles):
    x, y = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    check_op(lambda a, b: ew.axpby(2.0, a, -0.5, b), _in_float32(lambda a, b: 2.0 * a - 0.5 * b), [x, y],
             [tiles, tiles], jit=True, dtype="bfloat16", tol=BFLOAT16_TOL)


def test_elementwise_needs_one_float_dtype():
    x = jnntile.zeros((2, 3))
    with pytest.raises(TypeError, match="one dtype"):
        ew.add(x, jnntile.convert(x, "bfloat16"))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ew.relu(jnntile.zeros((2, 3), dtype="int32"))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_add_scale_copy(rng, jit):
    x, y = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    check_op(ew.add, lambda a, b: a + b, [x, y], [(4, 3), (4, 3)], jit=jit)
    check_op(lambda a: ew.scale(3.0, a), lambda a: 3.0 * a, [x], [(4, 3)], jit=jit)
    check_op(ew.copy, lambda a: a, [x], [(4, 3)], jit=jit)


def test_chain_with_reuse(rng):
    # x feeds two branches that meet again: its gradient must sum both paths.
    x = rng.standard_normal(SHAPE).astype(np.float32)

    def op(t):
        return ew.add(ew.gelu_tanh(t), ew.scale(2.0, ew.tanh(t)))

    def reference(a):
        return jax.nn.gelu(a, approximate=True) + 2.0 * jnp.tanh(a)

    check_op(op, reference, [x], [(2, 3)], jit=True)


def test_mismatched_shapes_and_tiles():
    with pytest.raises(ValueError, match="shapes differ"):
        ew.add(jnntile.zeros((2, 3)), jnntile.zeros((3, 2)))
    with pytest.raises(ValueError, match="tile shapes differ"):
        ew.add(jnntile.zeros((4, 4), tile_shape=2), jnntile.zeros((4, 4), tile_shape=4))


def test_int_tensor_is_refused():
    with pytest.raises(TypeError, match="float32"):
        ew.relu(jnntile.from_array(np.ones(3, np.int32)))


@pytest.mark.parametrize("keep_activations", [False, True])
def test_add_backward_hands_its_output_gradient_over(rng, keep_activations):
    # The backward of x + x: the output's gradient is released after it, so its tiles become x's gradient (no
    # copy task) and the second use adds them once more; with the activations kept, it copies them as before.
    x = rng.standard_normal((8, 6)).astype(np.float32)
    weights = rng.standard_normal((8, 6)).astype(np.float32)

    def loss(t):
        return jnp.sum(jnntile.to_array(ew.add(t, t)) * weights)

    t = jnntile.from_array(x, (4, 3))
    before = tasks_run()["accumulate"]
    value, grad = jax.jit(jnntile.value_and_grad(loss, keep_activations=keep_activations))(t)
    np.testing.assert_allclose(jnntile.grad_of(grad).numpy(), 2 * weights, rtol=1e-6)
    np.testing.assert_allclose(float(value), float(np.sum(2 * x * weights)), rtol=1e-5)
    accumulated = tasks_run()["accumulate"] - before
    assert accumulated == 4 * (1 if not keep_activations else 2), "one accumulate task per tile and target"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("start, size", [(0, 2), (2, 1), (3, 2)])
def test_add_part(rng, jit, start, size):
    # x (4, 5, 6) tiled (1, 2, 4); y fills x's rows [start, start + size) of axis 0 (whole tiles of x).
    x = rng.standard_normal((5, 4, 6)).astype(np.float32)
    y = rng.standard_normal((size, 4, 6)).astype(np.float32)
    expected = lambda a, b: jnp.asarray(a).at[start:start + size].add(b)  # noqa: E731
    check_op(lambda a, b: ew.add_part(a, b, 0, start), expected, [x, y], [(1, 2, 4), (1, 2, 4)], jit=jit)


def test_add_part_needs_whole_tiles():
    x, y = jnntile.zeros((4, 6), tile_shape=(2, 6)), jnntile.zeros((2, 6), tile_shape=(2, 6))
    with pytest.raises(ValueError, match="not a part of whole tiles"):
        ew.add_part(x, y, 0, 1)
