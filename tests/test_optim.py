"""jnntile.optim against Optax: same parameters after 10 steps, under jit, no recompiles."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import mlp_loss, mlp_params, mlp_problem, mlp_reference_loss, rel_err

import jnntile
from jnntile import optim

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=3, decay_steps=10)


def _compare(rng, jnntile_tx, optax_tx, steps=10):
    arrays, (x_np,) = mlp_problem(rng)
    params = mlp_params(arrays)
    x = jnntile.from_array(x_np, (5, 4))
    state = jnntile_tx.init(params)

    @jax.jit
    def step(params, state, x):
        loss, grads = jnntile.value_and_grad(mlp_loss)(params, x)
        updates, state = jnntile_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    ref_params = jax.tree.map(jnp.asarray, arrays)
    ref_state = optax_tx.init(ref_params)
    for i in range(steps):
        params, state, loss = step(params, state, x)
        ref_loss, ref_grads = jax.value_and_grad(mlp_reference_loss)(ref_params, x_np)
        ref_updates, ref_state = optax_tx.update(ref_grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
        if i == 0:  # later losses amplify the float32 rounding of the updates; the parameters are compared
            assert rel_err(loss, ref_loss) < 1e-5
        for name in arrays:
            assert rel_err(params[name].numpy(), ref_params[name]) < 1e-5, f"{name} after step {i}"
    assert step._cache_size() == 1, "changing per-step values (learning rate, count) must not recompile"


def test_adamw_with_schedule_matches_optax(rng):
    _compare(rng, optim.adamw(SCHEDULE, weight_decay=0.1), optax.adamw(SCHEDULE, weight_decay=0.1))


def test_adamw_with_clipping_matches_optax(rng):
    _compare(rng, optax.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, b1=0.8, weight_decay=0.0)),
             optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b1=0.8, weight_decay=0.0)))


def test_sgd_matches_optax(rng):
    _compare(rng, optim.sgd(SCHEDULE), optax.sgd(SCHEDULE))


def test_sgd_with_clipping_matches_optax(rng):
    _compare(rng, optax.chain(optim.clip_by_global_norm(0.5), optim.sgd(0.01)),
             optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.01)))


def test_weight_decay_mask_matches_optax(rng):
    mask = lambda params: {"w1": True, "w2": False}  # noqa: E731
    _compare(rng, optim.adamw(1e-2, weight_decay=0.5, mask=mask), optax.adamw(1e-2, weight_decay=0.5, mask=mask))


def test_global_norm(rng):
    arrays, (x_np,) = mlp_problem(rng)
    params = {k: jnntile.from_array(v, 3) for k, v in arrays.items()}
    _, grads = jnntile.value_and_grad(mlp_loss)(params, jnntile.from_array(x_np, (5, 3)))
    _, ref_grads = jax.value_and_grad(mlp_reference_loss)(jax.tree.map(jnp.asarray, arrays), x_np)
    assert rel_err(optim.global_norm(grads).numpy(), optax.tree.norm(ref_grads)) < 1e-6


def test_plain_optax_on_jnntile_gradients_fails_loudly(rng):
    arrays, (x_np,) = mlp_problem(rng)
    params = {k: jnntile.from_array(v) for k, v in arrays.items()}
    _, grads = jnntile.value_and_grad(mlp_loss)(params, jnntile.from_array(x_np))
    tx = optax.adamw(1e-3)
    with pytest.raises(ValueError, match="Gradient"):
        tx.update(grads, tx.init(params), params)
    with pytest.raises(ValueError, match="Gradient"):
        optax.apply_updates(params, grads)


def test_update_needs_params(rng):
    arrays, (x_np,) = mlp_problem(rng)
    params = {k: jnntile.from_array(v) for k, v in arrays.items()}
    _, grads = jnntile.value_and_grad(mlp_loss)(params, jnntile.from_array(x_np))
    tx = optim.adamw(1e-3)
    with pytest.raises(ValueError, match="in place"):
        tx.update(grads, tx.init(params))


def test_bad_clip_norm():
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(0.0)


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "does-not-clip"])
def test_clipped_gradients_read_before_the_update_hold_the_clip(rng, max_norm):
    # clip_by_global_norm leaves the scaling to the update; anything else that reads the gradients first
    # (here the norm and the values) gets them scaled, as optax's would be.
    arrays, (x_np,) = mlp_problem(rng)
    params = mlp_params(arrays)
    x = jnntile.from_array(x_np, (5, 4))
    _, ref_grads = jax.value_and_grad(mlp_reference_loss)(jax.tree.map(jnp.asarray, arrays), x_np)
    ref_clipped, _ = optax.clip_by_global_norm(max_norm).update(ref_grads, optax.EmptyState())

    @jax.jit
    def clipped(params, x):
        _, grads = jnntile.value_and_grad(mlp_loss)(params, x)
        grads, _ = optim.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        return (jnntile.to_array(optim.global_norm(grads)),
                {k: jnntile.to_array(jnntile.grad_of(g)) for k, g in grads.items()})

    norm, grads = clipped(params, x)
    assert rel_err(norm, optax.tree.norm(ref_clipped)) < 1e-6
    for name in arrays:
        assert rel_err(grads[name], ref_clipped[name]) < 1e-6, name


def _read_every_gradient():
    """A transformation that reads the gradients' values (as logging would) and passes them on."""
    def update(grads, state, params=None):
        for g in jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, jnntile.Tensor)):
            jnntile.to_array(jnntile.grad_of(g))
        return grads, state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "does-not-clip"])
