"""Beyond RAM: memory limits with disk swap, invalidation of dead tiles, the planner.

* Training under a limit of tens of MB with swap gives bitwise the losses and
  parameters of an unlimited run, and the swap counters count real writes.
* Activations, their gradients and consumed parameter gradients are
  invalidated; reading them raises a clear error unless activations are kept.
* The planner's verdicts; a task larger than the limit is refused by the
  planner and caught by the watchdog instead of hanging.
* The swap directory is removed at exit, after an error, and after a crash.
"""

import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import train_steps

import jnntile
from jnntile import flags, memory, planning
from jnntile.training import optim
from jnntile import train as train_mod
from jnntile.core.ledger import LEDGER
from jnntile.models import gpt2
from jnntile.models.gpt2.config import GPT2Config
from jnntile.ops import values
from jnntile.ops import elementwise as ew
from jnntile.ops import gemm
from jnntile.ops import loss as loss_ops

B, T = 2, 32
# 2.7M parameters: 42 MB of parameters, gradients and AdamW state, 2.6x a 16 MB limit.
SWAP_CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=4096, n_positions=T, tile_batch=1,
                         tile_seq=16, tile_embd=128, tile_heads=2, tile_hidden=256, tile_vocab=1024)


def _train(config, steps, seed=0):
    return train_steps(config, steps, B, T, seed)


def _restart(**settings):
    jnntile.runtime.stop()
    jnntile.release_traced()
    jnntile.runtime.start(**settings)


def _io():
    with open("/proc/self/io") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f}


@pytest.mark.parametrize("backend", sorted(jnntile.runtime.SWAP_BACKENDS))
def test_small_limit_with_swap_matches_unlimited_run(tmp_path, restore_runtime, backend):
    _restart(memory_limit_mb=1024, swap_dir=None)
    losses, params = _train(SWAP_CONFIG, steps=3)

    plan = planning.plan(planning.StepSpec(SWAP_CONFIG, B, T))
    assert plan.state > 2.5 * 16 * 2**20
    assert plan.verdict(planning.Limits(16, 64)).startswith("needs")
    _restart(memory_limit_mb=16, swap_dir=str(tmp_path), swap_size_mb=64, watchdog_s=60, swap_backend=backend)
    io_before = _io()
    limited_losses, limited_params = _train(SWAP_CONFIG, steps=3)
    jnntile.runtime.wait_all()
    io_after = _io()
    stats = jnntile.runtime.stats()

    np.testing.assert_array_equal(limited_losses, losses)
    for name in params:
        np.testing.assert_array_equal(limited_params[name], params[name], err_msg=name)
    ram = [n for n in stats["nodes"] if n["kind"] == "RAM"][0]
    assert ram["total_bytes"] == 16 * 2**20 and ram["peak_used_bytes"] <= 16 * 2**20
    written, read = stats["bytes_moved"]["RAM->DISK"], stats["bytes_moved"]["DISK->RAM"]
    assert written > 3 * plan.parameters, "the state did not go through the swap"
    # The bus counters count what the backend really wrote and read.
    assert abs((io_after["wchar"] - io_before["wchar"]) - written) < 0.05 * written
    assert abs((io_after["rchar"] - io_before["rchar"]) - read) < 0.05 * read
    if backend == "unistd_o_direct":  # no page cache: every byte read back comes from the device
        assert io_after["read_bytes"] - io_before["read_bytes"] >= read


# ---- invalidation ----------------------------------------------------------------------------

def _mlp(params, x):
    return gemm.matmul(ew.gelu_tanh(gemm.matmul(x, params["w1"])), params["w2"])


def _mlp_problem(rng):
    params = {"w1": jnntile.from_array(rng.standard_normal((6, 8)).astype(np.float32), (3, 4)),
              "w2": jnntile.from_array(rng.standard_normal((8, 4)).astype(np.float32), (4, 2))}
    return params, jnntile.from_array(rng.standard_normal((5, 6)).astype(np.float32), (5, 3))


def _loss_with_output(params, x):
    y = _mlp(params, x)
    return jnp.sum(jnntile.to_array(y) ** 2), y


def test_activation_read_after_backward_raises_clearly(rng):
    params, x = _mlp_problem(rng)
    (_, y), grads = jnntile.value_and_grad(_loss_with_output, has_aux=True)(params, x)
    assert LEDGER.invalidated(y.handle) and LEDGER.invalidated(y.handle.grad)
    with pytest.raises(ValueError, match="invalidated.*keep_activations=True"):
        y.numpy()
    with pytest.raises(ValueError, match="invalidated"):
        jnntile.grad_of(y).numpy()
    with pytest.raises(ValueError, match="invalidated"):
        ew.relu(y)  # refused at trace time, before anything is submitted
    # Parameter gradients stay until an optimizer consumes them.
    assert np.isfinite(jnntile.grad_of(grads["w1"]).numpy()).all()
    # Writing makes the tensor valid again.
    np.testing.assert_array_equal(values.fill(y, 2.0).numpy(), np.full(y.shape, 2.0, np.float32))


def test_activation_read_after_jitted_backward_raises_clearly(rng):
    params, x = _mlp_problem(rng)
    step = jax.jit(jnntile.value_and_grad(_loss_with_output, has_aux=True))
    (_, y), _ = step(params, x)
    with pytest.raises(ValueError, match="invalidated"):
        y.numpy()

    def read_after_backward(params, x):
        (_, y), _ = jnntile.value_and_grad(_loss_with_output, has_aux=True)(params, x)
        return jnntile.to_array(y)

    with pytest.raises(ValueError, match="invalidated"):
        jax.jit(read_after_backward)(params, x)


def test_keep_activations_keeps_them(rng):
    params, x = _mlp_problem(rng)
    (value, y), _ = jax.jit(jnntile.value_and_grad(_loss_with_output, has_aux=True, keep_activations=True))(
        params, x)
    np.testing.assert_allclose(np.sum(y.numpy() ** 2), value, rtol=1e-5)
    assert np.isfinite(jnntile.grad_of(y).numpy()).all()


