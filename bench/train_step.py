"""Training-step throughput: jnntile's model vs the pure-JAX reference and PyTorch, same model, batch and
machine, one run.

    .venv/bin/python bench/train_step.py [--configs tiny small 124M-4x256 124M-4x256-bf16 124M-1x1024
                                          124M-4x1024 124M-4x1024-remat llama-tiny smollm-135m] [--steps 10]
                                         [--json] [--profile] [--torch-python .venv-torch/bin/python]

Both train with AdamW + global-norm clipping under `jax.jit`; the reference
donates its parameters and optimizer state (best-practice plain JAX). Each
configuration runs in a process of its own, jnntile first, then XLA, then
(with --torch-python, which `make bench-torch` passes) PyTorch: Hugging Face's
model of the same config.json in eager mode with torch's fused AdamW and
clipping (bench/torch_step.py, in PyTorch's own environment). Prints a
table, or with --json one object per configuration:
{"config": "124M 4x256", "jnntile_tokens_per_s": ..., "xla_tokens_per_s": ..., "ratio": ...}, plus, for
jnntile, tasks per step, the median task duration (of every task since the
process started), each worker's idle fraction over the timed steps, the busy
time and tasks per step of each kernel (`codelets`) and the CPU time per step
of the thread that runs the steps and submits their tasks; --profile prints
the last two under each row.

jnntile's matrix products (and attention's) run oneMKL on Intel CPUs where the
`mkl` package is installed (`make setup` installs it there), else OpenBLAS
(jnntile/core/_blas.py); XLA runs its own. The report names the BLAS (`blas`:
"oneMKL", or OpenBLAS's kernel family; --profile prints it under each row).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = {
    # name: (preset, fields replaced, batch, seq)
    "tiny": ("tiny", dict(n_layer=2, n_head=4, n_embd=128, vocab_size=4096, n_positions=256), 8, 128),
    "small": ("tiny", dict(n_layer=6, n_head=6, n_embd=384, vocab_size=4096, n_positions=256), 8, 256),
    "124M-4x256": ("gpt2", {}, 4, 256),
    # Mixed precision: bfloat16 activations and weight copies, float32 masters (plain JAX casts its parameters
    # to bfloat16 in the loss).
    "124M-4x256-bf16": ("gpt2", dict(dtype="bfloat16"), 4, 256),
    "124M-1x1024": ("gpt2", {}, 1, 1024),
    # The cost of activation recomputation in RAM: the same step with every block recomputed.
    "124M-4x1024": ("gpt2", {}, 4, 1024),
    "124M-4x1024-remat": ("gpt2", dict(remat="block"), 4, 1024),
    "llama-tiny": ("llama-tiny", dict(vocab_size=4096, max_position_embeddings=256), 8, 128),
    "smollm-135m": ("smollm-135m", {}, 4, 256),  # SmolLM's shape: 134.5M parameters, grouped-query attention
}


def label(name: str) -> str:
    """The config name of the report: "tiny 8x128", "124M 4x256", ..."""
    _, fields, batch, seq = CONFIGS[name]
    return (f"{name.split('-')[0] if name[0].isdigit() else name} {batch}x{seq}" + (" remat" if "remat" in fields else "")
            + (" bf16" if "dtype" in fields else ""))


def measure(name: str, which: str, steps: int) -> dict:
    """Runs in a child process: tokens/s of one implementation on one configuration."""
    import jnntile
    from jnntile.models import families
    from steps import jnntile_step, step_seconds, xla_step

    preset, fields, batch, seq = CONFIGS[name]
    config = families.preset(preset, dropout=0.0, **fields)
    if which == "xla":
        seconds = statistics.median(step_seconds(xla_step(config, batch, seq), steps))
        return {"tokens_per_s": batch * seq / seconds}
    step = jnntile_step(config, batch, seq)
    step()
    step()
    jnntile.runtime.wait_all()
    before = jnntile.runtime.stats()
    submit_cpu = _thread_cpu_s()
    started = time.perf_counter()
    times = step_seconds(step, steps, warmup=0)
    jnntile.runtime.wait_all()  # a step's optimizer tasks finish after its loss is read
    wall = time.perf_counter() - started
    submit_cpu = _thread_cpu_s() - submit_cpu
    after = jnntile.runtime.stats()
    tasks = after["tasks_completed"] - before["tasks_completed"]
    busy = [w1["busy_s"] - w0["busy_s"] for w0, w1 in zip(before["workers"], after["workers"])]
    codelets = {}
    for kernel, totals in after["codelets"].items():
        earlier = before["codelets"].get(kernel, {"tasks": 0, "seconds": 0.0})
        if totals["tasks"] > earlier["tasks"]:
            codelets[kernel] = {"tasks_per_step": (totals["tasks"] - earlier["tasks"]) / steps,
                                "busy_ms_per_step": 1e3 * (totals["seconds"] - earlier["seconds"]) / steps}
    return {"tokens_per_s": batch * seq / statistics.median(times), "tiles": str(step.model.tiles),
            "tasks_per_step": tasks / steps, "median_task_ms": 1e3 * after["median_task_s"],
            "worker_idle_fraction": [round(1 - b / wall, 3) for b in busy],
            "submit_cpu_ms_per_step": 1e3 * submit_cpu / steps, "codelets": codelets,
            "runtime": jnntile.runtime.describe(), "blas": jnntile.runtime.blas_core()}


def _thread_cpu_s() -> float:
    """CPU time of the calling thread: the one that runs the jitted steps and submits their tasks (the workers
    are threads of their own)."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def print_profile(row: dict) -> None:
    """Where a configuration's step went: busy time per kernel, the idle fractions and the submitting
    thread's CPU time."""
    busy = sum(c["busy_ms_per_step"] for c in row["codelets"].values())
    print(f"    busy {busy:.0f} ms per step over the workers; submitting thread {row['submit_cpu_ms_per_step']:.0f} "
          f"ms of CPU per step ({1e3 * row['submit_cpu_ms_per_step'] / row['tasks_per_step']:.0f} us per task)")
    for kernel, c in sorted(row["codelets"].items(), key=lambda item: -item[1]["busy_ms_per_step"])[:12]:
        print(f"    {kernel:>32} {c['tasks_per_step']:7.0f} tasks {c['busy_ms_per_step']:8.1f} ms "
              f"{c['busy_ms_per_step'] / busy:6.1%}")


