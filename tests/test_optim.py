"""jnntile.optim against Optax: same parameters after 10 steps, under jit, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_loss, mlp_params, mlp_problem, mlp_reference_loss, rel_err, tasks_run

import jnntile
from jnntile.training import optim

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=3, decay_steps=10)


def _mlp_training(rng, tx, loss_fn=mlp_loss):
    """The MLP problem on Tensors (w1 (6, 8) in 2 x 3 tiles, w2 (8, 3) in 3 x 2, x in 2 tiles), `tx`'s
    state, and a jitted training step."""
    arrays, (x_np,) = mlp_problem(rng)
    params = mlp_params(arrays)

    @jax.jit
    def step(params, state, x):
        loss, grads = jnntile.value_and_grad(loss_fn)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return arrays, x_np, params, jnntile.from_array(x_np, (5, 4)), tx.init(params), step


def _compare(rng, jnntile_tx, optax_tx, steps=10):
    arrays, x_np, params, x, state, step = _mlp_training(rng, jnntile_tx)

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


def test_small_tiles_share_update_tasks(rng, placement):
    """Tiles under 32768 elements are updated up to 16 to a task, across the parameters of one kind (same weight
    decay, compute copy and clip); large ones alone. The values stay optax's."""
    from jnntile.ops import elementwise as ew

    layouts = {"bias": ((40,), (2,)), "small": ((7, 5), (2, 5)), "big": ((200, 200), (200, 200))}
    arrays = {k: rng.standard_normal(shape).astype(np.float32) for k, (shape, _) in layouts.items()}
    params = {k: jnntile.from_array(arrays[k], tile) for k, (_, tile) in layouts.items()}
    mask = lambda params: {k: len(p.shape) > 1 for k, p in params.items()}  # noqa: E731
    tx = optax.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1, mask=mask))
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1, mask=mask))

    def loss(params):
        return sum(jnp.sum(jnntile.to_array(ew.gelu_tanh(p)) ** 2) for p in params.values())

    def ref_loss(params):
        return sum(jnp.sum(jax.nn.gelu(p, approximate=True) ** 2) for p in params.values())

    @jax.jit
    def step(params, state):
        _, grads = jnntile.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state, ref_params = tx.init(params), jax.tree.map(jnp.asarray, arrays)
    ref_state = ref_tx.init(ref_params)
    for i in range(3):
        before = tasks_run()
        params, state = jax.block_until_ready(step(params, state))  # its tasks submitted
        # AdamW: the bias's 20 tiles (no decay) in 16 + 4; small's 4 tiles in one task, big alone (decay).
        # The global norm's partial sums: the 24 small tiles in 16 + 8, big alone. On the GPU big is small too
        # (under 4M elements, task.h): it joins small's task, and the norm's 25 tiles take 16 + 9.
        expected = (3, 2) if placement == "cuda" else (4, 3)
        after = tasks_run()
        assert (after["adamw"] - before["adamw"], after["sumsq_partial"] - before["sumsq_partial"]) == expected
        ref_grads = jax.grad(ref_loss)(ref_params)
        ref_updates, ref_state = ref_tx.update(ref_grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
        for name in arrays:
            assert rel_err(params[name].numpy(), ref_params[name]) < 1e-5, f"{name} after step {i}"


def one_adamw_step_of_a_square(array, tile_shape):
    """One AdamW step on w = array in tiles of tile_shape, loss sum(w^2), checked against optax's; returns the
    AdamW tasks it ran."""
    params = {"w": jnntile.from_array(array, tile_shape)}
    tx, ref_tx = optim.adamw(1e-2), optax.adamw(1e-2)

    @jax.jit
    def step(params, state):
        _, grads = jnntile.value_and_grad(lambda p: jnp.sum(jnntile.to_array(p["w"]) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    before = tasks_run()["adamw"]
    params, _ = jax.block_until_ready(step(params, tx.init(params)))
    ref_params = {"w": jnp.asarray(array)}
    ref_updates, _ = ref_tx.update(jax.grad(lambda p: jnp.sum(p["w"] ** 2))(ref_params), ref_tx.init(ref_params),
                                   ref_params)
    assert rel_err(params["w"].numpy(), optax.apply_updates(ref_params, ref_updates)["w"]) < 1e-6
    return tasks_run()["adamw"] - before


def test_small_tiles_share_update_tasks_within_a_memory_limit(rng, restore_runtime, tmp_path):
    """Under a memory limit, a task of small tiles holds at most a share of it: the tasks running at once fit in
    half the limit together (1 MB, 2 workers: 256 KB each). A task holds each buffer it has fetched until it
    ends, and two workers' AdamW tasks that each filled half a 1 MB limit once waited for each other forever."""
    jnntile.runtime.stop()
    # No CUDA worker (in either half of the module's placement): each would count for a pipeline of two tasks in
    # the share (task_group_bytes_limit).
    jnntile.runtime.start(workers=2, memory_limit_mb=1, swap_dir=str(tmp_path), swap_size_mb=64, watchdog_s=60,
                          cuda_workers=0, placement="cpu")
    # 8 tiles of 4096 elements (16 KB), each update holding 64 KB (parameter, gradient, two moments): 4 tiles
    # to a task, not all 8 (the 32768 elements of a task without a limit).
    assert one_adamw_step_of_a_square(rng.standard_normal((512, 64)).astype(np.float32), (64, 64)) == 2


def test_the_gpu_takes_larger_tiles_to_an_update_task(rng, placement):
    """Tiles of 65536 elements each take a task of their own on CPU workers and share one on the GPU, where a
    task costs the CUDA worker about as much as an update of 4M elements (task.h, small_tile_numel)."""
    tasks = one_adamw_step_of_a_square(rng.standard_normal((8 * 256, 256)).astype(np.float32), (256, 256))
    assert tasks == (1 if placement == "cuda" else 8)


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
    before = tasks_run()["clip_by_norm"]
    _, grads = jnntile.value_and_grad(mlp_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    after = tasks_run()
    assert after["clip_by_norm"] == before
    assert after["adamw"] > 0



def _bfloat16_mlp_loss(params, x):
    """mlp_loss computed in bfloat16 on the weights' compute copies (a model with dtype="bfloat16")."""
    from jnntile.ops import values as values_ops
    from jnntile.ops import elementwise as ew
    from jnntile.ops import gemm

    def copy(w):
        return values_ops.compute_copy(w, "bfloat16")

    h = ew.gelu_tanh(gemm.matmul(jnntile.convert(x, "bfloat16"), copy(params["w1"])))
    return jnp.sum(jnntile.to_array(jnntile.convert(gemm.matmul(h, copy(params["w2"])), "float32")) ** 2)


@pytest.mark.parametrize("tx", [optim.adamw(1e-2), optim.sgd(1e-2)], ids=["adamw", "sgd"])
def test_an_update_writes_the_compute_copy_and_the_next_forward_converts_nothing(rng, tx):
    """The task that updates a master writes its bfloat16 compute copy (the master rounded to nearest even, as
    ml_dtypes rounds it); the next forward finds every copy tile fresh and submits no convert task for the
    weights; a write of a master from the host (a load, a restore) makes its copy stale, and the next forward
    converts it again."""
    import ml_dtypes
    import numpy as np

    from jnntile.io import tensorfile

    arrays, _, params, x, state, step = _mlp_training(rng, tx, _bfloat16_mlp_loss)

    def converts_in_a_step():
        nonlocal params, state
        before = tasks_run()["convert"]
        params, state, loss = step(params, state, x)
        for name, w in params.items():
            np.testing.assert_array_equal(jnntile.Tensor(w.token, w.handle.copy).numpy(),
                                          w.numpy().astype(ml_dtypes.bfloat16), err_msg=name)
        return tasks_run()["convert"] - before

    # Every step converts x, the output and the operands the bfloat16 products widen; the weights' copies
    # (6 tiles each) only at the first step and after the load.
    first, every_step = converts_in_a_step(), converts_in_a_step()
    assert first == every_step + 6 + 6
    assert converts_in_a_step() == every_step
    params["w1"] = tensorfile.load_into(params["w1"], arrays["w1"])
    assert converts_in_a_step() == every_step + 6
    assert converts_in_a_step() == every_step


# ---- the update fused into the backward (jnntile.optim.FusedUpdate) --------------------------------------
#
# jnntile.step.make_steps with an optax.chain of jnntile's updates each parameter inside the backward, as soon as
# its gradient is final (after the backward of every op that read it; a recomputed block counts as one).
# Without a clip that is the same update, earlier. With one it is speculative (written apart, unclipped) and
# committed once the norm is known; when the norm clips, the clipped step is rebuilt from the moments before
# and after the speculative one, which is how the update after the backward computes a clipped step too, and
# the norm is summed from the same per-tile partial sums in the same order: the same bits in every case.

FUSED_STEPS, FUSED_LR = 3, 1e-2
FUSED_CLIPS = {"no-clip": None, "clips": 0.05, "does-not-clip": 1e6}


def _fused_config(**changes):
    """A GPT-2 with its first two blocks recomputed (the third, the embeddings and the head are not)."""
    from jnntile.models.gpt2.config import GPT2Config

    return GPT2Config(n_layer=3, n_head=4, n_embd=32, vocab_size=96, n_positions=16, dropout=0.1, tile_batch=1,
                      tile_seq=8, tile_embd=16, tile_heads=2, tile_hidden=48, tile_vocab=40, remat="block",
                      remat_blocks=2, **changes)


def _train_gpt2(fuse, max_norm, optimizer="adamw", micro_batches=1, config=None, fused_update=None,
                chain=optim.chain):
    """Losses, parameters (by name) and update tasks by codelet of FUSED_STEPS steps through make_steps, with
    `chain` (transformations -> optimizer) of an optional clip and `optimizer`."""
    from flax import nnx

    from jnntile.models import families
    from jnntile.training.step import make_steps

    config = config or _fused_config()
    batch = 2
    model = families.build(config, batch_size=batch // micro_batches, seq_len=16, seed=3)
    graphdef, params = nnx.split(model, nnx.Param)
    main = optim.adamw(FUSED_LR, weight_decay=0.1) if optimizer == "adamw" else optim.sgd(0.1)
    tx = chain(optim.clip_by_global_norm(max_norm), main) if max_norm else chain(main)
    opt_state = tx.init(params)
    train_step, _ = make_steps(graphdef, tx, micro_batches, fused_update or ("on" if fuse else "off"))
    rng = np.random.default_rng(0)
    before = tasks_run()
    losses = []
    for step in range(FUSED_STEPS):
        idx, targets = (rng.integers(0, config.vocab_size, (micro_batches, batch // micro_batches, 16)).astype(np.int32)
                        for _ in range(2))
        seeds = [np.int32(100 * step + k) for k in range(micro_batches)]
        params, opt_state, loss = train_step(params, opt_state, idx, targets, seeds)
        losses.append(float(loss))
    tasks = tasks_run() - before
    nnx.update(model, params)
    named = {name: p.get_value() for name, p in model.named_params().items()}
    copies = {name: jnntile.Tensor(p.token, p.handle.copy).numpy() for name, p in named.items()
              if p.handle.copy is not None}
    return np.array(losses), {name: p.numpy() for name, p in named.items()}, tasks, copies


def _param_tiles(config) -> int:
    """Tiles of the model's parameters: the backward hands every one over to the fused update."""
    import math

    from jnntile.models import families

    model = families.build(config, batch_size=2, seq_len=16, seed=3)
    return sum(math.prod(p.get_value().grid) for p in model.named_params().values())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("clip", list(FUSED_CLIPS), ids=list(FUSED_CLIPS))
def test_the_update_fused_into_the_backward_equals_the_update_after_it(optimizer, clip):
    max_norm = FUSED_CLIPS[clip]
    losses, params, tasks, _ = _train_gpt2(False, max_norm, optimizer)
    fused_losses, fused_params, fused_tasks, _ = _train_gpt2(True, max_norm, optimizer)
    block_tiles = _param_tiles(_fused_config())
    apart = fused_tasks.get(f"{optimizer}_apart", 0)
    rescaled = fused_tasks.get(f"{optimizer}_rescale", 0)
    assert tasks.get(f"{optimizer}_apart", 0) == 0
    assert apart == (FUSED_STEPS * block_tiles if max_norm else 0)
    assert rescaled == (apart if clip == "clips" else 0)
    # Speculative: every parameter was handed over and written apart, none updated in place.
    assert (fused_tasks.get(optimizer, 0) > 0) == (max_norm is None)
    np.testing.assert_array_equal(fused_losses, losses)
    for name in params:
        np.testing.assert_array_equal(fused_params[name], params[name], err_msg=name)


def _named_chain(*transformations):
    return optax.named_chain(*((f"t{i}", t) for i, t in enumerate(transformations)))


@pytest.mark.parametrize("chain", [optax.chain, _named_chain], ids=["optax.chain", "optax.named_chain"])
def test_a_plain_optax_chain_fuses_as_jnntile_optim_chain_does(chain):
    """The chain's state says what it does: Optax's own chains of jnntile's clip and adamw fuse (the updates
    are written apart in the backward) and give the bits of jnntile.optim.chain's update after the backward."""
    losses, params, _, _ = _train_gpt2(False, 0.05)
    fused_losses, fused_params, tasks, _ = _train_gpt2(True, 0.05, chain=chain)
    assert tasks.get("adamw_apart", 0) == FUSED_STEPS * _param_tiles(_fused_config())
    np.testing.assert_array_equal(fused_losses, losses)
    for name in params:
        np.testing.assert_array_equal(fused_params[name], params[name], err_msg=name)


def _llama_config():
    from jnntile.models import families

    return families.preset("llama-tiny", num_hidden_layers=3, vocab_size=96, tile_seq=8, tile_embd=32, tile_heads=1,
                           tile_hidden=64, tile_vocab=48, remat="block")


@pytest.mark.parametrize("case", ["bfloat16", "micro-batches", "llama"])
def test_the_fused_update_that_clips_in_bfloat16_with_micro_batches_and_on_llama(case):
    """The clipped commit exchanges the compute copies with the masters: each copy is its master rounded."""
    import ml_dtypes

    config = {"bfloat16": _fused_config(dtype="bfloat16"), "llama": _llama_config()}.get(case, _fused_config())
    micro_batches = 2 if case == "micro-batches" else 1
    losses, params, _, _ = _train_gpt2(False, 0.05, micro_batches=micro_batches, config=config)
    fused_losses, fused_params, tasks, copies = _train_gpt2(True, 0.05, micro_batches=micro_batches, config=config)
    assert tasks["adamw_rescale"] == FUSED_STEPS * _param_tiles(config)
    np.testing.assert_array_equal(fused_losses, losses)
    for name in params:
        np.testing.assert_array_equal(fused_params[name], params[name], err_msg=name)
    assert bool(copies) == (case == "bfloat16")
    for name, copy in copies.items():
        np.testing.assert_array_equal(copy, fused_params[name].astype(ml_dtypes.bfloat16), err_msg=name)


@pytest.mark.parametrize("clip", ["clips", "does-not-clip"])
def test_the_fused_update_under_a_small_memory_limit_with_swap(clip, placement, tmp_path, restore_runtime):
    """Shadows, exchanged tiles and the commit's invalidations through StarPU's eviction to disk."""
    from jnntile.core import runtime

    losses, params, _, _ = _train_gpt2(False, FUSED_CLIPS[clip])
    runtime.stop()
    jnntile.release_traced()
    # The CPU half without CUDA workers. On CUDA workers tiles reach the disk only through a GPU limit as well, so
    # the CUDA half limits GPU memory, RAM and disk together (docs/design.md).
    limits = dict(gpu_memory_limit_mb=1) if placement == "cuda" else dict(cuda_workers=0)
    runtime.start(memory_limit_mb=1, swap_dir=str(tmp_path), swap_size_mb=64, watchdog_s=60, **limits)
    fused_losses, fused_params, tasks, _ = _train_gpt2(True, FUSED_CLIPS[clip])
    assert runtime.stats()["bytes_moved"]["RAM->DISK"] > 0
    assert tasks["adamw_apart"] == FUSED_STEPS * _param_tiles(_fused_config())
    np.testing.assert_array_equal(fused_losses, losses)
    for name in params:
        np.testing.assert_array_equal(fused_params[name], params[name], err_msg=name)


def test_only_a_chain_of_jnntile_transformations_fuses_and_auto_speculates_only_with_swap():
    params = {"w": jnntile.zeros((4,))}
    clipped = optax.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)).init(params)
    assert optim.fused_update(clipped, params).mode == "speculative"
    assert optim.fused_update(optim.chain(optim.adamw(1e-2)).init(params), params, "auto").mode == "fused"
    # auto: a clipped update is speculative only with disk swap (this runtime has none)
    assert optim.fused_update(clipped, params, "auto").mode == "after"
    for foreign in ([optax.clip_by_global_norm(1.0), optim.adamw(1e-2)],  # Optax's clip
                    [optim.adamw(1e-2), optim.clip_by_global_norm(1.0)],  # clipped after the update
                    [optim.clip_by_global_norm(1.0), optim.clip_by_global_norm(1.0), optim.adamw(1e-2)]):
        assert optim.fused_update(optax.chain(*foreign).init(params), params) is None
    assert optim.fused_update(optim.adamw(1e-2).init(params), params) is None  # not a chain
    assert [optim.update_mode(clip, setting, swap=True) for clip in (True, False) for setting in ("auto", "off")] == [
        "speculative", "after", "fused", "after"]


def test_auto_does_not_speculate_right_after_a_step_that_clipped(tmp_path, restore_runtime):
    """With disk swap and a clip, "auto" speculates unless the last step's norm clipped; "on" always does."""
    from jnntile.core import runtime

    runtime.stop()
    jnntile.release_traced()
    runtime.start(swap_dir=str(tmp_path), swap_size_mb=64)
    _, _, tasks, _ = _train_gpt2(True, 0.05, fused_update="auto")  # clips every step: only the first speculates
    assert tasks["adamw_rescale"] == tasks["adamw_apart"] == _param_tiles(_fused_config())
    _, _, tasks, _ = _train_gpt2(True, 1e6, fused_update="auto")  # never clips: every step speculates
    assert (tasks["adamw_apart"], tasks.get("adamw_rescale", 0)) == (FUSED_STEPS * _param_tiles(_fused_config()), 0)
    params = {"w": jnntile.zeros((4,))}
    state = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)).init(params)
    assert optim.speculates(state, "auto") and optim.speculates(state, "on") and not optim.speculates(state, "off")
    assert not optim.speculates(optim.chain(optim.adamw(1e-2)).init(params), "on")
    assert optim.clipped(state, jnntile.from_array(np.float32(2.0))) is True
    assert optim.clipped(state, jnntile.from_array(np.float32(0.5))) is False