def test_outputs_read_inside_the_function_are_ordered_before_invalidation(rng):
    """The invalidation waits for reads whose results are arrays (aux outputs, the loss)."""
    params, x = _mlp_problem(rng)

    def loss(params, x):
        y = _mlp(params, x)
        values = jnntile.to_array(y)
        return jnp.sum(values ** 2), values

    expected = np.asarray(_mlp(params, x).numpy())
    for _ in range(3):
        (_, values), _ = jax.jit(jnntile.value_and_grad(loss, has_aux=True))(params, x)
        np.testing.assert_array_equal(values, expected)


def test_optimizer_consumes_gradients(rng):
    params, x = _mlp_problem(rng)
    tx = optim.adamw(1e-2)
    state = tx.init(params)
    _, grads = jnntile.value_and_grad(lambda p, x: _loss_with_output(p, x)[0])(params, x)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    with pytest.raises(ValueError, match="invalidated"):
        jnntile.grad_of(grads["w1"]).numpy()
    _, grads = jnntile.value_and_grad(lambda p, x: _loss_with_output(p, x)[0])(params, x)  # valid again
    assert np.isfinite(jnntile.grad_of(grads["w1"]).numpy()).all()


def test_reading_a_tensor_nothing_wrote_raises_clearly():
    from jnntile.core import tensor as tensor_mod

    handle = tensor_mod.new_handle((4, 4), "float32", (2, 2))
    with pytest.raises(ValueError, match="before anything wrote it"):
        jnntile.Tensor(jnp.zeros(()), handle).numpy()


def test_gradient_of_unused_argument_is_zero(rng):
    params, x = _mlp_problem(rng)
    params["unused"] = jnntile.from_array(np.ones((3, 3), np.float32))
    _, grads = jax.jit(jnntile.value_and_grad(lambda p, x: _loss_with_output(p, x)[0]))(params, x)
    np.testing.assert_array_equal(jnntile.grad_of(grads["unused"]).numpy(), np.zeros((3, 3), np.float32))


# ---- planner -----------------------------------------------------------------------------------

TINY = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=2048, n_positions=64, tile_batch=1, tile_seq=32,
                  tile_embd=64, tile_heads=2, tile_hidden=256, tile_vocab=512)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_counts_what_a_traced_step_creates(restore_runtime, dtype):
    """The planner's activations are exactly the tensors a jitted step of jnntile/models/gpt2/model.py creates,
    in bytes of their dtypes (bfloat16: the activations and weight copies; the parameters stay float32)."""
    from jnntile.core import tensor as tensor_mod

    _restart(memory_limit_mb=1024, swap_dir=None)
    config = dataclasses.replace(TINY, dtype=dtype)
    plan = planning.plan(planning.StepSpec(config, 2, 64))
    model = gpt2.GPT2(config, batch_size=2, seq_len=64)
    assert plan.n_params == TINY.n_params() and plan.parameters == 4 * plan.n_params
    created = []
    original = tensor_mod.new_handle

    def spy(shape, dtype, tile_shape):
        created.append(original(shape, dtype, tile_shape))
        return created[-1]

    tensor_mod.new_handle = spy
    try:
        ids = jnp.zeros((2, 64), jnp.int32)
        fn = jax.jit(lambda m, i: jnntile.nn.value_and_grad(
            lambda m, i: m(m.token_tensor(i), m.token_tensor(i))[1])(m, i)[0])
        fn.lower(model, ids)
    finally:
        tensor_mod.new_handle = original
    assert sum(np.prod(h.shape) * np.dtype(h.dtype).itemsize for h in created) == plan.activations + plan.inputs
    assert {h.dtype for h in created} >= {dtype}
    # bfloat16: the weights' compute copies are kept between steps, not created by the step
    assert (plan.compute_copies > 0) == (dtype == "bfloat16") and plan.compute_copies < plan.parameters / 2


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no-clip"])
def test_planner_peak_against_the_measured_peak(restore_runtime, clip):
    """StarPU's peak (a fresh runtime, no limit) is the planner's live data plus its allocation cache and scratch.

    The plan keeps every gradient until the update after the backward. With a clip (the training command's
    default) that is what runs: each update waits for the global norm, which reads every gradient. Without one,
    a gradient tile final early in the backward may be updated, and freed, before the backward ends, as the
    schedule allows: the plan is then an upper bound (measured 0.94-0.99 of it with StarPU 1.4, once AdamW's
    loop vectorised and ran three times faster)."""
    from jnntile.training import step as step_mod

    _restart(memory_limit_mb=1024, swap_dir=None)
    model = gpt2.GPT2(SWAP_CONFIG, batch_size=B, seq_len=T)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)) if clip else optim.adamw(1e-2)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)
    train_step, _ = step_mod.make_steps(graphdef, tx)
    jnntile.runtime.wait_all()
    jnntile.runtime.reset_peaks()
    rng = np.random.default_rng(0)
    for _ in range(2):
        ids = rng.integers(0, SWAP_CONFIG.vocab_size, (1, B, T)).astype(np.int32)
        params, opt_state, loss = train_step(params, opt_state, ids, ids, [None])
    float(loss)
    jnntile.runtime.wait_all()
    measured = [n for n in jnntile.runtime.stats()["nodes"] if n["kind"] == "RAM"][0]["peak_used_bytes"]
    plan = planning.plan(planning.StepSpec(SWAP_CONFIG, B, T))
    assert measured <= 1.3 * plan.peak, (plan.peak, measured)
    # The plan counts a gradient whole when its op's backward starts; the runtime allocates it tile by tile as
    # the tasks that write it run, while the tiles of dead tensors go: with a clip the peak may fall short of the
    # plan by the tiles in flight, at most a task's (measured: 0.2% short, within the largest task's 2 MB).
    if clip:
        assert plan.peak - plan.largest_task <= measured, (plan.peak, measured)


