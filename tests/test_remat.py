"""Activation recomputation (`remat="block"`, `jnntile.remat`): the same numbers, less memory.

A transformer block that keeps only its input recomputes its forward in the backward with the same
kernels on the same inputs (dropout masks from the same counter-based seeds), so the loss and every
gradient equal those without recomputation bit for bit; between the forward and the backward only the
blocks' inputs live, so the peak of StarPU's memory is lower.
"""

import dataclasses

import jax
import numpy as np
import pytest

import jnntile
from jnntile import nn, planning
from jnntile.models import families, gpt2
from jnntile.models.gpt2.config import GPT2Config

pytestmark = pytest.mark.usefixtures("placement")

B, T = 2, 16
GPT2_CONFIG = GPT2Config(n_layer=3, n_head=4, n_embd=32, vocab_size=96, n_positions=T, dropout=0.1, tile_batch=1,
                         tile_seq=8, tile_embd=16, tile_heads=2, tile_hidden=48, tile_vocab=40)
LLAMA_CONFIG = families.preset("llama-tiny", num_hidden_layers=3, vocab_size=96, tile_seq=8, tile_embd=32,
                               tile_heads=1, tile_hidden=64, tile_vocab=48)


def _loss_and_grads(config, idx, targets, jit):
    model = families.build(config, batch_size=B, seq_len=T, seed=3)

    def loss_fn(m, idx, targets):
        seed = np.int32(7) if isinstance(m, gpt2.GPT2) else None
        return m(m.token_tensor(idx), m.token_tensor(targets, allow_ignore=True), dropout_seed=seed)[1]

    fn = nn.value_and_grad(loss_fn)
    loss, grads = (jax.jit(fn) if jit else fn)(model, idx, targets)
    return float(loss), [jnntile.grad_of(g).numpy() for g in nn.tensors(grads)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("config", [GPT2_CONFIG, LLAMA_CONFIG], ids=["gpt2", "llama"])
def test_recomputed_blocks_give_the_same_loss_and_gradients_bit_for_bit(config, jit):
    rng = np.random.default_rng(0)
    idx = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets[0, :3] = -100
    loss, grads = _loss_and_grads(config, idx, targets, jit)
    for blocks in (None, 1):  # every block, or the first one only (as remat="auto" may choose)
        loss_remat, grads_remat = _loss_and_grads(dataclasses.replace(config, remat="block", remat_blocks=blocks),
                                                  idx, targets, jit)
        assert loss_remat == loss
        for g, g_remat in zip(grads, grads_remat):
            np.testing.assert_array_equal(g_remat, g)


def test_recomputation_lowers_the_peak_memory(placement):
    # Activations outweigh the parameters here (6 blocks of 4 x 64 tokens): without recomputation they all
    # live at the end of the forward; with it, the blocks' inputs and one block's activations at a time. A
    # block is recomputed only once its output's gradient is there (else StarPU would run every block's
    # recomputation at once). The peak is the one of the memory the kernels run in (the GPU's on CUDA workers).
    config = dataclasses.replace(GPT2_CONFIG, n_layer=6, n_embd=64, n_positions=64, dropout=0.0, tile_seq=32,
                                 tile_embd=64, tile_heads=4, tile_hidden=256, tile_vocab=96)
    idx = np.random.default_rng(1).integers(0, config.vocab_size, (4, 64)).astype(np.int32)
    peaks = {}
    for remat in ("none", "block"):
        model = families.build(dataclasses.replace(config, remat=remat), batch_size=4, seq_len=64)
        step = jax.jit(nn.value_and_grad(lambda m, idx: m(m.token_tensor(idx), m.token_tensor(idx))[1]))
        jnntile.runtime.wait_all()
        jnntile.runtime.reset_peaks()
        used = _node(placement)["used_bytes"]
        float(step(model, idx)[0])
        jnntile.runtime.wait_all()
        peaks[remat] = _node(placement)["peak_used_bytes"] - used
    assert peaks["block"] < 0.6 * peaks["none"], peaks


def _node(placement: str) -> dict:
    kind = "CUDA" if placement == "cuda" else "RAM"
    return next(node for node in jnntile.runtime.stats()["nodes"] if node["kind"] == kind)


def test_a_bad_remat_is_refused():
    with pytest.raises(ValueError, match="remat='layer': use one of none, block"):
        dataclasses.replace(GPT2_CONFIG, remat="layer")


def test_the_planner_counts_only_the_blocks_inputs_between_forward_and_backward():
    config = dataclasses.replace(GPT2_CONFIG, n_layer=6, n_embd=64, n_positions=64, dropout=0.0)
    plans = {remat: planning.plan(planning.StepSpec(dataclasses.replace(config, remat=remat), 4, 64, optimizer="sgd"))
             for remat in ("none", "block")}
    block_input = 4 * 64 * 64 * 4  # (B, T, C) float32
    # A block makes about a dozen activations of that size or more (its MLP's are 4 times as large): with
    # recomputation only its output stays.
    assert plans["none"].activations - plans["block"].activations > 6 * 10 * block_input
    assert plans["block"].peak < 0.7 * plans["none"].peak


def test_the_training_command_with_remat_block_gives_the_same_losses(dataset, tmp_path):
    from jnntile import train as train_mod

    common = ["--data", str(dataset), "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--batch-size", "2",
              "--seq-len", "32", "--steps", "3", "--eval-interval", "0", "--samples", "0", "--quiet", "--dropout", "0.1"]
    plain = train_mod.train(train_mod.parse_args([*common, "--out", str(tmp_path / "plain")]))
    recomputed = train_mod.train(train_mod.parse_args([*common, "--out", str(tmp_path / "remat"), "--remat", "block"]))
    assert recomputed["losses"] == plain["losses"]


def _remat_chosen(config, memory_limit_mb: float, gpu_mb: float = 0):
    """The config `choose_remat` makes of `config` (batch 4 x 64) under the limits, and its note."""
    limits = planning.Limits(memory_limit_mb, gpu_mb=gpu_mb)
    spec, note = planning.choose_remat(planning.StepSpec(config, 4, 64), limits)
    return spec.config, note


def _plan(config, **fields):
    """The plan of `config` with `fields` (batch 4 x 64), without a GPU."""
    return planning.plan(planning.StepSpec(dataclasses.replace(config, **fields), 4, 64), gpu_mb=0)


def test_auto_recomputes_when_the_step_does_not_fit_the_memory_limit():
    config = dataclasses.replace(GPT2_CONFIG, n_layer=6, n_embd=64, n_positions=64, dropout=0.0, remat="auto")
    plain = _plan(config, remat="none").peak / 2**20
    fits, note = _remat_chosen(config, plain + 1)
    assert fits.remat == "none" and note.startswith("--remat auto: none (the step's planned peak")
    everything = _plan(config, remat="block").peak / 2**20
    tight, note = _remat_chosen(config, everything / 2)
    # Nothing fits: all blocks or none, whichever the planner predicts to swap less; here all.
    traffic = {remat: sum(_plan(config, remat=remat).swap_traffic(everything / 2)) for remat in ("none", "block")}
    assert traffic["block"] < traffic["none"]
    assert (tight.remat, tight.remat_blocks) == ("block", 6)
    assert note.startswith("--remat auto: block, all 6 blocks recomputed in the backward (the step swaps either way")
    # Between the two: the fewest blocks that fit.
    some, note = _remat_chosen(config, (plain + everything) / 2)
    assert some.remat == "block" and 0 < some.remat_blocks < 6
    peak = _plan(some).peak / 2**20
    fewer = _plan(some, remat_blocks=some.remat_blocks - 1).peak / 2**20
    assert peak <= (plain + everything) / 2 < fewer
    with pytest.raises(ValueError, match="remat='auto' is chosen by the memory planner"):
        families.build(config, batch_size=4, seq_len=64)


def test_auto_counts_what_the_gpu_holds():
    """What GPU memory holds needs no RAM: a step that fits the GPU recomputes nothing under a tiny RAM limit,
    and one that does not fit it recomputes only as much as the host part needs."""
    config = dataclasses.replace(GPT2_CONFIG, n_layer=6, n_embd=64, n_positions=64, dropout=0.0, remat="auto")
    plain = _plan(config, remat="none").peak / 2**20
    everything = _plan(config, remat="block").peak / 2**20
    on_gpu, note = _remat_chosen(config, 1, gpu_mb=plain + 1)
    assert on_gpu.remat == "none"
    assert note.startswith(f"--remat auto: none (the step's planned peak beyond the GPU's {plain + 1:.0f} MB, 0 MB")
    # GPU and RAM together hold what recomputing some blocks leaves, not the plain step.
    gpu_mb, ram_mb = (plain + everything) / 4, (plain + everything) / 4
    some, _ = _remat_chosen(config, ram_mb, gpu_mb=gpu_mb)
    alone, _ = _remat_chosen(config, gpu_mb + ram_mb)
    assert (some.remat, some.remat_blocks) == (alone.remat, alone.remat_blocks) and 0 < some.remat_blocks < 6
