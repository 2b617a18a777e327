"""LoRA fine-tuning of a model of Llama 3.1 8B's shape under a 4 GiB RSS budget, through the command line.

    .venv/bin/python bench/lora_beyond_ram.py [--limit-mb 2800] [--swap-dir DIR] [--model llama-8b] [--seq-len 256]

The model is the `--model` preset (llama-8b: 8.03B parameters, vocabulary 128256) with its base stored in
bfloat16 (`--dtype bfloat16`: about 14 GB of projection weights, plus the float32 embeddings and head) and
rank-16 adapters on every projection (`--lora-rank 16 --lora-alpha 32`), trained on random token ids. One
`python -m jnntile.train` run, in a process of its own under `--memory-limit-mb` with disk swap, trains 2
steps at batch 1 x `--seq-len`, checkpoints the adapters, exports them (`--export-lora`) and generates a
sample with them (the run's own sampling, through the key/value cache). Reported: each step's time and
bytes moved to and from swap and the most the swap held (from metrics.jsonl), the process's peak RSS
(ru_maxrss), the most disk used under --swap-dir while it ran (StarPU allocates the whole --swap-size-mb
up front), and what `python -m jnntile.memory` plans for the same model fine-tuned
with adapters and in full (what a full fine-tune would need).

Everything goes to a temporary directory under --swap-dir, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from llama_beyond_ram import make_dataset, run

MB = 2**20


def disk_used(path: Path) -> int:
    """Bytes the files under `path` occupy on the disk (allocated blocks)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # removed while walking
                pass
    return total


class DiskWatch:
    """The most disk used under a directory, sampled every few seconds in a thread."""

    def __init__(self, path: Path, every_s: float = 5.0):
        self.path, self.every_s, self.peak = path, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, disk_used(self.path))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, disk_used(self.path))


def plan_text(argv: list[str]) -> str:
    result = subprocess.run([sys.executable, "-m", "jnntile.memory", *argv], capture_output=True, text=True,
                            timeout=1800)
    if result.returncode not in (0, 1):  # 1: the plan cannot run under these limits, which it says
        raise RuntimeError(f"python -m jnntile.memory {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def fine_tune(root: Path, argv: list[str], name: str = "LoRA fine-tune") -> tuple[dict, list[dict]]:
    """`python -m jnntile.train` with `argv` and --out root/out, in a process of its own: its `run` row (peak RSS,
    seconds) with the most disk used under `root` while it ran ("disk_peak_mb"), and its metrics.jsonl rows."""
    out = root / "out"
    with DiskWatch(root) as disk:
        result = run(name, ["train", *argv, "--out", str(out)], timeout_s=6 * 3600)
    if result["returncode"] != 0:
        raise RuntimeError(f"the training run failed ({result['returncode']}); its output is above")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {**result, "disk_peak_mb": disk.peak / MB}, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--limit-mb", type=int, default=2800, help="--memory-limit-mb of the run (RSS adds JAX, the "
                        "compiled programs and the tiles' bookkeeping to it: 4 GiB of RSS in all)")
    parser.add_argument("--swap-dir", default=tempfile.gettempdir())
    parser.add_argument("--swap-size-mb", type=int, default=40_000)
    parser.add_argument("--json", help="write the results to this file too")
    args = parser.parse_args()

    model = ["--model", args.model, "--dtype", "bfloat16", "--batch-size", "1", "--seq-len", str(args.seq_len)]
    adapters = ["--lora-rank", "16", "--lora-alpha", "32"]
    limits = ["--memory-limit-mb", str(args.limit_mb), "--swap-size-mb", str(args.swap_size_mb)]
    results = {"model": args.model, "seq_len": args.seq_len, "limit_mb": args.limit_mb,
               "plan_lora": plan_text([*model, *adapters, *limits]), "plan_full": plan_text([*model, *limits])}
    print(results["plan_lora"], "\n--- a full fine-tune would need:\n", results["plan_full"], flush=True)

    root = Path(tempfile.mkdtemp(prefix="jnntile-bench-lora-", dir=args.swap_dir))
    try:
        from jnntile.models import families
        vocab = families.preset(args.model).vocab_size
        make_dataset(root / "data", vocab)
        train = [*model, *adapters, "--data", str(root / "data"), "--steps", str(args.steps),
                 "--eval-interval", "0", "--checkpoint-interval", "0", "--samples", "1", "--sample-tokens", "4",
                 "--export-lora", str(root / "adapter"), "--swap-dir", str(root / "swap"), *limits]
        result, rows = fine_tune(root, train)
        results.update(peak_rss_mb=result["peak_rss_mb"], seconds=result["seconds"],
                       disk_peak_mb=result["disk_peak_mb"], steps=rows, adapter_mb=disk_used(root / "adapter") / MB,
                       checkpoint_mb=disk_used(root / "out") / MB)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{args.model}, LoRA rank 16 on every projection, bfloat16 base, batch 1 x {args.seq_len}, "
          f"--memory-limit-mb {args.limit_mb} with disk swap:")
    for row in results["steps"]:
        print(f"  step {row['step']}: {row['seconds']:.0f} s, loss {row['loss']:.3f}, swap written "
              f"{row.get('swap_written_mb', 0) / 1024:.1f} GB, read {row.get('swap_read_mb', 0) / 1024:.1f} GB")
    held = max(row.get("swap_peak_used_mb", 0) for row in results["steps"]) / 1024
    print(f"  peak RSS {results['peak_rss_mb']:.0f} MB; swap held at most {held:.1f} GB (disk used at most "
          f"{results['disk_peak_mb'] / 1024:.1f} GB with the swap file); "
          f"adapters {results['adapter_mb']:.0f} MB; checkpoint directory {results['checkpoint_mb']:.0f} MB; "
          f"whole run {results['seconds'] / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