def test_planner_peak_with_micro_batches_against_the_measured_peak(restore_runtime):
    """Gradients held between micro-batches are in the plan of a micro-batch (activations are one micro-batch's).
    With a clip, as above: no update frees a gradient before the last micro-batch's backward ends."""

    from jnntile.training import step as step_mod

    _restart(memory_limit_mb=1024, swap_dir=None)
    model = gpt2.GPT2(SWAP_CONFIG, batch_size=B, seq_len=T)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)
    train_step, _ = step_mod.make_steps(graphdef, tx, grad_accum_steps=2)
    jnntile.runtime.wait_all()
    jnntile.runtime.reset_peaks()
    ids = np.random.default_rng(0).integers(0, SWAP_CONFIG.vocab_size, (2, B, T)).astype(np.int32)
    for _ in range(2):
        params, opt_state, loss = train_step(params, opt_state, ids, ids, [None, None])
    float(loss)
    jnntile.runtime.wait_all()
    measured = [n for n in jnntile.runtime.stats()["nodes"] if n["kind"] == "RAM"][0]["peak_used_bytes"]
    planned = planning.plan(planning.StepSpec(SWAP_CONFIG, B, T, grad_accum_steps=2))
    assert planned.peak > planning.plan(planning.StepSpec(SWAP_CONFIG, B, T)).peak
    # The plan counts a gradient whole when its op's backward starts; the runtime allocates it tile by tile as
    # the tasks that write it run (no zero-fill runs ahead of them), while the tiles of dead tensors go: the
    # peak may fall short of the plan by the tiles in flight, at most a task's.
    assert planned.peak - planned.largest_task <= measured <= 1.3 * planned.peak, (planned.peak, measured)


class _SpiralMLP(nnx.Module):
    """Notebook 02's custom model: features -> hidden -> hidden -> classes, GELU between, `tile` rows per tile."""

    def __init__(self, features: int, hidden: int, classes: int, *, tile: int):
        self.tile = tile
        self.fc1 = jnntile.nn.Linear((features,), (hidden,), in_tiles=(features,), out_tiles=(tile,), seed=0, name="fc1")
        self.fc2 = jnntile.nn.Linear((hidden,), (hidden,), in_tiles=(tile,), out_tiles=(tile,), seed=0, name="fc2")
        self.out = jnntile.nn.Linear((hidden,), (classes,), in_tiles=(tile,), out_tiles=(classes,), seed=0,
                                      name="out")

    def loss(self, x, y):
        xt, yt = jnntile.from_array(x, (self.tile, 1, x.shape[-1])), jnntile.from_array(y, (self.tile, 1))
        h = ew.gelu_tanh(self.fc2(ew.gelu_tanh(self.fc1(xt))))
        return loss_ops.cross_entropy(self.out(h), yt)


