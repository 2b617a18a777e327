"""Fused softmax cross-entropy against jax.nn.logsumexp with an ignore mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BFLOAT16_TOL

import jnntile
from jnntile.ops import loss

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

B, T, V = 2, 6, 40
TILINGS = {
    "one_tile": (B, T, V),
    "many_tiles": (1, 3, 10),
    "uneven_tiles": (2, 4, 16),  # T = 4 + 2, V = 16 + 16 + 8
}


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)) / np.linalg.norm(b)


def reference(logits, targets, ignore_index=-100):
    """Mean of logsumexp - logit[target] over non-ignored tokens; out-of-range targets add logsumexp only."""
    keep = targets != ignore_index
    in_range = (targets >= 0) & (targets < logits.shape[-1])
    picked = jnp.take_along_axis(logits, jnp.where(in_range, targets, 0)[..., None], -1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.where(in_range, picked, 0.0)
    count = jnp.sum(keep)
    return jnp.where(count > 0, jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.maximum(count, 1), 0.0)


def make_data(seed=0, ignore_index=-100):
    rng = np.random.default_rng(seed)
    # Rows with large offsets check the online max across vocabulary tiles.
    logits = (3.0 * rng.standard_normal((B, T, V)) + 50.0 * rng.standard_normal((B, T, 1))).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, 1] = targets[1, 5] = ignore_index
    return logits, targets


def check(logits, targets, tile_shape, jit, ignore_index=-100, scale=2.5):
    x = jnntile.from_array(logits, tile_shape)
    y = jnntile.from_array(targets, tile_shape[:2])

    def f(x, y):  # scale checks that the incoming cotangent is applied
        return scale * jnntile.to_array(loss.cross_entropy(x, y, ignore_index=ignore_index))

    vg = jnntile.value_and_grad(f)
    value, grad = (jax.jit(vg) if jit else vg)(x, y)
    ref_value, ref_grad = jax.value_and_grad(lambda z: scale * reference(z, targets, ignore_index))(logits)
    assert grad.id == x.id
    return float(value), float(ref_value), jnntile.grad_of(grad).numpy(), np.asarray(ref_grad)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_values_and_gradients(tiling, jit):
    logits, targets = make_data()
    value, ref_value, grad, ref_grad = check(logits, targets, TILINGS[tiling], jit)
    assert abs(value - ref_value) <= 1e-5 * abs(ref_value)
    assert rel_err(grad, ref_grad) <= 1e-5
    # Ignored tokens get no gradient at all.
    assert not grad[0, 1].any() and not grad[1, 5].any()


@pytest.mark.parametrize("tiling", TILINGS)
def test_bfloat16_logits(tiling):
    """bfloat16 logits and gradient; the online logsumexp and the loss in float32/double, as the reference
    computes the loss of the bfloat16 logits in float32."""
    logits, targets = make_data()
    half = jnp.asarray(logits, jnp.bfloat16)
    x, y = jnntile.from_array(half, TILINGS[tiling]), jnntile.from_array(targets, TILINGS[tiling][:2])
    value, grad = jax.jit(jnntile.value_and_grad(lambda x, y: jnntile.to_array(loss.cross_entropy(x, y))))(x, y)
    ref_value, ref_grad = jax.value_and_grad(lambda z: reference(z.astype(jnp.float32), targets))(half)
    assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value))
    assert jnntile.grad_of(grad).dtype == "bfloat16"
    assert rel_err(jnntile.grad_of(grad).numpy().astype(np.float32), np.asarray(ref_grad, np.float32)) <= BFLOAT16_TOL


def test_primal_without_gradient():
    logits, targets = make_data(seed=1)
    out = loss.cross_entropy(jnntile.from_array(logits, (1, 4, 16)), jnntile.from_array(targets, (1, 4)))
    assert out.shape == () and out.dtype == "float32"
    np.testing.assert_allclose(out.numpy(), reference(logits, targets), rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_ignore_index_inside_vocabulary(jit):
    logits, targets = make_data(seed=2, ignore_index=7)
    value, ref_value, grad, ref_grad = check(logits, targets, (2, 4, 16), jit, ignore_index=7)
    assert abs(value - ref_value) <= 1e-5 * abs(ref_value)
    assert rel_err(grad, ref_grad) <= 1e-5


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_all_ignored_is_zero(jit):
    logits, _ = make_data(seed=3)
    targets = np.full((B, T), -100, np.int32)
    value, _, grad, _ = check(logits, targets, (1, 4, 16), jit)
    assert value == 0.0
    assert not grad.any()


def test_out_of_range_targets_add_only_logsumexp():
    logits, targets = make_data(seed=4)
    targets[0, 0], targets[1, 2] = V, -5  # neither in [0, V) nor the ignore index
    value, ref_value, grad, ref_grad = check(logits, targets, (2, 4, 16), jit=False)
    assert abs(value - ref_value) <= 1e-5 * abs(ref_value)
    assert rel_err(grad, ref_grad) <= 1e-5


def test_bad_inputs():
    x = jnntile.from_array(np.zeros((B, T, V), np.float32), (1, 3, 16))
    y = jnntile.from_array(np.zeros((B, T), np.int32), (1, 3))
    with pytest.raises(TypeError, match="targets must be int32"):
        loss.cross_entropy(x, jnntile.from_array(np.zeros((B, T), np.float32), (1, 3)))
    with pytest.raises(TypeError, match="logits must be float32"):
        loss.cross_entropy(jnntile.from_array(np.zeros((B, T, V), np.int32), (1, 3, 16)), y)
    with pytest.raises(ValueError, match=r"must have shape \(B, T, V\)"):
        loss.cross_entropy(jnntile.from_array(np.zeros((B * T, V), np.float32), (3, 16)), y)
    with pytest.raises(ValueError, match=r"targets shape \(2, 5\)"):
        loss.cross_entropy(x, jnntile.from_array(np.zeros((B, T - 1), np.int32), (1, 3)))
    with pytest.raises(ValueError, match=r"tile_shape=\(1, 3\)"):
        loss.cross_entropy(x, jnntile.from_array(np.zeros((B, T), np.int32), (2, 3)))
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        loss.cross_entropy(x, y, ignore_index=-100.0)
    with pytest.raises(TypeError, match="jnntile Tensors"):
        loss.cross_entropy(np.zeros((B, T, V), np.float32), y)


def test_reference_matches_optax():
    optax = pytest.importorskip("optax")
    logits, targets = make_data(seed=5)
    keep = targets != -100
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, np.where(keep, targets, 0))
    np.testing.assert_allclose(reference(logits, targets), np.sum(per_token * keep) / keep.sum(), rtol=1e-6)
