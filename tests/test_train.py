"""`python -m jnntile.train`: outputs, checkpoints, bit-identical resume, Ctrl-C, HF interop, bad input."""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from conftest import rel_err

import jnntile
from jnntile import data as data_mod
from jnntile import memory, planning
from jnntile.training import run_dir
from jnntile.training import step as step_mod
from jnntile import train as train_mod
from jnntile.models.families import load_hf

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch-size", "2", "--seq-len", "16",
         "--eval-batches", "1", "--samples", "1", "--sample-tokens", "5", "--quiet"]


def _run(dataset, out, *extra):
    return train_mod.train(train_mod.parse_args(["--data", str(dataset), "--out", str(out), *SMALL, *extra]))


def _losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_training_writes_metrics_curve_checkpoint_and_samples(dataset, tmp_path, capsys):
    summary = _run(dataset, tmp_path, "--steps", "6", "--eval-interval", "3", "--checkpoint-interval", "4")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    for r in rows:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r) and np.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 5]
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] > 0  # warmup from zero
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "latest").read_text() == "ckpt-0000006"
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000004", "ckpt-0000006"]
    state = json.loads((tmp_path / "ckpt-0000006" / "state.json").read_text())
    assert state["step"] == 6 and state["data_position"] == 6 * 2 * 16 and state["rng"]["seed"] == 0
    assert summary["step"] == 6
    assert "--- sample 0 ---" in capsys.readouterr().out


def _ctrl_c_in_step(monkeypatch, step: int, times: int = 1) -> None:
    """Ctrl-C arrives `times` times while step `step` (counted from 0 in this run) runs."""
    make_steps = step_mod.make_steps

    def interrupting_make_steps(graphdef, tx, grad_accum_steps, fused_update):
        train_step, eval_step = make_steps(graphdef, tx, grad_accum_steps, fused_update)
        calls = {"n": 0}

        def run_step(*a):
            calls["n"] += 1
            for _ in range(times if calls["n"] == step + 1 else 0):
                os.kill(os.getpid(), signal.SIGINT)
            return train_step(*a)

        return run_step, eval_step

    monkeypatch.setattr(step_mod, "make_steps", interrupting_make_steps)


def test_resume_after_ctrl_c_is_bit_identical(dataset, tmp_path, monkeypatch, capsys):
    args = ["--steps", "6", "--eval-interval", "0", "--samples", "0", "--dropout", "0.1"]
    _run(dataset, tmp_path / "straight", *args)

    make_steps = step_mod.make_steps
    _ctrl_c_in_step(monkeypatch, 2)
    summary = _run(dataset, tmp_path / "resumed", *args)
    assert summary["interrupted"] and summary["step"] == 3
    assert "continue with --resume" in capsys.readouterr().out
    assert (tmp_path / "resumed" / "latest").read_text() == "ckpt-0000003"
    monkeypatch.setattr(step_mod, "make_steps", make_steps)
    _run(dataset, tmp_path / "resumed", *args, "--resume")
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")


def test_a_second_ctrl_c_while_the_checkpoint_is_written_lets_it_finish(dataset, tmp_path, monkeypatch, capsys):
    _ctrl_c_in_step(monkeypatch, 2)
    save = train_mod.checkpoint.save

    def interrupted_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C again, impatient
        return save(*args, **kwargs)

    monkeypatch.setattr(train_mod.checkpoint, "save", interrupted_save)
    summary = _run(dataset, tmp_path, "--steps", "6", "--eval-interval", "0", "--samples", "0")
    assert summary["interrupted"] and summary["step"] == 3
    assert json.loads((tmp_path / "ckpt-0000003" / "state.json").read_text())["step"] == 3
    assert (tmp_path / "latest").read_text() == "ckpt-0000003"
    captured = capsys.readouterr()
    assert "SIGINT: the checkpoint of step 3 is being written; it is finished first" in captured.err
    assert "checkpoint saved to" in captured.out


def test_a_second_ctrl_c_in_a_step_stops_at_once_naming_the_checkpoint_that_stands(dataset, tmp_path, monkeypatch,
                                                                                    capsys):
    _ctrl_c_in_step(monkeypatch, 3, times=2)
    code = train_mod.main(["--data", str(dataset), "--out", str(tmp_path), *SMALL, "--steps", "6", "--eval-interval",
                           "0", "--samples", "0", "--checkpoint-interval", "2"])
    assert code == 130
    err = capsys.readouterr().err
    assert f"interrupted: step 3 did not finish; {tmp_path}/ckpt-0000002 (step 2) stands; continue from it with " \
           "--resume" in err and "Traceback" not in err