def run_torch(python: str, name: str, steps: int) -> dict:
    """PyTorch's tokens/s on a configuration, in `python`'s environment (bench/torch_step.py)."""
    from jnntile.models import families

    preset, fields, batch, seq = CONFIGS[name]
    config = families.preset(preset, dropout=0.0, **fields)
    command = [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_step.py"), "--hf-config",
               json.dumps(config.to_hf_dict()), "--batch", str(batch), "--seq", str(seq), "--steps", str(steps),
               "--dtype", config.dtype]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"PyTorch on {name} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def run(name: str, which: str, steps: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", name, which, "--steps", str(steps)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{which} on {name} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps after two warm-up steps")
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--torch-python", help="the Python of an environment with torch and transformers (make "
                        "bench-torch makes .venv-torch): adds PyTorch's column")
    parser.add_argument("--profile", action="store_true", help="after each configuration's row, jnntile's busy "
                        "time per kernel and its submitting thread's CPU time per step")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, args.steps)))
        return 0
    if not args.json:
        print(f"{'config':>17} {'jnntile tok/s':>14} {'XLA tok/s':>10} {'ratio':>6} "
              + (f"{'torch tok/s':>12} {'ratio':>6} " if args.torch_python else "")
              + f"{'tasks/step':>11} {'task ms':>8}  idle per worker")
    for name in args.configs:
        jn = run(name, "jnntile", args.steps)
        xla = run(name, "xla", args.steps)
        row = {"config": label(name), "jnntile_tokens_per_s": round(jn["tokens_per_s"], 1),
               "xla_tokens_per_s": round(xla["tokens_per_s"], 1),
               "ratio": round(jn["tokens_per_s"] / xla["tokens_per_s"], 3),
               **{k: v for k, v in jn.items() if k != "tokens_per_s"}}
        if args.torch_python:
            torch_row = run_torch(args.torch_python, name, args.steps)
            row.update(torch_tokens_per_s=round(torch_row["tokens_per_s"], 1),
                       torch_ratio=round(jn["tokens_per_s"] / torch_row["tokens_per_s"], 3),
                       torch=f"torch {torch_row['torch']}, {torch_row['optimizer']}, {torch_row['threads']} threads")
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            torch_columns = (f"{row['torch_tokens_per_s']:12.0f} {row['torch_ratio']:6.2f} "
                             if args.torch_python else "")
            print(f"{row['config']:>17} {row['jnntile_tokens_per_s']:14.0f} {row['xla_tokens_per_s']:10.0f} "
                  f"{row['ratio']:6.2f} {torch_columns}{row['tasks_per_step']:11.0f} {row['median_task_ms']:8.2f}  "
                  f"{row['worker_idle_fraction']}", flush=True)
            if args.profile:
                print(f"    jnntile's BLAS: {row['blas']}")
                print_profile(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
