"""Gradient accumulation: micro-batches add their scaled gradients into the same tiles.

* `jnntile.value_and_grad(..., accumulate=grads, scale=s)` adds s * the
  gradient to the earlier gradients, in place, under jit; bad uses are refused.
* N micro-batches of B rows through `jnntile.step.make_steps` give the losses
  and parameters of one step on the N*B batch, with clipping and AdamW, also
  under a small memory limit with disk swap, and when their targets (not -100)
  are unevenly many: the loss is the mean over the whole batch's targets.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trained_params_close, mlp_loss, mlp_params, mlp_problem, mlp_reference_loss, rel_err
from flax import nnx

import jnntile
from jnntile.training import optim
from jnntile.training import step as step_mod
from jnntile.models import gpt2
from jnntile.models.gpt2.config import GPT2Config


def test_accumulated_gradients_are_the_scaled_sum_under_jit(rng):
    arrays, xs = mlp_problem(rng, batches=3)
    params = mlp_params(arrays)

    @jax.jit
    def first(params, x):
        return jnntile.value_and_grad(mlp_loss, scale=1 / 3)(params, jnntile.from_array(x, (5, 4)))

    @jax.jit
    def more(params, grads, x):
        return jnntile.value_and_grad(mlp_loss, accumulate=grads, scale=1 / 3)(params, jnntile.from_array(x, (5, 4)))

    value, grads = first(params, xs[0])
    values = [value]
    for x in xs[1:]:
        value, grads = more(params, grads, x)
        values.append(value)
    assert more._cache_size() == 1
    ref_values = [mlp_reference_loss(arrays, x) for x in xs]
    ref_grads = jax.grad(lambda p: sum(mlp_reference_loss(p, x) for x in xs) / 3)(arrays)
    assert rel_err(values, ref_values) < 1e-5, "values come back unscaled"
    for name in arrays:
        assert grads[name].id == params[name].id
        assert rel_err(jnntile.grad_of(grads[name]).numpy(), ref_grads[name]) < 1e-5, name


def test_an_argument_unused_in_a_micro_batch_keeps_its_sum(rng):
    arrays, xs = mlp_problem(rng, batches=3)
    params = mlp_params(arrays)
    params["bias"] = jnntile.from_array(np.ones((3,), np.float32))

    def loss(params, x, use_bias):
        value = mlp_loss(params, x)
        return value + jnp.sum(jnntile.to_array(params["bias"])) if use_bias else value

    step = jax.jit(lambda p, x: jnntile.value_and_grad(lambda p: loss(p, x, True))(p))
    more = jax.jit(lambda p, g, x: jnntile.value_and_grad(lambda p: loss(p, x, False), accumulate=g)(p))
    _, grads = step(params, jnntile.from_array(xs[0], (5, 4)))
    _, grads = more(params, grads, jnntile.from_array(xs[1], (5, 4)))
    np.testing.assert_array_equal(jnntile.grad_of(grads["bias"]).numpy(), np.ones(3, np.float32))


def test_accumulating_into_consumed_or_foreign_gradients_is_refused(rng):
    arrays, xs = mlp_problem(rng, batches=3)
    params = mlp_params(arrays)
    x = jnntile.from_array(xs[0], (5, 4))
    _, grads = jnntile.value_and_grad(mlp_loss)(params, x)
    with pytest.raises(ValueError, match="accumulate: expected the gradient of"):
        jnntile.value_and_grad(mlp_loss, accumulate={"w1": grads["w2"], "w2": grads["w1"]})(params, x)
    with pytest.raises(ValueError, match="do not match"):
        jnntile.value_and_grad(mlp_loss, accumulate={"w1": grads["w1"]})(params, x)
    tx = optim.sgd(0.1)
    updates, _ = tx.update(grads, tx.init(params), params)
    params = optax.apply_updates(params, updates)
    with pytest.raises(ValueError, match="holds nothing.*consumed by a jnntile.optim update.*accumulate before"):
        jnntile.value_and_grad(mlp_loss, accumulate=grads)(params, x)


# ---- GPT-2 through jnntile.step.make_steps ------------------------------------------------

CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=512, n_positions=32, tile_batch=1, tile_seq=16,
                    tile_embd=32, tile_heads=2, tile_hidden=128, tile_vocab=256)
B, T, N, STEPS = 2, 32, 3, 3
LEARNING_RATE = 1e-2


def _train(micro_batches, config=CONFIG, masked=False):
    """Losses and parameters after STEPS steps of N*B rows, cut into `micro_batches` micro-batches; `masked`:
    most targets are ignored (-100), the more the later the row, so the micro-batches' target counts differ."""
    rows = np.random.default_rng(0).integers(0, config.vocab_size, (STEPS, N * B, T + 1)).astype(np.int32)
    if masked:  # row r keeps its first T >> r targets: 32, 16, 8, ... 1
        kept = np.arange(T)[None, :] < (T >> np.arange(N * B))[:, None]
        rows[:, :, 1:] = np.where(kept, rows[:, :, 1:], -100)
    model = gpt2.GPT2(config, batch_size=N * B // micro_batches, seq_len=T, seed=0)
    tx = optax.chain(optim.clip_by_global_norm(1.0), optim.adamw(LEARNING_RATE, weight_decay=0.1))
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)
    # "auto": the clipped update runs after the backward without swap; with swap it speculates in the last
    # backward, and after a step that clipped runs after the backward again (its program traced then).
    train_step, _ = step_mod.make_steps(graphdef, tx, micro_batches, "auto")
    losses = []
    for step_rows in rows:
        idx, targets = (a.reshape(micro_batches, -1, T) for a in (step_rows[:, :-1], step_rows[:, 1:]))
        params, opt_state, loss = train_step(params, opt_state, idx, targets, [None] * micro_batches)
        losses.append(float(loss))
    model = nnx.merge(graphdef, params)
    return np.array(losses), {name: p.get_value().numpy() for name, p in model.named_params().items()}