def test_ctrl_c_during_the_set_up_prints_one_line(dataset, tmp_path, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "_load_data", interrupted)
    assert train_mod.main(["--data", str(dataset), "--out", str(tmp_path), *SMALL]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_sgd_without_clipping_and_sequential_data(dataset, tmp_path):
    summary = _run(dataset, tmp_path, "--steps", "3", "--optimizer", "sgd", "--grad-clip", "0", "--eval-interval", "0",
                   "--data-order", "sequential", "--lr", "0.1")
    assert summary["step"] == 3


@pytest.mark.parametrize("order", data_mod.BATCH_ORDERS)
def test_micro_batches_see_the_rows_of_the_whole_batch(dataset, tmp_path, order):
    common = ["--steps", "3", "--eval-interval", "0", "--samples", "0", "--data-order", order]
    _run(dataset, tmp_path / "whole", *common, "--batch-size", "4")
    _run(dataset, tmp_path / "micro", *common, "--batch-size", "2", "--grad-accum-steps", "2")
    assert rel_err(_losses(tmp_path / "micro"), _losses(tmp_path / "whole")) < 1e-6
    state = json.loads((tmp_path / "micro" / "ckpt-0000003" / "state.json").read_text())
    assert state["data_position"] == 3 * 4 * 16
    for row in map(json.loads, (tmp_path / "micro" / "metrics.jsonl").read_text().splitlines()):
        assert row["tokens_per_s"] * row["seconds"] == pytest.approx(4 * 16), "a step's tokens: every micro-batch"
    idx, targets, segments, positions = step_mod.step_batch(data_mod.TokenDataset(dataset), 5, batch_size=2,
                                                            grad_accum_steps=3, seq_len=16, order=order, seed=0)
    assert segments is None and positions is None, "text: no packing, its programs as they were"
    whole = data_mod.TokenDataset(dataset).batch(5, 6, 16, order, seed=0)
    np.testing.assert_array_equal(idx.reshape(6, 16), whole[0])
    np.testing.assert_array_equal(targets.reshape(6, 16), whole[1])


def test_micro_batches_through_each_layer_together_are_one_batch_in_tiles_of_a_micro_batch(dataset, tmp_path, capsys):
    """--grad-accum-schedule layer: the step of one batch of N x B sequences in tiles of B, the same rows; its
    losses near the micro-batch schedule's (another order of summation) and its plan that batch's."""
    common = ["--steps", "3", "--eval-interval", "0", "--samples", "0"]
    _run(dataset, tmp_path / "micro", *common, "--batch-size", "2", "--grad-accum-steps", "2")
    _run(dataset, tmp_path / "layer", *common, "--batch-size", "2", "--grad-accum-steps", "2",
         "--grad-accum-schedule", "layer")
    assert "batch 4 x 16 (2 micro-batches of 2 through each layer together)" in capsys.readouterr().out
    _run(dataset, tmp_path / "whole", *common, "--batch-size", "4", "--tile-batch", "2")
    assert _losses(tmp_path / "layer") == _losses(tmp_path / "whole")
    assert rel_err(_losses(tmp_path / "layer"), _losses(tmp_path / "micro")) < 1e-6
    state = json.loads((tmp_path / "layer" / "ckpt-0000003" / "state.json").read_text())
    assert state["data_position"] == 3 * 4 * 16
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    layer, whole = (memory.plan_from_args(parser.parse_args(["--n-layer", "2", "--seq-len", "16", *batch]))
                    for batch in (["--batch-size", "2", "--grad-accum-steps", "3", "--grad-accum-schedule", "layer"],
                                  ["--batch-size", "6", "--tile-batch", "2"]))
    assert (layer.batch_size, layer.grad_accum_steps, layer.tiles, layer.peak) == (6, 1, whole.tiles, whole.peak)


def test_resume_with_micro_batches_is_bit_identical(dataset, tmp_path):
    common = ["--eval-interval", "0", "--samples", "0", "--grad-accum-steps", "2", "--dropout", "0.1"]
    _run(dataset, tmp_path / "straight", *common, "--steps", "4")
    _run(dataset, tmp_path / "resumed", *common, "--steps", "2")
    _run(dataset, tmp_path / "resumed", *common, "--steps", "4", "--resume")
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")


def test_bfloat16_trains_near_float32_and_resumes_bit_identically(dataset, tmp_path):
    """--dtype bfloat16: float32 masters in the checkpoint, losses near float32's, resume bit for bit."""
    common = ["--eval-interval", "0", "--samples", "0", "--dropout", "0.1", "--lr", "3e-3"]
    _run(dataset, tmp_path / "float32", *common, "--steps", "8")
    _run(dataset, tmp_path / "straight", *common, "--steps", "8", "--dtype", "bfloat16",
         "--export-hf", str(tmp_path / "hf"), "--export-dtype", "bfloat16")
    _run(dataset, tmp_path / "resumed", *common, "--steps", "4", "--dtype", "bfloat16")
    _run(dataset, tmp_path / "resumed", *common, "--steps", "8", "--dtype", "bfloat16", "--resume")
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    bf16, f32 = _losses(tmp_path / "straight"), _losses(tmp_path / "float32")
    assert bf16 != f32, "bfloat16 rounds: the losses differ from float32's"
    assert rel_err(bf16, f32) < 1e-2, (bf16, f32)  # 8 steps: the bfloat16 rounding, not a drift, separates them
    latest = tmp_path / "straight" / (tmp_path / "straight" / "latest").read_text()
    masters = safetensors.numpy.load_file(latest / "model.safetensors")
    assert masters and all(v.dtype == np.float32 for v in masters.values())
    # --export-dtype bfloat16: the masters rounded to nearest even, as numpy's ml_dtypes rounds them
    with open(tmp_path / "hf" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, exported = load_hf(tmp_path / "hf")  # widened to float32 exactly
    for name, value in exported.items():
        np.testing.assert_array_equal(value, masters["transformer." + name].astype(ml_dtypes.bfloat16)
                                      .astype(np.float32), err_msg=name)


def test_export_and_init_from_hugging_face(dataset, tmp_path):
    _run(dataset, tmp_path / "a", "--steps", "2", "--eval-interval", "0", "--export-hf", str(tmp_path / "hf"))
    config, params = load_hf(tmp_path / "hf")
    assert config.n_embd == 32 and config.vocab_size <= 300
    summary = _run(dataset, tmp_path / "b", "--steps", "1", "--eval-interval", "0", "--init-from-hf", str(tmp_path / "hf"))
    assert summary["step"] == 1


HF_GPT2 = Path(__file__).parent / "data" / "hf_tiny_gpt2"


def test_init_from_hf_applies_dropout_and_size_flags_that_repeat_its_sizes():
    args = train_mod.parse_args(["--init-from-hf", str(HF_GPT2), "--dropout", "0.1", "--n-layer", "2", "--n-embd", "32"])
    config = train_mod._config(args, 96)
    assert (config.dropout, config.n_layer, config.n_embd) == (0.1, 2, 32)


@pytest.mark.parametrize("family, extra, message", [
    ("gpt2", ["--n-layer", "6"], r"^--n-layer 6: the model's size comes from --init-from-hf .*hf_tiny_gpt2 "
                                 r"\(n_layer=2\); leave the flag out"),
    ("llama", ["--n-embd", "64"], r"^--n-embd 64: the model's size comes from .*\(hidden_size=32\)"),
    ("llama", ["--dropout", "0.1"], "^--dropout 0.1: dropout=0.1: the Llama family has no dropout"),
])
def test_init_from_hf_refuses_flags_that_contradict_its_weights(family, extra, message):
    args = train_mod.parse_args(["--init-from-hf", str(HF_GPT2.parent / f"hf_tiny_{family}"), *extra])
    with pytest.raises(ValueError, match=message):
        train_mod._config(args, 96)


def test_a_one_step_run_reports_the_speed_of_its_step(dataset, tmp_path, capsys):
    summary = _run(dataset, tmp_path, "--steps", "1", "--eval-interval", "0", "--samples", "0")
    assert summary["tokens_per_s"] > 0
    done = capsys.readouterr().out.split("done: ")[1]
    assert re.match(r"1 step, loss .* [\d.,]+ tokens/s in its one step, compilation included;", done), done


def test_bin_without_tokenizer_trains_and_samples_ids(dataset, tmp_path, capsys):
    bare = tmp_path / "bare.bin"
    bare.write_bytes(Path(dataset).read_bytes())
    _run(bare, tmp_path / "out", "--steps", "1", "--eval-interval", "0")
    sample = capsys.readouterr().out.split("--- sample 0 ---")[1]
    assert sample.strip().startswith("[")


def test_text_file_as_data_says_to_tokenize_it(dataset, tmp_path, capsys):
    text = Path(dataset).parents[1] / "text.txt"
    assert train_mod.main(["--data", str(text), "--out", str(tmp_path), *SMALL, "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert "text.txt looks like text" in error and f"python -m jnntile.data {text} --out DIR" in error
    assert not (tmp_path / "metrics.jsonl").exists()


HF_LLAMA = Path(__file__).parent / "data" / "hf_tiny_llama"
ON_HF_LLAMA = ["--init-from-hf", str(HF_LLAMA), "--batch-size", "2", "--seq-len", "16", "--quiet"]  # its own sizes


def _words_prepared(tmp_path, **kwargs) -> Path:
    tmp_path.mkdir(exist_ok=True)
    text = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(["tiles", "move", "between", "RAM", "and", "disk"], 20))
                              for _ in range(100)))
    return data_mod.prepare_dataset(text, tmp_path / "prepared", progress=False, **kwargs)


def _load(dataset, *extra):
    return train_mod._load_data(train_mod.parse_args(["--data", str(dataset), *ON_HF_LLAMA, *extra]))


def test_data_of_another_tokenizer_than_the_hf_model_s_is_refused_naming_both(dataset, tmp_path):
    mine = re.escape(str(HF_LLAMA / "tokenizer.json"))
    prepare = re.escape(f"python -m jnntile.data FILES --tokenizer {HF_LLAMA} --out DIR")
    qwen2 = _words_prepared(tmp_path / "qwen2", tokenizer=HF_LLAMA.parent / "hf_tiny_qwen2")  # another model's
    for data in (dataset, qwen2 / "train.bin"):
        theirs = re.escape(str(Path(data).parent / "tokenizer.json"))
        with pytest.raises(ValueError, match=rf"--data {re.escape(str(data))} was tokenized by {theirs} .*differs "
                                             rf"from .*{mine} .*{prepare}.*--allow-tokenizer-mismatch"):
            _load(data)
        _load(data, "--allow-tokenizer-mismatch")
    # The model's own tokenizer, by content: read from another path, and from a folder whose meta.json
    # predates the fingerprint.
    llama = _words_prepared(tmp_path / "llama", tokenizer=HF_LLAMA)
    _load(llama)
    meta = json.loads((llama / "meta.json").read_text())
    del meta["tokenizer_sha256"]
    (llama / "meta.json").write_text(json.dumps(meta))
    _load(llama)
    with pytest.raises(ValueError, match="differs"):
        _load(qwen2)


def test_built_in_corpus_on_an_hf_model_with_its_own_tokenizer_is_refused(dataset, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(data_mod, "ensure_default_dataset", lambda progress: Path(dataset).parent)
    assert train_mod.main([*ON_HF_LLAMA, "--out", str(tmp_path), "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert f"--init-from-hf {HF_LLAMA} has its own tokenizer" in error and "built-in corpus" in error
    assert f"`python -m jnntile.data FILES --tokenizer {HF_LLAMA} --out DIR`, and pass --data DIR" in error
    assert not (tmp_path / "metrics.jsonl").exists()


def test_validation_file_too_small_for_one_evaluation_is_refused_before_training(tmp_path, capsys):
    prepared = _words_prepared(tmp_path, vocab_size=300, val_fraction=0.0001)
    assert train_mod.main(["--data", str(prepared), "--out", str(tmp_path / "out"), *SMALL, "--steps", "1"]) == 2
    error = capsys.readouterr().err
    val_tokens = json.loads((prepared / "meta.json").read_text())["val_tokens"]
    assert f"validation file {prepared / 'val.bin'} holds {val_tokens} tokens" in error and "16 + 1 = 17" in error
    for fix in ("more text", "larger --val-fraction", "smaller --seq-len", "--eval-interval 0"):
        assert fix in error
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    # Without evaluation it trains, and its samples take their prompts from the training data.
    assert _run(prepared, tmp_path / "no-eval", "--steps", "1", "--eval-interval", "0", "--samples", "1",
                "--sample-tokens", "4")["step"] == 1


def test_unknown_preset_is_refused(capsys):
    with pytest.raises(SystemExit):
        train_mod.parse_args(["--model", "gpt5"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--steps", "0"], "--steps=0 must be positive"),
    (["--grad-accum-steps", "0"], "--grad-accum-steps=0 must be positive"),
    (["--n-head", "3"], "does not divide"),
    (["--batch-size", "1000", "--seq-len", "512", "--data-order", "sequential"], "fewer than one batch"),
    (["--resume"], "no checkpoint"),
    (["--eval-batches", "0"], "--eval-batches=0 must be positive .--eval-interval 0 turns evaluation off"),
    (["--sample-tokens", "0"], "--sample-tokens=0 must be positive .--samples 0 turns samples off"),
    (["--lr", "nan"], "--lr=nan must be a finite number"),
    (["--weight-decay", "inf"], "--weight-decay=inf must be a finite number"),
    (["--model", "llama-tiny", "--n-embd", "66", "--n-head", "4"],
     r"--n-head 4 \(num_attention_heads\) --n-embd 66 \(hidden_size\): num_attention_heads=4 does not divide "
     "hidden_size=66"),
    (["--memory-limit-mb", "0"], "--memory-limit-mb 0: memory_limit_mb=0 must be positive"),
])
def test_bad_input_is_refused_before_training(dataset, tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        _run(dataset, tmp_path, *extra)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_step_that_cannot_fit_the_memory_limit_is_refused_before_training(dataset, tmp_path):
    # CPU workers only: on a GPU machine the plan puts the step in the GPU's memory (docs/design.md, GPUs).
    bigger = ["--batch-size", "8", "--seq-len", "64", "--memory-limit-mb", "2", "--cuda-workers", "0"]
    args = train_mod.parse_args(["--data", str(dataset), *SMALL, *bigger])
    config = train_mod._config(args, data_mod.TokenDataset(dataset).vocab_size)
    assert config.remat == "auto"  # the default under a memory limit; recomputation does not make it fit either
    for remat in ("none", "block"):
        assert planning.plan(planning.StepSpec(dataclasses.replace(config, remat=remat), 8, 64)).peak > 2 * 2**20
    with pytest.raises(ValueError, match="swap"):
        _run(dataset, tmp_path, "--steps", "1", *bigger)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unwritable_output_directory(dataset, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="not writable"):
        _run(dataset, blocker / "out", "--steps", "1")


def test_checkpoint_of_another_model_is_refused(dataset, tmp_path):
    _run(dataset, tmp_path, "--steps", "1", "--eval-interval", "0", "--samples", "0")
    args = train_mod.parse_args(["--data", str(dataset), "--out", str(tmp_path), *SMALL, "--n-embd", "64",
                                 "--steps", "2", "--resume"])
    with pytest.raises(ValueError, match="another model"):
        train_mod.train(args)


def test_main_reports_errors_without_traceback(dataset, tmp_path, capsys):
    code = train_mod.main(["--data", str(tmp_path / "missing.bin"), "--out", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.startswith("error:")


def _spoil_token_ids(directory: Path) -> str:
    tokens = np.fromfile(directory / "train.bin", dtype=np.uint16)
    tokens[100] = json.loads((directory / "meta.json").read_text())["vocab_size"] + 5
    tokens.tofile(directory / "train.bin")
    return "train.bin holds token id .* at position 100 "


def _spoil_meta(directory: Path) -> str:
    (directory / "meta.json").write_text('{"vocab_size": 4096,')
    return re.escape(str(directory / "meta.json")) + " does not parse as JSON"


@pytest.mark.parametrize("spoil", [_spoil_token_ids, _spoil_meta])
def test_a_spoiled_dataset_is_refused_by_the_command_before_training(dataset, tmp_path, spoil):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("train.bin", "meta.json", "tokenizer.json"):
        (bad / name).write_bytes((dataset.parent / name).read_bytes())
    problem = spoil(bad)
    result = _cli("--data", str(bad / "train.bin"), "--out", str(tmp_path / "out"), *SMALL, "--steps", "1")
    assert result.returncode == 2
    assert re.search(rf"^error: .*{problem}", result.stderr, re.MULTILINE) and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_memory_limit_with_disk_swap_gives_the_same_losses(dataset, tmp_path):
    common = ["--steps", "3", "--eval-interval", "0", "--samples", "0", "--batch-size", "4", "--seq-len", "32"]
    _run(dataset, tmp_path / "unlimited", *common)
    swap = tmp_path / "swap"
    _run(dataset, tmp_path / "limited", *common, "--memory-limit-mb", "3", "--swap-dir", str(swap),
         "--swap-size-mb", "64")
    assert _losses(tmp_path / "limited") == _losses(tmp_path / "unlimited")
    import jnntile

    jnntile.runtime.stop()
    assert not any(swap.iterdir()), "the swap directory is cleaned when the runtime stops"
    jnntile.runtime.configure(memory_limit_mb=jnntile.runtime.RuntimeConfig().memory_limit_mb, swap_dir=None)


# ---- the command line in a fresh process ---------------------------------------------------

def _cli(*argv, **kwargs):
    return subprocess.run([sys.executable, "-m", "jnntile.train", *argv], capture_output=True, text=True,
                          timeout=600, **kwargs)


@pytest.fixture(scope="module")
def ids_4096(tmp_path_factory):
    """A bare token file with a vocabulary of 4096, as the built-in corpus has."""
    path = tmp_path_factory.mktemp("ids") / "ids.bin"
    ids = np.random.default_rng(0).integers(0, 4096, 50_000).astype(np.uint16)
    ids[0] = 4095
    ids.tofile(path)
    return path


def test_automatic_tiles_shrink_to_fit_the_memory_limit(ids_4096, tmp_path):
    # With swap (and the default clip) the update is speculative: the default tiles make its task on a wte tile
    # (4096, 128) need 14 MB per worker (parameter, gradient, two moments, and the three next values apart).
    common = ["--data", str(ids_4096), "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--steps", "6",
              "--workers", "2", "--eval-interval", "0", "--samples", "0", "--quiet"]
    limit = ["--memory-limit-mb", "8", "--swap-dir", str(tmp_path / "swap")]
    unlimited = _cli(*common, "--out", str(tmp_path / "unlimited"))
    assert unlimited.returncode == 0, unlimited.stderr
    assert "shrunk" not in unlimited.stdout
    # With direct I/O too, which moves whole pages only: tiles are padded to pages, and the
    # kernels' scratch buffers of other sizes stay in RAM (StarPU aborts writing them to disk).
    for backend in ("unistd", "unistd_o_direct"):
        limited = _cli(*common, *limit, "--swap-backend", backend, "--out", str(tmp_path / backend))
        assert limited.returncode == 0, limited.stderr[-3000:]
        assert ("automatic tiles shrunk (vocab 4096 -> 1024): with the default ones a single task (adamw update of "
                "a wte.weight tile (4096, 128)) needs 14.0 MB" in limited.stdout), limited.stdout
        assert f"swap 16384 MB in {tmp_path / 'swap'} ({backend})" in limited.stdout
        assert _losses(tmp_path / backend) == _losses(tmp_path / "unlimited"), backend
    # Tiles given on the command line are not changed: the step is refused, with tiles that would fit.
    explicit = _cli(*common, *limit, "--tile-vocab", "4096", "--tile-embd", "128", "--out", str(tmp_path / "explicit"))
    assert explicit.returncode == 2
    assert "cannot run: a single task" in explicit.stderr and "e.g. --tile-vocab 1024" in explicit.stderr
    assert not (tmp_path / "explicit" / "metrics.jsonl").exists()


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(dataset, tmp_path):
    with run_dir.lock(tmp_path):  # as a running training process holds it
        with pytest.raises(ValueError, match=rf"{tmp_path} is in use by another training run \(PID {os.getpid()}\)"):
            _run(dataset, tmp_path, "--steps", "1")
    assert not (tmp_path / "metrics.jsonl").exists()
    _run(dataset, tmp_path, "--steps", "1", "--eval-interval", "0", "--samples", "0")  # free again


def test_sigterm_checkpoints_removes_the_swap_and_exits_143(dataset, tmp_path):
    swap = tmp_path / "swap"
    proc = subprocess.Popen([sys.executable, "-m", "jnntile.train", "--data", str(dataset), "--out",
                             str(tmp_path / "out"), *SMALL, "--steps", "100000", "--eval-interval", "0",
                             "--memory-limit-mb", "64", "--swap-dir", str(swap), "--swap-size-mb", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, out + err
    assert "interrupted (SIGTERM)" in out
    step = int((tmp_path / "out" / "latest").read_text().removeprefix("ckpt-"))
    assert step == len(metrics.read_text().splitlines()) >= 2  # every step recorded is in the checkpoint
    assert list(swap.iterdir()) == []  # StarPU's swap files were removed


def test_swap_larger_than_the_free_disk_is_refused_before_start(dataset, tmp_path, small_tmpfs):
    result = _cli("--data", str(dataset), "--out", str(tmp_path / "out"), *SMALL, "--steps", "2",
                  "--memory-limit-mb", "4", "--swap-dir", str(small_tmpfs), "--swap-size-mb", "64")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"swap directory {small_tmpfs} has 17 MB free, less than the swap size of 64 MB" in result.stderr
    assert list(small_tmpfs.iterdir()) == []


def _fill(directory: Path, name: str) -> None:
    """Writes a file in `directory` until its disk is full, as another process might."""
    with open(directory / name, "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\1" * 65536)
                f.flush()


def test_a_disk_filled_by_another_process_during_training(dataset, tmp_path, small_tmpfs):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "jnntile.train", "--data", str(dataset), "--out", str(out),
                             *SMALL, "--steps", "100000", "--eval-interval", "0", "--checkpoint-interval", "2",
                             "--memory-limit-mb", "3", "--swap-dir", str(small_tmpfs), "--swap-size-mb", "16",
                             "--swap-backend", "unistd"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    # The swap's space was reserved at start: filling the disk takes none of it, and training goes on.
    _fill(small_tmpfs, "filler")
    steps = metrics.read_text().count("\n")
    while metrics.read_text().count("\n") < steps + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]
    if jnntile.runtime.HAS_CUDA:
        # With the CUDA build's StarPU 1.4 the run below did not end within 120 s once the reserve was taken
        # (on CPU workers, no GPU; not understood yet): only Debian's StarPU 1.3 runs the failure's path here.
        proc.terminate()
        proc.communicate(timeout=120)
        pytest.skip("the failure of a swap whose reserve was taken is checked with Debian's StarPU 1.3 only")
    # Something takes the reserve too: the next tile the swap cannot take ends the step with an error.
    (swap,) = small_tmpfs.glob("jnntile-swap-*")
    os.truncate(swap / "reserve", 0)
    _fill(small_tmpfs, "filler2")
    out_text, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert re.search(rf"error: disk swap in {swap} could not take a tile of \d+ bytes \(No space left on device; \d+ "
                     rf"bytes free there\).*Step \d+ did not finish.*{out}/ckpt-\d+ \(step \d+\) stands; continue from "
                     r"it with --resume", err), err
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler", "filler2"]  # the swap files are removed


def test_swap_of_dead_runs_is_removed_before_the_free_space_check(dataset, tmp_path, small_tmpfs):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = small_tmpfs / f"jnntile-swap-{int(dead.stdout)}-AbC123"  # what a killed run leaves
    left.mkdir()
    (left / "tile").write_bytes(b"\1" * 10 * 2**20)
    alive = small_tmpfs / "jnntile-swap-1-XyZ789"  # a process that runs (init)
    alive.mkdir()
    (small_tmpfs / "jnntile-swap-notes").write_text("not a swap directory")
    result = _cli("--data", str(dataset), "--out", str(tmp_path / "out"), *SMALL, "--steps", "2", "--eval-interval",
                  "0", "--samples", "0", "--memory-limit-mb", "4", "--swap-dir", str(small_tmpfs), "--swap-size-mb",
                  "16", "--swap-backend", "unistd")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in small_tmpfs.iterdir()) == [alive.name, "jnntile-swap-notes"]


def test_free_space_below_the_smallest_swap_advises_no_smaller_swap(dataset, tmp_path, small_tmpfs):
    (small_tmpfs / "filler").write_bytes(b"\1" * 4 * 2**20)
    result = _cli("--data", str(dataset), "--out", str(tmp_path / "out"), *SMALL, "--steps", "2",
                  "--memory-limit-mb", "4", "--swap-dir", str(small_tmpfs), "--swap-size-mb", "16")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (f"swap directory {small_tmpfs} has 13 MB free, less than the swap size of 16 MB: free space there, or "
            "choose another --swap-dir (swap_dir)") in result.stderr


@pytest.mark.parametrize("swap_dir", ["/proc/jnntile-swap", "FILE/swap"])
def test_swap_dir_that_cannot_be_created_is_named(dataset, tmp_path, swap_dir):
    (tmp_path / "file").write_text("")
    swap_dir = swap_dir.replace("FILE", str(tmp_path / "file"))
    result = _cli("--data", str(dataset), "--out", str(tmp_path / "out"), *SMALL, "--steps", "1",
                  "--swap-dir", swap_dir)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"swap directory {swap_dir} cannot be created" in result.stderr


def test_out_on_a_full_disk_is_an_error_without_traceback(dataset, small_tmpfs):
    (small_tmpfs / "filler").write_bytes(b"\0" * (17 * 2**20 - 4096))
    result = _cli("--data", str(dataset), "--out", str(small_tmpfs / "out"), *SMALL, "--steps", "3",
                  "--eval-interval", "0", "--samples", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "No space left on device" in result.stderr and str(small_tmpfs / "out") in result.stderr


def test_resume_drops_a_metrics_line_cut_short(dataset, tmp_path, capsys):
    args = ["--steps", "2", "--eval-interval", "0", "--samples", "0"]
    _run(dataset, tmp_path, *args)
    with (tmp_path / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 2, "lo')  # a kill during the write of step 2's line
    _run(dataset, tmp_path, "--steps", "3", "--eval-interval", "0", "--samples", "0", "--resume")
    assert "dropped line 3 of" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_resume_falls_back_to_the_newest_complete_checkpoint(dataset, tmp_path, capsys):
    _run(dataset, tmp_path, "--steps", "4", "--checkpoint-interval", "2", "--eval-interval", "0", "--samples", "0")
    (tmp_path / "ckpt-0000004" / "state.json").unlink()  # lost
    summary = _run(dataset, tmp_path, "--steps", "5", "--eval-interval", "0", "--samples", "0", "--resume")
    err = capsys.readouterr().err
    assert "ckpt-0000004/state.json is missing; using the newest complete checkpoint" in err
    assert str(tmp_path / "ckpt-0000002") in err
    assert summary["losses"] and len(_losses(tmp_path)) == 5  # steps 2, 3 and 4 trained again


def test_resume_when_no_checkpoint_is_complete_names_the_missing_state(dataset, tmp_path):
    (tmp_path / "ckpt-0000004").mkdir()  # its model files written, state.json lost
    (tmp_path / "latest").write_text("ckpt-0000004")
    missing = tmp_path / "ckpt-0000004" / "state.json"
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} holds no complete checkpoint: {missing} is missing")):
        _run(dataset, tmp_path, "--steps", "5", "--resume")


def test_stale_checkpoint_temporaries_are_removed_at_start(dataset, tmp_path, capsys):
    stale = tmp_path / ".ckpt-0000003.tmp-abc123"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    _run(dataset, tmp_path, "--steps", "1", "--eval-interval", "0", "--samples", "0")
    assert not stale.exists()
    assert f"removed {stale}" in capsys.readouterr().err


def test_resume_at_or_past_the_last_step_has_nothing_to_do(dataset, tmp_path, capsys):
    _run(dataset, tmp_path, "--steps", "3", "--eval-interval", "0", "--samples", "0")
    saved = (tmp_path / "ckpt-0000003" / "optimizer.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    summary = _run(dataset, tmp_path, "--steps", "2", "--resume")
    assert "nothing to do" in capsys.readouterr().out and summary["losses"] == []
    assert (tmp_path / "ckpt-0000003" / "optimizer.safetensors").stat().st_mtime_ns == saved
    assert len(_losses(tmp_path)) == 3


def test_a_fresh_run_is_refused_in_an_out_holding_another_run_and_overwrite_starts_afresh(dataset, tmp_path, capsys):
    quick = ["--eval-interval", "0", "--samples", "0"]
    _run(dataset, tmp_path, "--steps", "6", "--checkpoint-interval", "3", *quick)
    code = train_mod.main(["--data", str(dataset), "--out", str(tmp_path), *SMALL, "--steps", "2",
                           "--checkpoint-interval", "1", *quick])
    assert code == 2
    error = capsys.readouterr().err
    assert f"{tmp_path} holds the checkpoints of another run (the last: ckpt-0000006)" in error
    assert "--resume" in error and "--overwrite" in error and "another --out" in error
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000003", "ckpt-0000006"]  # untouched
    assert len(_losses(tmp_path)) == 6 and (tmp_path / "loss.png").exists()

    (tmp_path / "ckpt-0000009").mkdir()  # even one cut short (no state.json) is the other run's
    (tmp_path / "loss.png").unlink()
    _run(dataset, tmp_path, "--steps", "2", "--checkpoint-interval", "1", "--overwrite", *quick)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000001", "ckpt-0000002"]
    assert (tmp_path / "latest").read_text() == "ckpt-0000002"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert (tmp_path / "loss.png").exists()
    with pytest.raises(ValueError, match="--resume continues the run in --out, --overwrite removes it"):
        _run(dataset, tmp_path, "--steps", "3", "--resume", "--overwrite")



def test_export_places_are_checked_before_training(dataset, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    cases = {str(tmp_path / "file" / "hf"): f"{tmp_path / 'file'} is a file, where the export needs a folder",
             str(tmp_path / "file"): "it is a file, where the export needs a folder",
             str(tmp_path / "foreign"): "holds files that are not an earlier export of this run's --out"}
    for flag in ("--export-hf", "--export-lora"):
        for place, message in cases.items():
            extra = ["--lora-rank", "2"] if flag == "--export-lora" else []
            assert train_mod.main(["--data", str(dataset), "--out", str(tmp_path / "out"), *SMALL, "--steps", "1",
                                   flag, place, *extra]) == 2
            assert message in capsys.readouterr().err
            assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_an_export_is_a_whole_model_replaced_only_by_its_own_run_and_a_finished_run_exports(dataset, tmp_path,
                                                                                           capsys):
    from jnntile import generate as generate_mod

    quick = ["--eval-interval", "0", "--samples", "0"]
    _run(dataset, tmp_path / "a", "--steps", "2", *quick, "--export-hf", str(tmp_path / "hf"))
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert files == {"config.json", "model.safetensors", "tokenizer.json", run_dir.EXPORT_MARK}
    text = generate_mod.generate(generate_mod.parse_args(["--hf", str(tmp_path / "hf"), "--prompt", "alpha beta",
                                                         "--max-new-tokens", "3", "--quiet"]))
    assert text[0].startswith("alpha beta")  # the tokenizer came along
    with pytest.raises(ValueError, match="not an earlier export of this run's --out"):
        _run(dataset, tmp_path / "b", "--steps", "1", *quick, "--export-hf", str(tmp_path / "hf"))
    # A finished run exports its last checkpoint, into a new folder or over its own export.
    capsys.readouterr()
    for place in ("hf2", "hf"):
        summary = _run(dataset, tmp_path / "a", "--steps", "2", *quick, "--resume", "--export-hf", str(tmp_path / place))
        assert summary["losses"] == [] and "nothing to train" in capsys.readouterr().out
        assert _hf_tensors(tmp_path / place) == _hf_tensors(tmp_path / "a" / "ckpt-0000002")
    assert len(_losses(tmp_path / "a")) == 2
    with pytest.raises(ValueError, match="past --steps 1: give --steps 2 to export it"):
        _run(dataset, tmp_path / "a", "--steps", "1", *quick, "--resume", "--export-hf", str(tmp_path / "hf"))


def _hf_tensors(directory) -> dict:
    return {name: value.tobytes() for name, value in safetensors.numpy.load_file(directory / "model.safetensors").items()}
