"""Mixed precision: bfloat16 against float32 on the same model and machine, in one run.

    .venv/bin/python bench/mixed_precision.py [--quick] [--json] [--only loss,speed,swap] [--limit-mb 1216]

loss:  `python -m jnntile.train` with its defaults (GPT-2 tiny on the built-in corpus, same seed and data)
       for 300 steps with --dtype float32 and --dtype bfloat16: the validation loss at the end of each
       (goal: bfloat16 within 2% of float32).
speed: tokens/s of a GPT-2 124M training step at batch 4 x 256 in RAM, float32 and bfloat16
       (bench/train_step.py's measurement; goal: bfloat16 no slower).
swap:  GPT-2 XL's shape (1.48B parameters) at batch 4 x 256 under --limit-mb (default 1216, a 2 GiB peak
       RSS) with disk swap and --remat auto: bytes written to and read from swap in a step, float32 and
       bfloat16, beside the planner's prediction (bench/recompute.py's measurement; goal: bfloat16 moves at
       least 35% fewer bytes). Two steps each, the second reported (about 4 minutes each here).

`--quick` runs the same on models of a few MB (a smoke test of the script).
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

import recompute  # bench scripts import each other by name
import train_step

DTYPES = ("float32", "bfloat16")


def _loss(dtype: str, steps: int, root: Path) -> dict:
    """The validation loss after `steps` default training steps in `dtype`."""
    out = root / f"loss-{dtype}"
    argv = [sys.executable, "-m", "jnntile.train", "--dtype", dtype, "--steps", str(steps), "--eval-interval",
            str(steps), "--checkpoint-interval", "0", "--samples", "0", "--quiet", "--out", str(out)]
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=sys.stderr)  # its progress, not the report
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return dict(measurement="loss", dtype=dtype, steps=steps, val_loss=rows[-1]["val_loss"],
                train_loss_last_50=sum(r["loss"] for r in rows[-50:]) / len(rows[-50:]),
                seconds=time.perf_counter() - started)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps and models of a few MB")
    parser.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")
    parser.add_argument("--only", default="loss,speed,swap")
    parser.add_argument("--limit-mb", type=int, default=1216, help="--memory-limit-mb of the swap runs")
    parser.add_argument("--swap-dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    only = set(args.only.split(","))
    root = Path(tempfile.mkdtemp(prefix="jnntile-bench-mixed-", dir=args.swap_dir))
    rows = []

    def report(row):
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)

    try:
        if "loss" in only:
            for dtype in DTYPES:
                report(_loss(dtype, 30 if args.quick else 300, root))
        if "speed" in only:
            # --quick times the tiny config alone (it has no bfloat16 twin): a smoke test of the measurement.
            for name in ("tiny",) if args.quick else ("124M-4x256", "124M-4x256-bf16"):
                result = train_step.run(name, "jnntile", 2 if args.quick else 5)
                report(dict(measurement="speed", config=train_step.label(name), **result))
        if "swap" in only:
            from jnntile import data

            vocab = data.TokenDataset(data.ensure_default_dataset() / "train.bin").vocab_size
            shape = [*(recompute.QUICK if args.quick else recompute.XL), *recompute._batch(4, 64 if args.quick else 256)]
            for dtype in DTYPES:
                # The second step is reported: the first also converts every weight into its bfloat16 copy.
                row = recompute._measure(f"swap XL 4x256 {dtype}", [*shape, "--dtype", dtype], steps=2,
                                         limit_mb=16 if args.quick else args.limit_mb, root=root, remat="auto",
                                         vocab=vocab, timeout=3600)
                report(dict(measurement="swap", dtype=dtype, **row))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(rows, sys.stderr if args.json else sys.stdout)


def _print(rows, out) -> None:
    by = {(r["measurement"], r.get("dtype") or r.get("config")): r for r in rows}
    for r in rows:
        print(json.dumps(r) if "error" in r else {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()},
              file=out)
    if ("loss", "float32") in by and ("loss", "bfloat16") in by:
        f32, bf16 = by["loss", "float32"]["val_loss"], by["loss", "bfloat16"]["val_loss"]
        print(f"loss after {by['loss', 'float32']['steps']} steps: float32 {f32:.4f}, bfloat16 {bf16:.4f} "
              f"({100 * (bf16 - f32) / f32:+.2f}%)", file=out)
    speed = [r for r in rows if r["measurement"] == "speed"]
    if len(speed) == 2:
        print(f"tokens/s {speed[0]['config']}: {speed[0]['tokens_per_s']:.0f}, {speed[1]['config']}: "
              f"{speed[1]['tokens_per_s']:.0f} ({speed[1]['tokens_per_s'] / speed[0]['tokens_per_s']:.2f}x)", file=out)
    swap = [by.get(("swap", d)) for d in DTYPES]
    if all(r and "error" not in r for r in swap):
        moved = [r["written_mb"] + r["read_mb"] for r in swap]
        print(f"swap bytes per step, XL 4x256: float32 {moved[0]:.0f} MB, bfloat16 {moved[1]:.0f} MB "
              f"({100 * (1 - moved[1] / moved[0]):.0f}% fewer)", file=out)


if __name__ == "__main__":
    main()
