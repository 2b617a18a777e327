"""A Llama of Llama 3.2 1B's shape beyond RAM, through the command line, each command's peak RSS measured.

    .venv/bin/python bench/llama_beyond_ram.py [--limit-mb 1216] [--swap-dir DIR] [--model llama-1b]

The model is the `--model` preset with its own vocabulary (128256 tokens for llama-1b: 1.24B parameters,
about 20 GB of float32 parameters, gradients and AdamW state), trained on random token ids (a uint32
dataset made here, with a word-level tokenizer of that vocabulary so that generation can encode a prompt).
Each command runs in a process of its own under `--memory-limit-mb` with disk swap, and its peak RSS
(the kernel's ru_maxrss of that process) is reported:

1. `train` 2 steps, a checkpoint, `--export-hf`;
2. `train --resume` to step 3 (a second checkpoint);
3. `generate --checkpoint` (8 tokens);
4. `train --init-from-hf` of the export, 1 step.

Everything goes to a temporary directory under --swap-dir, removed at the end (the first run's
directory before step 4, to leave room on the disk: about 55 GB are needed at the most).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = ["--batch-size", "1", "--seq-len", "64"]


def make_dataset(directory: Path, vocab_size: int, tokens: int = 200_000) -> None:
    """Random uint32 token ids of `vocab_size`, with meta.json and a word-level tokenizer "t0", "t1", ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, count in (("train.bin", tokens), ("val.bin", tokens // 10)):
        rng.integers(0, vocab_size, count).astype(np.uint32).tofile(directory / name)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "meta.json").write_text(json.dumps({"vocab_size": vocab_size, "dtype": "uint32",
                                                     "train_tokens": tokens, "val_tokens": tokens // 10}))


def run(name: str, argv: list[str], timeout_s: float) -> dict:
    """Runs `python -m jnntile.<argv>` in a child that reports its own child's peak RSS."""
    probe = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
             "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(code)")
    print(f"\n== {name}: python -m jnntile.{' '.join(argv)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "jnntile." + argv[0], *argv[1:]],
                            capture_output=True, text=True, timeout=timeout_s)
    seconds = time.perf_counter() - started
    sys.stderr.write(result.stdout[-3000:] + result.stderr[-3000:])
    peak_kb = [int(line.split()[1]) for line in result.stderr.splitlines() if line.startswith("PEAK_RSS_KB")]
    row = {"command": name, "returncode": result.returncode, "seconds": round(seconds, 1),
           "peak_rss_mb": round(peak_kb[-1] / 1024) if peak_kb else None}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--limit-mb", type=int, default=1216, help="--memory-limit-mb of every command")
    parser.add_argument("--swap-size-mb", type=int, default=32768)
    parser.add_argument("--swap-dir", default=tempfile.gettempdir())
    parser.add_argument("--timeout-s", type=float, default=3600)
    args = parser.parse_args()
    from jnntile.models import families

    vocab = families.preset(args.model).vocab_size
    root = Path(tempfile.mkdtemp(prefix="jnntile-bench-llama-", dir=args.swap_dir))
    limits = ["--memory-limit-mb", str(args.limit_mb), "--swap-dir", str(root / "swap"),
              "--swap-size-mb", str(args.swap_size_mb)]
    train = ["train", "--model", args.model, "--data", str(root / "data"), *BATCH, "--eval-interval", "0",
             "--samples", "0", "--quiet", "--checkpoint-interval", "0", *limits]
    rows = []
    try:
        make_dataset(root / "data", vocab)
        rows.append(run("train 2 steps + checkpoint + export", [*train, "--steps", "2", "--out", str(root / "run"),
                                                               "--export-hf", str(root / "hf")], args.timeout_s))
        rows.append(run("train --resume to step 3", [*train, "--steps", "3", "--out", str(root / "run"), "--resume"],
                        args.timeout_s))
        rows.append(run("generate 8 tokens", ["generate", "--checkpoint", str(root / "run"), "--prompt", "t1 t2 t3",
                                              "--max-new-tokens", "8", "--temperature", "0", *limits], args.timeout_s))
        shutil.rmtree(root / "run")
        rows.append(run("train --init-from-hf, 1 step", [*train, "--steps", "1", "--out", str(root / "tuned"),
                                                         "--init-from-hf", str(root / "hf")], args.timeout_s))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.model} under --memory-limit-mb {args.limit_mb} with disk swap:", file=sys.stderr)
    for row in rows:
        print(f"  {row['command']:<40} {row['seconds']:8.1f} s  peak RSS {row['peak_rss_mb']} MB"
              + ("" if row["returncode"] == 0 else f"  FAILED ({row['returncode']})"), file=sys.stderr)
    return 0 if all(row["returncode"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