def _assert_close(params, expected):
    # Within 1e-5; the key biases (zero gradient in exact arithmetic) to AdamW's bound of lr per step.
    assert_trained_params_close(params, expected, STEPS, LEARNING_RATE, 1e-5)


@pytest.fixture(scope="module")
def one_big_batch():
    return _train(1)


def test_micro_batches_equal_one_big_batch(one_big_batch):
    losses, params = _train(N)
    assert rel_err(losses, one_big_batch[0]) < 1e-6
    _assert_close(params, one_big_batch[1])


def test_micro_batches_with_uneven_targets_equal_one_big_batch():
    # The step's loss is the mean over its targets: each micro-batch weighs by its targets, not 1/N.
    losses, params = _train(N, masked=True)
    big_losses, big_params = _train(1, masked=True)
    assert rel_err(losses, big_losses) < 1e-6
    _assert_close(params, big_params)


@pytest.fixture
def small_limit_with_swap(tmp_path):
    previous = jnntile.runtime.config()
    jnntile.runtime.stop()
    jnntile.release_traced()
    # CPU workers only: on CUDA workers tiles reach the disk only through a GPU limit as well (test_optim.py).
    # Two of them, as on this suite's 2-core CI machine: 15 (a 16-core GPU machine) run 15 optimizer tasks at once,
    # over the 1 MB limit, and the plan says so instead of "needs swap".
    jnntile.runtime.start(memory_limit_mb=1, swap_dir=str(tmp_path), swap_size_mb=64, watchdog_s=60,
                          cuda_workers=0, workers=2)
    yield
    jnntile.runtime.stop()
    jnntile.release_traced()
    jnntile.runtime.configure(**dataclasses.asdict(previous))


def test_micro_batches_under_a_small_limit_with_swap(one_big_batch, small_limit_with_swap, monkeypatch):
    from jnntile import planning

    plan = planning.plan(planning.StepSpec(CONFIG, B, T, grad_accum_steps=N))
    assert plan.peak > 2 * 2**20  # over twice the 1 MB limit
    assert plan.verdict(planning.Limits(1, 64)).startswith("needs")
    clips, clipped = [], optim.clipped

    def recorded(opt_state, norm):  # what "auto" decides the next step's update from
        clips.append(clipped(opt_state, norm))
        return clips[-1]

    monkeypatch.setattr(optim, "clipped", recorded)
    losses, params = _train(N)
    # The speculative first step clipped: the second updated after the backward, in a program traced then,
    # which accumulated into the gradients the earlier micro-batches' compiled program had just computed.
    assert clips[0]
    assert jnntile.runtime.stats()["bytes_moved"]["RAM->DISK"] > plan.state, "the state went through the swap"
    assert rel_err(losses, one_big_batch[0]) < 1e-6
    _assert_close(params, one_big_batch[1])
