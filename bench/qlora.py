"""LoRA on an NF4-quantized base (QLoRA) against a bfloat16 one, through the command line (issue 50).

    .venv/bin/python bench/qlora.py [--only a b 70b] [--swap-dir DIR] [--json FILE]

Every run is one `python -m jnntile.train` in a process of its own (`lora_beyond_ram.fine_tune`) on random token
ids: rank-16 adapters (alpha 32) on every projection, bfloat16 compute, 2 steps, no samples; nf4 bases with
QLoRA's double quantization of their scales (`--double-quant`; `--no-double-quant`: without).

a. llama-8b (Llama 3.1 8B's shape), batch 1 x 256, a bfloat16 base and an nf4 one under the same
   `--memory-limit-mb` (`--limit-mb`, 2800: lora_beyond_ram's 4 GiB RSS budget) with disk swap: the second
   step's time and bytes read from swap, and nf4's ratio to bfloat16 (the goal: 0.35x the bytes or fewer).
b. llama-8b, nf4 base, `--memory-limit-mb 7000` and no swap: whether 2 steps complete, the peak RSS, and the
   planner's frozen-parameter bytes (the goal: 5.5 GB or fewer).
70b. llama-70b (Llama 3.1 70B's shape, 70.55B parameters, each weight quantized as it is drawn), nf4 base,
   batch 1 x 128, `--memory-limit-mb 8000` with disk swap of the size the planner says the step needs: each
   step's time, bytes read from swap and what share of the disk's sequential read bandwidth (dd with direct
   I/O, measured here) they take, and the peak RSS. Only with `--only 70b`: 91 minutes on 2 cores (46 of them
   drawing and quantizing 70.55B random weights, one weight at a time; steps of 27 and 14 minutes) and 50 GB
   of disk; `--layers-70b N` runs N of its 80 layers (docs/performance.md, "LoRA on a quantized base").

Everything goes to a temporary directory under --swap-dir, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_beyond_ram import make_dataset
from lora_beyond_ram import MB, fine_tune, plan_text

ADAPTERS = ["--lora-rank", "16", "--lora-alpha", "32"]


def model_flags(model: str, seq_len: int, base: str, double_quant: bool) -> list[str]:
    """The training flags of `model` at batch 1 x `seq_len` with a `base` ("bfloat16" or "nf4") base."""
    quantize = ["--quantize-base", "nf4", *(["--double-quant"] if double_quant else [])] if base == "nf4" else []
    return ["--model", model, "--dtype", "bfloat16", "--batch-size", "1", "--seq-len", str(seq_len), *quantize,
            *ADAPTERS]


def plan(argv: list[str]) -> str:
    """What `python -m jnntile.memory` plans for a training command line's flags (printed as it comes)."""
    text = plan_text(argv)
    print(f"python -m jnntile.memory {' '.join(argv)}\n{text}", flush=True)
    return text


def planned_mb(text: str, line: str) -> float:
    """The MB the planner's output gives on its `line` ("frozen parameters", "peak of the step")."""
    return float(re.search(rf"^\s*{line}\s+([\d,.]+) MB", text, re.M).group(1).replace(",", ""))


def swap_needed_mb(text: str) -> int | None:
    """The swap the planner's verdict asks for, None where the step fits in RAM."""
    found = re.search(r"needs (\d+) MB of swap", text)
    return int(found.group(1)) if found else None


def read_bandwidth(directory: Path, size_mb: int = 2048) -> float:
    """The disk's sequential read bandwidth (bytes/s) under `directory`: dd reading a `size_mb` file it wrote,
    16 MB at a time with direct I/O (no page cache), as the swap's direct I/O reads it."""
    path = directory / "dd.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={size_mb // 16}", "oflag=direct"],
                   check=True, capture_output=True)
    result = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                            capture_output=True, text=True)
    path.unlink()
    copied, seconds = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr).groups()
    return int(copied) / float(seconds)


def steps_of(rows: list[dict]) -> list[dict]:
    return [{"step": row["step"], "seconds": row["seconds"], "loss": row["loss"],
             "swap_read_mb": row.get("swap_read_mb", 0), "swap_written_mb": row.get("swap_written_mb", 0)}
            for row in rows]