def test_gradients_read_between_the_clip_and_the_update_are_clipped_once(rng, max_norm):
    # The read scales the tiles in place; the ledger tells the update that they hold the clip already.
    _compare(rng, optax.chain(optim.clip_by_global_norm(max_norm), _read_every_gradient(), optim.adamw(1e-2)),
             optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(1e-2)), steps=3)


def test_the_clip_travels_with_the_gradients_through_a_jit_boundary(rng):
    arrays, (x_np,) = mlp_problem(rng)
    params = mlp_params(arrays)
    x = jnntile.from_array(x_np, (5, 4))
    tx = optim.adamw(1e-2)
    ref_tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
    state = tx.init(params)

    @jax.jit
    def clipped_grads(params, x):  # returns Gradients that carry their clip, not applied to the tiles
        _, grads = jnntile.value_and_grad(mlp_loss)(params, x)
        return optim.clip_by_global_norm(0.05).update(grads, optax.EmptyState())[0]

    grads = clipped_grads(params, x)
    assert all(g.clip is not None and g.clip.max_norm == 0.05 for g in grads.values())
    leaves, treedef = jax.tree.flatten(grads)
    assert all(g.clip.norm.id == grads["w1"].clip.norm.id for g in jax.tree.unflatten(treedef, leaves).values())
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_params = jax.tree.map(jnp.asarray, arrays)
    _, ref_grads = jax.value_and_grad(mlp_reference_loss)(ref_params, x_np)
    ref_params = optax.apply_updates(ref_params, ref_tx.update(ref_grads, ref_tx.init(ref_params), ref_params)[0])
    for name in arrays:
        assert rel_err(params[name].numpy(), ref_params[name]) < 1e-5, name


def test_an_update_applies_the_clip_without_a_pass_of_its_own(rng):
    arrays, (x_np,) = mlp_problem(rng)
    params = mlp_params(arrays)
    x = jnntile.from_array(x_np, (5, 4))
    tx = optax.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2))
    state = tx.init(params)
    before = jnntile.runtime.stats()["codelets"].get("clip_by_norm", {}).get("tasks", 0)
    _, grads = jnntile.value_and_grad(mlp_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    jnntile.runtime.wait_all()
    codelets = jnntile.runtime.stats()["codelets"]
    assert codelets.get("clip_by_norm", {}).get("tasks", 0) == before
    assert codelets["adamw"]["tasks"] > 0
