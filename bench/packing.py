"""Packing against padding: useful (unpadded) tokens per second of `python -m jnntile.train` on fine-tuning
examples whose lengths vary as chat data's do.

    .venv/bin/python bench/packing.py [--examples 400] [--seq-len 1024] [--batch-size 2] [--steps 20]
                                      [--model llama-tiny] [--seed 0]

Examples of lengths drawn uniformly between 30 and 1000 tokens (random ids, every token but each example's first
trained) are written as a dataset of examples (the Llama test fixture's tokenizer), then the same model trains
--steps steps on them with `--packing on` (whole examples packed into each --seq-len row) and with `--packing
off` (each example padded to a row of its own), in one run. The train command's tokens/s counts an examples
batch's tokens without its padding; the median over the steps after the first (which compiles) is compared:
the goal is a ratio of at least 1.5.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from jnntile import data
from jnntile import train

TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "data" / "hf_tiny_llama"


def write_examples(directory: Path, lengths: np.ndarray, seed: int) -> Path:
    """A dataset of examples of `lengths` tokens (random ids of the tokenizer's vocabulary), every token trained
    but each example's first: one prepared from a placeholder, whose token files are then replaced."""
    source = directory / "placeholder.jsonl"
    source.write_text(2 * (json.dumps({"text": "x y"}) + "\n"))  # one for the validation split
    out = directory / "examples"
    data.main([str(source), "--out", str(out), "--tokenizer", str(TOKENIZER)])
    vocab_size = data.ExampleDataset(out).vocab_size
    rng = np.random.default_rng(seed)
    rng.integers(3, vocab_size, int(lengths.sum())).astype(np.uint16).tofile(out / "train.bin")
    np.concatenate([[0] + [1] * (n - 1) for n in lengths]).astype(np.uint8).tofile(out / "train.mask.bin")
    np.save(out / "train.examples.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lengths = np.random.default_rng(args.seed).integers(30, 1001, args.examples)
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_examples(Path(tmp), lengths, args.seed)
        for packing in ("on", "off"):
            stats = data.ExampleDataset(dataset).stats(args.seq_len, packing=packing == "on")
            summary = train.train(train.parse_args([
                "--data", str(dataset), "--out", str(Path(tmp) / f"packing-{packing}"), "--model", args.model,
                "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                "--packing", packing, "--eval-interval", "0", "--samples", "0", "--checkpoint-interval", "0",
                "--seed", str(args.seed), "--quiet"]))
            rates[packing] = summary["tokens_per_s"]
            print(f"packing {packing}: {stats['padding_fraction']:.1%} padding, median {rates[packing]:,.0f} useful "
                  f"tokens/s", flush=True)
    print(f"{args.examples} examples of 30..1000 tokens (mean {lengths.mean():.0f}) at --seq-len {args.seq_len}, "
          f"--batch-size {args.batch_size}, {args.model}: packing gives {rates['on'] / rates['off']:.2f}x the useful "
          "tokens/s of padding (goal: >= 1.5x)")


if __name__ == "__main__":
    main()