def train(root: Path, name: str, flags: list[str], limits: list[str], steps: int) -> dict:
    """One training run of `steps` steps in root/name: its peak RSS, seconds and steps."""
    run_dir = root / name
    (run_dir / "out").mkdir(parents=True)
    argv = [*flags, *limits, "--data", str(root / "data"), "--steps", str(steps), "--eval-interval", "0",
            "--checkpoint-interval", "0", "--samples", "0"]
    result, rows = fine_tune(run_dir, argv, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    run = {"peak_rss_mb": result["peak_rss_mb"], "seconds": result["seconds"], "steps": steps_of(rows)}
    print(json.dumps(run), flush=True)
    return run


def part_a(root: Path, args) -> dict:
    limits = ["--memory-limit-mb", str(args.limit_mb), "--swap-dir", str(root / "swap"),
              "--swap-size-mb", str(args.swap_size_mb)]
    runs = {}
    for base in ("bfloat16", "nf4"):
        flags = model_flags("llama-8b", 256, base, args.double_quant)
        runs[f"{base} base"] = {"plan": plan(flags + limits), **train(root, f"8b-{base}", flags, limits, args.steps)}
    bf16, nf4 = (run["steps"][-1] for run in runs.values())
    read_ratio, time_ratio = nf4["swap_read_mb"] / bf16["swap_read_mb"], nf4["seconds"] / bf16["seconds"]
    return {"headline": f"llama-8b, batch 1 x 256, --memory-limit-mb {args.limit_mb} with disk swap:", "runs": runs,
            "read_ratio": read_ratio, "time_ratio": time_ratio,
            "footer": f"nf4 / bfloat16, last step: {read_ratio:.2f}x the bytes read from swap, "
                      f"{time_ratio:.2f}x the time"}


def part_b(root: Path, args) -> dict:
    flags, limits = model_flags("llama-8b", 256, "nf4", args.double_quant), ["--memory-limit-mb", "7000"]
    text = plan(flags + limits)
    frozen_mb = planned_mb(text, "frozen parameters")
    return {"headline": f"llama-8b, nf4 base, --memory-limit-mb 7000, no swap; frozen parameters planned "
                        f"{frozen_mb:,.0f} MB ({frozen_mb * MB / 1e9:.2f} GB):",
            "frozen_mb": frozen_mb, "runs": {"nf4 base": {"plan": text, **train(root, "8b-nf4-ram", flags, limits,
                                                                                  args.steps)}}}


def part_70b(root: Path, args) -> dict:
    flags = model_flags("llama-70b", 128, "nf4", args.double_quant)
    if args.layers_70b:
        flags += ["--n-layer", str(args.layers_70b)]
    free_mb = shutil.disk_usage(root).free / MB
    # Planned with --swap-dir, as the run: without it --fused-update auto plans another update.
    text = plan([*flags, "--memory-limit-mb", "8000", "--swap-dir", str(root / "swap"), "--swap-size-mb",
                 str(int(free_mb))])
    need_mb = swap_needed_mb(text)
    if need_mb is None:
        raise RuntimeError("the step fits in RAM under --memory-limit-mb 8000: no swap to measure; give more "
                           "--layers-70b")
    if need_mb + 4096 > free_mb:
        raise RuntimeError(f"the plan asks for {need_mb} MB of swap and {root} has {free_mb:.0f} MB free")
    bandwidth = read_bandwidth(root)
    limits = ["--memory-limit-mb", "8000", "--swap-dir", str(root / "swap"), "--swap-size-mb", str(need_mb)]
    run = {"plan": text, **train(root, "70b-nf4", flags, limits, args.steps)}
    for step in run["steps"]:
        step["read_bandwidth_share"] = step["swap_read_mb"] * MB / step["seconds"] / bandwidth
    layers = args.layers_70b or 80
    return {"headline": f"llama-70b ({layers} layers), nf4 base, batch 1 x 128, --memory-limit-mb 8000, "
                        f"--swap-size-mb {need_mb} (the plan's need); the disk reads {bandwidth / MB:.0f} MB/s:",
            "swap_size_mb": need_mb, "disk_read_mb_per_s": bandwidth / MB, "runs": {"nf4 base": run}}


def report(results: dict) -> None:
    for name, result in results.items():
        print(f"\n{name}. {result['headline']}")
        for label, run in result["runs"].items():
            print(f"  {label}: peak RSS {run['peak_rss_mb']} MB, whole run {run['seconds'] / 60:.1f} min")
            for step in run["steps"]:
                share = step.get("read_bandwidth_share")
                print(f"    step {step['step']}: {step['seconds']:.0f} s, swap read "
                      f"{step['swap_read_mb'] / 1024:.1f} GB, written {step['swap_written_mb'] / 1024:.1f} GB"
                      + ("" if share is None else f", {share:.0%} of the disk's read bandwidth"))
        if "footer" in result:
            print(f"  {result['footer']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=("a", "b", "70b"), default=["a", "b"],
                        help="the parts to run (default: a b)")
    parser.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True,
                        help="nf4 bases with QLoRA's double quantization of the scales (default: on)")
    parser.add_argument("--layers-70b", type=int, help="part 70b with this many of llama-70b's 80 layers (a shorter "
                        "check of the set-up; default: all 80)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--limit-mb", type=int, default=2800, help="part a's --memory-limit-mb (lora_beyond_ram's)")
    parser.add_argument("--swap-size-mb", type=int, default=40_000, help="part a's --swap-size-mb")
    parser.add_argument("--swap-dir", default=tempfile.gettempdir())
    parser.add_argument("--json", help="write the results to this file too")
    args = parser.parse_args()
    parts = {"a": part_a, "b": part_b, "70b": part_70b}

    root = Path(tempfile.mkdtemp(prefix="jnntile-bench-qlora-", dir=args.swap_dir))
    results = {}
    try:
        from jnntile.models import families
        make_dataset(root / "data", families.preset("llama-8b").vocab_size)  # llama-70b's vocabulary too
        for name in args.only:
            results[name] = parts[name](root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