def test_planner_traces_any_model_built_from_jnntile_modules(restore_runtime):
    """A model the planner knows nothing about, planned by recording its own forward, against StarPU's peak."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 1, 64)).astype(np.float32)
    y = rng.integers(0, 16, (2048, 1)).astype(np.int32)
    build = lambda: _SpiralMLP(64, 512, 16, tile=256)  # noqa: E731
    plan = planning.plan_model(build, lambda m: m.loss(x, y), workers=1)
    assert plan.n_params == 64 * 512 + 512 + 512 * 512 + 512 + 512 * 16 + 16
    assert plan.largest_task_name == "adamw update of a fc2.weight tile (256, 256)"
    recorded = planning.record_step(build, lambda m: m.loss(x, y))
    assert [op.name.split()[0] for op in recorded.ops] == ["linear", "unary"] * 2 + ["linear", "cross_entropy"]
    assert [t.kind for t in recorded.inputs] == ["input", "input"]  # x and y, written from the host

    # One worker runs the tasks in the order they were submitted, the order the plan replays: with two, the
    # peak moved with the schedule (0.80-0.86 of the plan over six runs with OpenBLAS, StarPU 1.3 and 1.4; one
    # CI run fell below the bound), with one it is 0.86-0.87.
    _restart(memory_limit_mb=1024, swap_dir=None, workers=1)
    graphdef, params = nnx.split(build(), nnx.Param)
    tx = optim.adamw(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jnntile.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jnntile.runtime.wait_all()
    jnntile.runtime.reset_peaks()
    for _ in range(2):
        params, opt_state, loss = step(params, opt_state)
    float(loss)
    jnntile.runtime.wait_all()
    measured = [n for n in jnntile.runtime.stats()["nodes"] if n["kind"] == "RAM"][0]["peak_used_bytes"]
    # The plan counts each gradient whole from the start of its op's backward. The runtime allocates a
    # gradient's tiles only as the tasks that write them run (no zero-fill runs ahead of them), so on this MLP,
    # whose 4 MB activations dwarf its state, its peak is 13% below the plan (measured 25.3-25.6 against 29.4
    # MB): the plan errs on the side that refuses, not on the one that runs out.
    assert 0.8 * plan.peak <= measured <= 1.3 * plan.peak, (plan.peak, measured)


def test_planner_verdicts():
    plan = planning.plan(planning.StepSpec(TINY, 2, 64), workers=2)
    peak_mb = plan.peak / 2**20
    assert plan.verdict(planning.Limits(peak_mb + 1)) == "fits in RAM"
    assert plan.check(planning.Limits(peak_mb + 1)) == "fits in RAM"
    need = plan.swap_needed_mb(peak_mb / 2)
    assert need >= 16 and plan.verdict(planning.Limits(peak_mb / 2)) == f"needs {need} MB of swap"
    assert plan.verdict(planning.Limits(peak_mb / 2, need)) == f"needs {need} MB of swap"
    with pytest.raises(planning.MemoryPlanError, match="cannot run without swap.*--swap-size-mb"):
        plan.check(planning.Limits(peak_mb / 2))
    with pytest.raises(planning.MemoryPlanError, match="raise --swap-size-mb"):
        plan.check(planning.Limits(peak_mb / 2, need - 1))
    task_mb = plan.largest_task / 2**20
    verdict = plan.verdict(planning.Limits(1.5 * task_mb, 4096))  # one task fits, two at once do not
    assert verdict.startswith("cannot run: a single task") and "2 workers" in verdict
    with pytest.raises(planning.MemoryPlanError, match="use smaller tiles, e.g. --tile-"):
        plan.check(planning.Limits(0.5 * task_mb, 4096))


def test_planner_swap_traffic_follows_the_limit_recomputation_and_clipping():
    plan = planning.plan(planning.StepSpec(TINY, 2, 64), workers=2)
    recomputed = planning.plan(planning.StepSpec(dataclasses.replace(TINY, remat="block"), 2, 64), workers=2)
    peak_mb = plan.peak / 2**20
    assert plan.swap_traffic(peak_mb * 1.01) == (0, 0)
    totals = [sum(plan.swap_traffic(peak_mb * fraction)) for fraction in (0.75, 0.5, 0.25)]
    assert 0 < totals[0] < totals[1] < totals[2]
    for limit_mb in (peak_mb * 0.75, peak_mb * 0.5):  # recomputation keeps fewer activations
        assert sum(recomputed.swap_traffic(limit_mb)) < sum(plan.swap_traffic(limit_mb))
    # An update fused into the backward frees each gradient in RAM: when most of the state swaps, fewer bytes
    # move than when the update follows the backward (after a norm that reads them all).
    state_bound = planning.plan(planning.StepSpec(dataclasses.replace(TINY, remat="block"), 1, 32), workers=2)
    limit_mb = state_bound.peak / 2**20 * 0.3
    after = sum(state_bound.swap_traffic(limit_mb))
    fused = sum(state_bound.swap_traffic(limit_mb, clip=False, update="fused"))
    speculative = sum(state_bound.swap_traffic(limit_mb, update="speculative"))
    assert fused < after and speculative < after, (fused, speculative, after)


def test_planner_suggestion_makes_the_task_fit():
    config = dataclasses.replace(TINY, vocab_size=32768, tile_vocab=32768, tile_embd=128)
    plan = planning.plan(planning.StepSpec(config, 2, 64), workers=2)
    limit = 20
    assert plan.largest_task > limit * 2**20
    hint = plan.suggest_tiles(limit)
    assert "--tile-vocab" in hint
    flags = dict(zip(hint.split()[::2], map(int, hint.split()[1::2])))
    smaller = dataclasses.replace(config, **{f.removeprefix("--").replace("-", "_"): v for f, v in flags.items()})
    verdict = planning.plan(planning.StepSpec(smaller, 2, 64), workers=2).verdict(planning.Limits(limit, 4096))
    assert not verdict.startswith("cannot run")


AUTO = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=4096, n_positions=64)  # automatic tiles


@pytest.mark.parametrize("gpu", [False, True], ids=["RAM", "GPU"])
def test_automatic_tiles_shrink_until_every_task_fits(gpu):
    """Only automatic tiles shrink; RAM holds one task per worker, the GPU two per CUDA worker."""
    # The cross-entropy backward on a (4 x 64, 4096) logits tile and its gradient: 8 MB.
    task_mb = planning.plan(planning.StepSpec(AUTO, 4, 64), workers=2).largest_task / 2**20
    limits = planning.Limits(4096, gpu_mb=task_mb, workers=2) if gpu else planning.Limits(task_mb, workers=2)
    spec, note = planning.fit_tiles(planning.StepSpec(AUTO, 4, 64), limits)
    assert spec.config.tile_vocab == 1024 and note.startswith("automatic tiles shrunk (vocab 4096 -> 1024)")
    assert ("GPU memory limit" in note) == gpu
    swapping = dataclasses.replace(limits, swap_mb=4096)
    assert not planning.plan(spec, workers=2).verdict(swapping).startswith("cannot")
    assert planning.fit_tiles(spec, limits) == (spec, "")  # fitted tiles fit as they are
    # A tile given explicitly stays; another axis shrinks instead, or, with none left, the step is refused.
    spec, note = planning.fit_tiles(planning.StepSpec(dataclasses.replace(AUTO, tile_vocab=4096), 4, 64), limits)
    assert (spec.config.tile_vocab, spec.config.tile_embd, spec.config.tile_seq) == (4096, 64, 32)
    assert "embd 128 -> 64, seq 64 -> 32" in note
    explicit = planning.StepSpec(dataclasses.replace(AUTO, tile_vocab=4096, tile_embd=128), 4, 64)
    assert planning.fit_tiles(explicit, limits) == (explicit, "")
    with pytest.raises(planning.MemoryPlanError, match="cannot run: a single task.*e.g. --tile-vocab 1024"):
        planning.plan(explicit, workers=2).check(swapping)


def test_memory_cli_says_which_tiles_it_chose(capsys):
    # CPU workers only (--cuda-workers 0): on a GPU machine the plan would put the step in the GPU's memory.
    tiny = ["--model", "tiny", "--vocab-size", "4096", "--batch-size", "4", "--seq-len", "64", "--memory-limit-mb",
            "8", "--swap-size-mb", "64", "--workers", "2", "--cuda-workers", "0"]
    assert memory.main(tiny + ["--remat", "none"]) == 0
    out = capsys.readouterr().out
    assert "automatic tiles shrunk (vocab 4096 -> 1024)" in out and "tiles batch=4 seq=64 embd=128" in out
    assert "vocab=1024" in out and "needs 29 MB of swap" in out and "page cache" not in out
    # Under a memory limit recomputation is chosen by default where it lowers the peak: less swap.
    assert memory.main(tiny) == 0
    out = capsys.readouterr().out
    assert "--remat auto: block, all 2 blocks recomputed" in out and "needs 24 MB of swap" in out
    # Traffic below a GB in MB, not "0.0 GB ... instead of 0.0 GB"; amounts that print alike are not compared.
    assert re.search(r"swap traffic per step predicted [\d.]+ MB instead of [\d.]+ MB", out) and " GB" not in out
    assert planning.search._instead(5 * 2**20, 5 * 2**20 + 1000) == "5.0 MB, about as much as without"
    assert memory.main(tiny + ["--swap-backend", "unistd", "--remat", "none"]) == 0
    assert "swap backend unistd: the kernel's page cache may also hold up to 29 MB" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--batch-size", "0"], ["--seq-len", "0"], ["--memory-limit-mb", "0"],
                                 ["--workers", "0"], ["--grad-clip", "nan"],
                                 ["--model", "llama-tiny", "--n-embd", "66", "--n-head", "4"],
                                 ["--model", "llama-tiny", "--dropout", "0.1"]])
def test_planner_refuses_what_training_refuses_with_the_same_message(bad, dataset, tmp_path, capsys):
    assert memory.main(bad) == 2
    planned = capsys.readouterr().err
    assert train_mod.main(["--data", str(dataset), "--out", str(tmp_path), "--seq-len", "16", "--eval-interval",
                           "0", "--quiet", *bad]) == 2
    assert planned == capsys.readouterr().err and re.match(r"error: --[a-z]", planned), planned


def test_memory_cli_plans_one_micro_batch(capsys):
    assert memory.main(["--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--memory-limit-mb", "1024",
                        "--grad-accum-steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "batch 2 x seq 64 per micro-batch, 4 micro-batches per step" in out and "kept between micro-batches" in out


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_packed_batch_plans_as_a_full_one(preset, capsys):
    """A packed batch of examples adds its layout, two int32 (B, T) tensors, to the step: the planner, and
    `python -m jnntile.memory --packing on|off`, plan the step without it (docs/memory.md)."""
    from jnntile.models import families

    config = families.preset(preset)
    B, T = 4, 64
    ids = np.zeros((B, T), np.int32)
    segments = np.repeat(np.arange(1, 5, dtype=np.int32), T // 4)[None].repeat(B, 0)
    positions = np.tile(np.arange(T // 4, dtype=np.int32), 4)[None].repeat(B, 0)
    build = lambda: families.build(config, batch_size=B, seq_len=T)  # noqa: E731

    def loss(model, packed):
        packing = model.packing_tensors(segments, positions) if packed else None
        return model(model.token_tensor(ids), model.token_tensor(ids), packing=packing)

    full, packed = (planning.plan_model(build, lambda m: loss(m, p)).peak for p in (False, True))
    assert 0 <= packed - full <= 2 * B * T * 4 * 2 and packed - full < 1e-3 * full
    argv = ["--model", preset, "--batch-size", str(B), "--seq-len", str(T)]
    assert memory.main(argv) == 0
    planned = capsys.readouterr().out
    assert memory.main([*argv, "--packing", "off", "--no-truncate"]) == 0
    assert capsys.readouterr().out == planned


def test_planner_gpu_verdicts():
    """With a GPU, its memory comes first, then host RAM, then swap; a task must fit the GPU twice over."""
    plan = planning.plan(planning.StepSpec(TINY, 2, 64), workers=2)
    peak_mb = plan.peak / 2**20
    ram_mb = 4 * peak_mb
    assert plan.verdict(planning.Limits(ram_mb, gpu_mb=peak_mb + 1)) == "fits on the GPU"
    host_mb = math.ceil(plan.peak / 2**20 - peak_mb / 2)
    assert plan.verdict(planning.Limits(ram_mb, gpu_mb=peak_mb / 2)) == f"fits on the GPU and {host_mb} MB of host RAM"
    need = plan.swap_needed_mb(host_mb / 2, gpu_mb=peak_mb / 2)
    assert need == max(16, math.ceil(1.1 * plan.host_bytes(peak_mb / 2) / 2**20)), "swap holds what the GPU cannot"
    assert plan.verdict(planning.Limits(host_mb / 2, need, gpu_mb=peak_mb / 2)) == f"needs {need} MB of swap"
    task_mb = plan.largest_task / 2**20
    with pytest.raises(planning.MemoryPlanError, match="GPU memory limit.*--gpu-memory-limit-mb"):
        plan.check(planning.Limits(ram_mb, gpu_mb=1.5 * task_mb))


def test_a_deeper_cuda_pipeline_or_more_workers_per_gpu_hold_more_tasks_on_it(monkeypatch):
    """StarPU's CUDA pipeline (2 tasks) on each CUDA worker of a GPU: what the GPU must hold follows both."""
    for name in ("STARPU_CUDA_PIPELINE", "STARPU_NWORKER_PER_CUDA"):
        monkeypatch.delenv(name, raising=False)
    plan = planning.plan(planning.StepSpec(TINY, 2, 64), workers=2)
    task_mb = plan.largest_task / 2**20
    assert jnntile.runtime.gpu_tasks_in_flight() == 2 and plan.task_fit_problem(1024, 2.5 * task_mb) is None
    for name, value in (("STARPU_CUDA_PIPELINE", "4"), ("STARPU_NWORKER_PER_CUDA", "2")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert jnntile.runtime.gpu_tasks_in_flight() == 4
            assert "a GPU holds 4 tasks' tiles at once" in plan.task_fit_problem(1024, 2.5 * task_mb)
            assert plan.task_bytes_target(1024, 2.5 * task_mb) == 2.5 * task_mb * 2**20 / 4
    with monkeypatch.context() as env:
        env.setenv("STARPU_CUDA_PIPELINE", "0")  # StarPU runs a task at a time: one task's tiles
        assert jnntile.runtime.gpu_tasks_in_flight() == 1


def test_cpu_kernels_beside_a_limited_gpu_need_ram_for_the_whole_peak_without_swap():
    """Under a GPU memory limit CPU workers run kernels too, and what they write stays in RAM: without swap RAM
    must hold the whole peak, however much the GPU could (tests/test_emulated_gpu.py runs the refused case)."""
    plan = planning.plan(planning.StepSpec(TINY, 2, 64), workers=2)
    peak_mb = plan.peak / 2**20
    assert plan.verdict(planning.Limits(peak_mb / 2, gpu_mb=peak_mb + 1)) == "fits on the GPU"
    with pytest.raises(planning.MemoryPlanError, match=r"CPU workers run kernels too.*give --swap-dir, raise "
                       rf"--memory-limit-mb to {math.ceil(peak_mb)}, or leave GPU memory unlimited"):
        plan.check(planning.Limits(peak_mb / 2, gpu_mb=peak_mb + 1, cpu_kernels=True))
    assert plan.check(planning.Limits(peak_mb + 1, gpu_mb=peak_mb + 1, cpu_kernels=True)) == "fits on the GPU"
    assert plan.check(planning.Limits(peak_mb / 2, 64, gpu_mb=peak_mb + 1, cpu_kernels=True)) == "fits on the GPU"
    no_gpu = planning.Limits(peak_mb / 2)
    assert plan.verdict(dataclasses.replace(no_gpu, cpu_kernels=True)) == plan.verdict(no_gpu)  # the usual verdict


def test_memory_cli_plans_the_tiles_of_the_workers_its_flags_give(capsys, monkeypatch):
    """Automatic tiles follow the flags, not the runtime's current configuration: GPU tiles where a GPU will
    hold the step, CPU tiles with --cuda-workers 0 on a machine with a GPU."""
    monkeypatch.setattr(jnntile.runtime, "gpu_memory_mb", lambda config=None: 80000)  # as on an H100
    gpt2_vocab = ["--model", "tiny", "--vocab-size", "50257", "--batch-size", "2", "--seq-len", "64",
                  "--memory-limit-mb", "4096", "--remat", "none"]
    assert memory.main(gpt2_vocab) == 0
    assert "vocab=16384" in capsys.readouterr().out  # 3 x 16384 + 1105 (tests/test_gpt2.py)
    assert memory.main(gpt2_vocab + ["--cuda-workers", "0"]) == 0
    assert "vocab=7180" in capsys.readouterr().out  # 7 even tiles


def test_memory_cli_plans_for_a_gpu_without_one(capsys, monkeypatch):
    assert memory.main(["--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--gpu-memory-limit-mb",
                        "4096", "--memory-limit-mb", "1024"]) == 0
    assert "GPU memory 4096 MB" in capsys.readouterr().out
    # A GPU limit resolves placement "auto" (the commands' placement; the suite's is "cpu") to "any": CPU
    # workers' results then need RAM for the whole peak.
    suite_config = jnntile.runtime.config()
    monkeypatch.setattr(jnntile.runtime, "config", lambda: dataclasses.replace(suite_config, placement="auto"))
    assert memory.main(["--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--gpu-memory-limit-mb",
                        "4096", "--memory-limit-mb", "4"]) == 1
    assert "cannot run: under a GPU memory limit CPU workers run kernels too" in capsys.readouterr().out


def test_runtime_settings_from_flags():
    import argparse

    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    args = parser.parse_args(["--memory-limit-mb", "64", "--swap-dir", "/tmp/s", "--workers", "1"])
    assert flags.runtime_settings(args) == {"memory_limit_mb": 64, "swap_dir": "/tmp/s", "workers": 1}
    assert flags.limits(args, what_if=True) == planning.Limits.of(flags.runtime_config(args)) == planning.Limits(
        64, jnntile.runtime.config().swap_size_mb, jnntile.runtime.gpu_memory_mb(),
        jnntile.runtime.cpu_kernels_beside_gpu(flags.runtime_config(args)), 1)
    args = parser.parse_args(["--memory-limit-mb", "64", "--swap-size-mb", "100"])
    assert flags.runtime_settings(args) == {"memory_limit_mb": 64}
    assert (flags.limits(args).swap_mb, flags.limits(args, what_if=True).swap_mb) == (0, 100)  # what-if: planned with
    assert flags.limits(args, what_if=True).memory_limit_mb == 64
    args = parser.parse_args(["--swap-dir", "/tmp/s", "--swap-backend", "unistd_o_direct"])
    assert flags.runtime_settings(args) == {"swap_dir": "/tmp/s", "swap_backend": "unistd_o_direct"}


def test_planner_command_line(capsys):
    assert memory.main(["--model", "gpt2", "--batch-size", "4", "--seq-len", "512", "--memory-limit-mb", "1024",
                        "--swap-size-mb", "65536", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "needs" in out and "MB of swap" in out
    assert memory.main(["--model", "tiny", "--tile-vocab", "50257", "--tile-embd", "128",
                        "--memory-limit-mb", "64", "--workers", "2"]) == 1
    assert "cannot run: a single task" in capsys.readouterr().out


# ---- no hangs, and the swap directory is cleaned up -------------------------------------------

def _run(script, **kwargs):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.mark.parametrize("swap", [False, True], ids=["no swap", "swap"])
def test_task_larger_than_the_limit_is_refused_then_caught_by_the_watchdog(tmp_path, swap):
    # The AdamW update of a (2048, 128) tile of wte needs 4 MB (parameter, gradient
    # and two moments) under a 2 MB limit: swap cannot help either. With swap the
    # update is speculative (--fused-update auto): 7 MB, the next values written apart.
    swap_settings = f", swap_dir={str(tmp_path)!r}, swap_size_mb=64" if swap else ""
    script = f"""
        import argparse, numpy as np, jnntile
        from flax import nnx
        from jnntile import flags, memory, planning
        from jnntile.training import optim
        from jnntile.models import gpt2, loss_and_grads
        parser = argparse.ArgumentParser()
        memory.add_arguments(parser)
        args = parser.parse_args("--model tiny --n-layer 1 --n-embd 128 --n-head 2 --vocab-size 2048 --n-positions 32 "
                                 "--batch-size 1 --seq-len 32 --tile-vocab 2048 --tile-embd 128 --memory-limit-mb 2 "
                                 "--workers 2 --remat none --cuda-workers 0"
                                 .split() + ({swap!r} and ["--swap-dir", {str(tmp_path)!r}] or []))
        try:
            memory.plan_from_args(args).check(flags.limits(args, what_if=True))
        except planning.MemoryPlanError as e:
            print("PLANNER:", e, flush=True)
        # Run anyway, as if the planner had missed it.
        jnntile.runtime.start(memory_limit_mb=2, watchdog_s=3, cuda_workers=0{swap_settings})
        model = gpt2.GPT2(memory.config_from_args(args), batch_size=1, seq_len=32)
        ids = np.zeros((1, 32), np.int32)
        _, grads = loss_and_grads(model, ids, ids)
        params = nnx.state(model, nnx.Param)
        tx = optim.adamw(1e-3)
        tx.update(grads, tx.init(params), params)
        jnntile.runtime.wait_all()
    """
    started = time.perf_counter()
    result = _run(script)
    task_mb = 7.0 if swap else 4.0
    assert f"PLANNER: cannot run: a single task (adamw update of a wte.weight tile (2048, 128)) needs {task_mb} MB" \
        in result.stdout, result.stdout + result.stderr
    assert result.returncode != 0
    assert "no StarPU task completed" in result.stderr and "memory limit 2 MB" in result.stderr
    assert "python -m jnntile.memory" in result.stderr
    assert time.perf_counter() - started < 90
    assert not [p for p in os.listdir(tmp_path) if p.startswith("jnntile-swap-")]


@pytest.mark.parametrize("ending", ["exit", "error"])
def test_swap_dir_is_removed_at_exit_and_after_an_error(tmp_path, ending):
    script = f"""
        import os, numpy as np, jnntile
        from jnntile.ops import gemm
        jnntile.runtime.start(memory_limit_mb=2, swap_dir={str(tmp_path)!r}, swap_size_mb=32, cuda_workers=0)
        a = jnntile.random_normal((1024, 1024), seed=1, tile_shape=256)
        b = gemm.matmul(a, a)  # 8 MB of tiles under a 2 MB limit
        b.numpy()
        assert jnntile.runtime.stats()["bytes_moved"]["RAM->DISK"] > 0
        print("SWAP DIRS", os.listdir({str(tmp_path)!r}))
        if {ending!r} == "error":
            raise RuntimeError("boom")
    """
    result = _run(script)
    assert "SWAP DIRS ['jnntile-swap-" in result.stdout, result.stderr
    assert (result.returncode != 0) == (ending == "error")
    if ending == "error":
        assert "boom" in result.stderr
    assert os.listdir(tmp_path) == []


def test_direct_io_swap_takes_tiles_of_any_size(tmp_path):
    """O_DIRECT moves whole pages only: tiles of 28,000 bytes and a scalar still go to disk and back."""
    script = f"""
        import numpy as np, jnntile
        from jnntile.ops import elementwise as ew
        jnntile.runtime.start(memory_limit_mb=2, swap_dir={str(tmp_path)!r}, swap_size_mb=32,
                              swap_backend="unistd_o_direct", watchdog_s=60)
        rng = np.random.default_rng(0)
        arrays = [rng.standard_normal((1500, 700)).astype(np.float32) for _ in range(2)]  # 8.4 MB
        a, b = (jnntile.from_array(x, (100, 70)) for x in arrays)
        total = ew.add(a, b)
        scalar = jnntile.full((), 3.0)
        np.testing.assert_array_equal(total.numpy(), arrays[0] + arrays[1])
        np.testing.assert_array_equal(a.numpy(), arrays[0])
        assert scalar.numpy() == 3.0
        moved = jnntile.runtime.stats()["bytes_moved"]
        assert moved["RAM->DISK"] > 4 * 2**20 and moved["DISK->RAM"] > 2**20, moved
        print("OK")
    """
    result = _run(script)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-2000:]


def test_swap_dir_of_a_killed_process_is_removed_by_the_next_one(tmp_path):
    start = f"""
        import os, jnntile
        jnntile.runtime.start(memory_limit_mb=64, swap_dir={str(tmp_path)!r}, swap_size_mb=32)
        print("SWAP DIRS", os.listdir({str(tmp_path)!r}), flush=True)
    """
    result = _run(start + "    os.kill(os.getpid(), 9)\n")
    assert result.returncode == -signal.SIGKILL and "SWAP DIRS ['jnntile-swap-" in result.stdout
    assert len(os.listdir(tmp_path)) == 1  # left behind by the killed process
    result = _run(start)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("jnntile-swap-") == 1  # only its own
    assert os.listdir(tmp_path) == []


def test_beyond_ram_benchmark_runs_in_quick_mode(tmp_path):
    """bench/beyond_ram.py --quick measures every step of issue 13's benchmark on a tiny model (no speed asserted)."""
    import json
    from pathlib import Path

    script = Path(__file__).parents[1] / "bench" / "beyond_ram.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--json", "--swap-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        row = json.loads(line)
        rows.setdefault(row.pop("measurement"), []).append(row)
    assert not any("error" in row for measured in rows.values() for row in measured)
    assert rows["disk"][0]["write_mb_per_s"] > 0 and rows["disk"][0]["read_mb_per_s"] > 0
    assert [s["step"] for s in rows["xl_train_step"]] == [1, 2]
    assert all(s["written_mb"] > 0 and s["read_mb"] > 0 and s["io_floor_s"] > 0 for s in rows["xl_train_step"])
    assert rows["xl_checkpoint_save"][0]["mb_per_s"] > 0
    assert rows["xl_generate"][0]["new_tokens"] == 16 and rows["xl_generate"][0]["tokens_per_s"] > 0
    assert rows["large_limited"][0]["written_mb_per_step"] > 0 and rows["large_unlimited"][0]["written_mb_per_step"] == 0
    assert rows["large_ratio"][0]["ratio"] > 0 and rows["large_ratio"][0]["losses_identical"]
    assert "limited / unlimited" in result.stderr  # the table
    assert os.listdir(tmp_path) == []  # swap, checkpoint and outputs removed


def _frozen_projections(quantize_base):
    """(bytes of the frozen projection weights in the traced step, the plan's frozen bytes) of LoRA on a bfloat16
    Llama of hidden size 128 (one tile per axis) whose base is quantized as `quantize_base`."""
    from jnntile.models import resolve_tiles
    from jnntile.models.llama.config import LlamaConfig
    from jnntile.training import lora

    config = dataclasses.replace(LlamaConfig(hidden_size=128, num_attention_heads=2, intermediate_size=128),
                                 dtype="bfloat16", tile_embd=128, tile_hidden=128)
    finetune = lora.FineTune(lora=lora.LoRASettings(2, 4.0), quantize_base=quantize_base)
    spec = planning.StepSpec(config, 2, 16, finetune=finetune)
    step = planning.record.trace_step(config, 2, 16, resolve_tiles(config, 2, 16), spec.finetune)
    plan = planning.plan(spec, workers=2)
    return sum(t.nbytes for t in step.frozen if "proj" in t.name), plan.frozen_parameters


@pytest.mark.parametrize("kind, ratio", [("nf4", 4), ("int8", 2)])
def test_a_quantized_base_plans_its_frozen_weights_at_their_quantized_bytes(kind, ratio):
    plain, plain_total = _frozen_projections(None)
    quantized, total = _frozen_projections(kind)
    assert plain / quantized == pytest.approx(ratio, rel=0.12)  # the scales add 1/32 (nf4), 4/C (int8)
    assert plain_total - total == plain - quantized  # the plan counts them so


def test_double_quantization_plans_about_0_37_fewer_bits_per_frozen_weight():
    plain, _ = _frozen_projections(None)
    nf4, nf4_total = _frozen_projections("nf4")
    double, double_total = _frozen_projections("nf4_dq")
    weights = plain // 2  # bfloat16
    # 32 bits per 64 weights become 8, plus a block absmax per 256 scales and a mean per tile: 0.5 - 0.125 - 0.004
    assert (nf4 - double) * 8 / weights == pytest.approx(0.371, abs=0.002)
    assert nf4_total - double_total == nf4 - double


def test_a_bfloat16_lora_base_plans_its_embedding_tables_and_head_in_bfloat16():
    from jnntile.models import resolve_tiles
    from jnntile.models.llama.config import LlamaConfig
    from jnntile.training import lora

    config = dataclasses.replace(LlamaConfig(hidden_size=128, num_attention_heads=2, intermediate_size=128),
                                 dtype="bfloat16", tile_embd=128, tile_hidden=128)
    assert not config.tie_word_embeddings  # a head of its own
    spec = planning.StepSpec(config, 2, 16, finetune=lora.FineTune(lora=lora.LoRASettings(2, 4.0)))
    step = planning.record.trace_step(config, 2, 16, resolve_tiles(config, 2, 16), spec.finetune)
    frozen = {t.name: t.nbytes for t in step.frozen}
    assert frozen["embed_tokens.weight"] == frozen["lm_head.weight"] == 2 * config.vocab_size * config.hidden_size
    assert not [name for name in step.copies if "embed_tokens" in name or "lm_head" in name]  # read as stored
    assert planning.plan(spec, workers=2).frozen_parameters == sum(frozen.values())


# A GPT-2 of 0.5M parameters in small tiles, so the tiles split evenly across 2 and 4 ranks.
SHARDED = ["--vocab-size", "512", "--n-layer", "2", "--seq-len", "32", "--tile-embd", "32", "--tile-hidden", "128",
           "--tile-vocab", "128", "--workers", "1"]


def _planned(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    return memory.plan_from_args(parser.parse_args([*SHARDED, *argv]))


@pytest.fixture
def fetch_per_op(monkeypatch):
    """Plans ranks that fetch parameters for each op that reads them: under these tests' default limit they
    would keep them (planning.search.choose_keep_fetched, tested on its own below)."""
    monkeypatch.setattr(planning.search, "choose_keep_fetched", lambda spec, limits: (spec, ""))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_with_sharded_state_plans_its_share_of_the_state(ranks, dtype, fetch_per_op):
    whole = _planned("--dtype", dtype)
    rank = _planned("--dtype", dtype, "--ranks", str(ranks), "--shard-state")
    assert rank.n_params == whole.n_params and rank.shards == ranks
    for kind in ("parameters", "gradients", "optimizer_state", "compute_copies"):
        assert getattr(rank, kind) == pytest.approx(getattr(whole, kind) / ranks, rel=0.02), kind
    assert rank.batch_size == whole.batch_size // ranks  # its rows
    # Beside its shard and rows: the other ranks' tiles of the parameters of the op in flight and the next.
    assert 0 < rank.fetched < whole.parameters / 4
    assert rank.peak < whole.peak
    # With micro-batches, every rank keeps every parameter's partial gradient until the last one.
    accumulating = _planned("--dtype", dtype, "--ranks", str(ranks), "--shard-state", "--grad-accum-steps", "2")
    assert accumulating.gradients == whole.gradients
    assert accumulating.peak > rank.peak


@pytest.mark.parametrize("ranks", [2, 4])
def test_memory_cli_prints_the_bytes_a_rank_sends_and_receives(ranks, capsys, fetch_per_op):
    assert memory.main([*SHARDED, "--ranks", str(ranks), "--shard-state"]) == 0
    out = capsys.readouterr().out
    sent, received = map(float, re.search(r"per step this rank sends ([\d.]+) MB and receives ([\d.]+) MB", out)
                         .groups())
    plan = _planned("--ranks", str(ranks), "--shard-state")
    parameters, embedding = plan.n_params * 4, 512 * 128 * 4
    # Each op fetches the parameters it reads in the forward and the backward, (N-1)/N of 2 x their bytes, and the
    # gradients go up to their owners, (N-1)/N of their bytes: 3 (N-1)/N of the parameters' bytes; GPT-2's tied
    # embedding is read by two ops (the embedding and the head), fetched twice more.
    expected = (ranks - 1) / ranks * (3 * parameters + 2 * embedding) / planning.MB
    assert sent == pytest.approx(expected, abs=0.06) and received == pytest.approx(expected, abs=0.06)
    assert "this rank's 1/%d" % ranks in out and "parameters fetched (peak)" in out


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_ranks_keep_what_they_fetch_when_the_plan_fits(ranks, capsys):
    """Where memory allows (the default limit), a rank keeps the parameters it fetches until they are written:
    every parameter read, and every partial gradient (unpaced, a rank ahead may hold them all), beside its
    shard; each parameter then travels once a step, as in data parallel. Under a limit that cannot hold them,
    it fetches for each op."""
    kept, per_op = _planned("--ranks", str(ranks), "--shard-state"), _planned("--ranks", str(ranks), "--shard-state",
                                                                                "--memory-limit-mb", "5")
    assert kept.keep_fetched and not per_op.keep_fetched
    parameters = kept.n_params * 4
    assert kept.fetched == pytest.approx(2 * (ranks - 1) / ranks * parameters, rel=0.02)  # parameters and gradients
    assert kept.peak - per_op.peak == pytest.approx(kept.fetched - per_op.fetched, rel=0.05)
    assert memory.main([*SHARDED, "--ranks", str(ranks), "--shard-state"]) == 0
    out = capsys.readouterr().out
    assert "parameters kept" in out and "the parameters a rank fetches are kept until written" in out
    sent = float(re.search(r"per step this rank sends ([\d.]+) MB", out).group(1))
    assert sent == pytest.approx((ranks - 1) / ranks * 2 * parameters / planning.MB, abs=0.06)


def test_sharded_state_on_one_rank_is_refused_naming_why(capsys):
    assert memory.main([*SHARDED, "--shard-state"]) == 2
    assert capsys.readouterr().err == ("error: --shard-state shards the training state across ranks, and --ranks is 1: "
                                       "give --ranks N, the ranks mpirun starts, or leave --shard-state out\n")
