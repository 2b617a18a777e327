"""`python -m jnntile.train --data DIR` on a dataset of fine-tuning examples: packing, truncation, the summary,
the loss over the targets of the whole batch, validation and bit-identical resume."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import plain_llama_tokenizer

from jnntile import data as data_mod
from jnntile import train as train_mod

DATA_DIR = Path(__file__).parent / "data"
WORDS = ["tiles", "move", "between", "RAM", "and", "disk", "while", "the", "model", "trains"]
SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch-size", "2", "--seq-len", "48",
         "--eval-batches", "1", "--samples", "1", "--sample-tokens", "4", "--quiet"]


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """Prompt/completion examples of about 8 to 60 tokens, some longer than --seq-len 48 (the Llama fixture's
    tokenizer, without a chat template: the prompt, then the completion and </s>), a tenth held out."""
    directory = tmp_path_factory.mktemp("examples")
    tokenizer = plain_llama_tokenizer(directory / "tokenizer")
    rng = np.random.default_rng(0)
    records = [{"prompt": " ".join(rng.choice(WORDS, rng.integers(1, 6))),
                "completion": " ".join(rng.choice(WORDS, rng.integers(1, 10)))} for _ in range(60)]
    source = directory / "examples.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    data_mod.main([str(source), "--out", str(directory / "prepared"), "--tokenizer", str(tokenizer)])
    return directory / "prepared"


def _run(dataset, out, *extra):
    return train_mod.train(train_mod.parse_args(["--data", str(dataset), "--out", str(out), *SMALL, *extra]))


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_training_on_examples_states_what_it_trains_on(examples, tmp_path, capsys):
    summary = _run(examples, tmp_path, "--steps", "3", "--eval-interval", "3")
    stats = data_mod.ExampleDataset(examples).stats(48)
    out = capsys.readouterr().out
    assert (f"examples: {stats['examples']} ({stats['targets']:,} targets), 0 dropped with no target, "
            f"{stats['truncated']} truncated at --seq-len 48") in out
    assert f"with packing on, {stats['padding_fraction']:.1%} padding" in out
    rows = _rows(tmp_path)
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows) and "val_loss" in rows[-1]
    assert summary["step"] == 3 and "--- sample 0 ---" in out


def test_packing_off_pads_each_example_to_a_row_and_counts_only_its_tokens(examples, tmp_path, capsys):
    _run(examples, tmp_path, "--steps", "2", "--eval-interval", "0", "--samples", "0", "--packing", "off")
    stats = data_mod.ExampleDataset(examples).stats(48, packing=False)
    assert stats["rows"] == stats["examples"]
    assert f"with packing off, {stats['padding_fraction']:.1%} padding" in capsys.readouterr().out
    dataset = data_mod.ExampleDataset(examples)
    for row in _rows(tmp_path):  # tokens/s counts the examples' tokens, not the padding
        batch = dataset.batch(row["step"], 2, 48, "random", seed=0, packing=False)
        assert row["tokens_per_s"] * row["seconds"] == pytest.approx(np.count_nonzero(batch.segments))
        assert np.count_nonzero(batch.segments) < 2 * 48


def test_no_truncate_refuses_naming_the_longest_example(examples, tmp_path, capsys):
    dataset = data_mod.ExampleDataset(examples)
    longest = int(np.argmax(dataset.lengths))
    code = train_mod.main(["--data", str(examples), "--out", str(tmp_path), *SMALL, "--no-truncate"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert re.search(rf"--no-truncate: example {longest} of .*train.bin has {dataset.lengths[longest]} tokens, the "
                     rf"longest, more than --seq-len 48 .*give --seq-len {dataset.lengths[longest]}", err)
    assert not (tmp_path / "metrics.jsonl").exists()
    summary = _run(examples, tmp_path, "--steps", "1", "--eval-interval", "0", "--samples", "0", "--no-truncate",
                   "--seq-len", "96")
    assert summary["step"] == 1


@pytest.mark.parametrize("flag", [["--packing", "off"], ["--no-truncate"]])
def test_example_flags_with_text_data_are_refused(dataset, tmp_path, capsys, flag):
    code = train_mod.main(["--data", str(dataset), "--out", str(tmp_path), *SMALL, *flag])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {' '.join(flag)} shape a dataset of fine-tuning examples, but --data " in err
    assert "is text, whose --seq-len windows are always full; leave them out" in err


def test_examples_of_another_tokenizer_than_the_hf_model_s_are_refused(examples, tmp_path, capsys):
    code = train_mod.main(["--data", str(examples), "--out", str(tmp_path), "--init-from-hf",
                           str(DATA_DIR / "hf_tiny_qwen2"), "--batch-size", "2", "--seq-len", "16", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"--data {examples} was tokenized by" in err and "--allow-tokenizer-mismatch" in err


def test_resume_on_examples_with_lora_is_bit_identical(examples, tmp_path, monkeypatch, capsys):
    from test_train import _ctrl_c_in_step

    args = ["--steps", "5", "--eval-interval", "2", "--samples", "0", "--lora-rank", "4", "--grad-accum-steps", "2",
            "--dropout", "0.1"]
    _run(examples, tmp_path / "straight", *args)
    with monkeypatch.context() as patched:
        _ctrl_c_in_step(patched, 2)
        summary = _run(examples, tmp_path / "resumed", *args)
    assert summary["interrupted"] and summary["step"] == 3
    _run(examples, tmp_path / "resumed", *args, "--resume")
    assert _rows(tmp_path / "resumed") == [{**row, "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"]}
                                           for row, r in zip(_rows(tmp_path / "straight"), _rows(tmp_path / "resumed"))]
    assert [r["step"] for r in _rows(tmp_path / "resumed") if "val_loss" in r] == [1, 3, 4]
