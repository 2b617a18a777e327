"""GPU benchmark: what jnntile does with a GPU, as one JSON report (`make test-gpu` runs it).

    .venv-cuda/bin/python bench/gpu.py [--out out/gpu/report.json] [--only gemm train train_bf16 variants limited capacity]
        [--capacity-layers 16] [--capacity-full] [--swap-dir DIR] [--placement auto|any|cpu|cuda] [--workers N]
        [--[no-]fused-attention] [--scheduler dmdas|lws|eager|...] [--fused-update auto|on|off]
        [--tiles batch=8 vocab=50257 ...] [--smoke]

Sections, each measured in a process of its own so that it has the whole GPU:
  gemm      tile GEMM through StarPU vs jnp.dot on the GPU, FP32 and TF32, several tile sizes
  train     GPT-2 124M, batch 8 x 1024: training tokens/s of jnntile vs plain JAX (jit, parameters and
            optimizer state donated, both at JAX's default precision on the GPU, TF32); the share of tasks
            and busy time on the CPU workers beside the GPU, and the busiest kernels per step on each
  train_bf16  the same in bfloat16: jnntile with --dtype bfloat16 (float32 masters, bfloat16 activations and
            weight copies) vs plain JAX casting its float32 parameters to bfloat16 in the loss
  variants  the bfloat16 step of train_bf16 with one runtime setting changed at a time (VARIANTS): the eager
            scheduler, kernels one at a time (STARPU_CUDA_PIPELINE=0, so the kernel times are their own), a
            deeper CUDA pipeline, the update fused into the backward, one CPU worker; and StarPU's own cost of a
            task on the CUDA worker (bench/overhead.py) under dmdas and eager. Where the step's time goes
            between kernels and StarPU, in one call.
  limited   the same jnntile run with the GPU memory limited to a quarter of parameters + gradients +
            AdamW state + activations: tokens/s and bytes moved per step between GPU and RAM
  capacity  GPT-2 with n_embd 2048 (16 heads), batch 1 x 1024, AdamW in float32, n_layer from
            --capacity-layers, 2 steps using GPU memory, host RAM and disk swap: step time, bytes per
            level, peak use of each level. By default (16 layers, 0.85B parameters, to fit the 10
            minutes of `make test-gpu`) the GPU and RAM limits are each a quarter of the state, so
            every level is used; --capacity-full gives it the whole GPU and half the RAM, and with
            --capacity-layers 250 (12.7B parameters, 2.6x the 4.94B that plain JAX fits on an H100
            80GB) measures capacity.
Without a GPU the report says so and nothing runs; --smoke runs every section with tiny sizes on
whatever hardware there is (the CPU here), to check this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 2**20
SECTIONS = ("gemm", "train", "train_bf16", "variants", "limited", "capacity")
# The "variants" section: name -> (jnntile runtime settings, environment) of a bfloat16 training run.
VARIANTS = {
    "default": ({}, {}),
    "eager scheduler": ({"scheduler": "eager"}, {}),
    "one kernel at a time": ({}, {"STARPU_CUDA_PIPELINE": "0"}),
    "CUDA pipeline 4": ({}, {"STARPU_CUDA_PIPELINE": "4"}),
    "update in the backward": ({"fused_update": "on"}, {}),
    "1 CPU worker": ({"workers": 1}, {}),
}
OVERHEAD_SCHEDULERS = ("dmdas", "eager")
# Measured on an H100 80GB HBM3 (plain GPT-2 with optax.adamw, jit, donated, n_embd 2048, batch 1 x 1024,
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.95): 96 layers ran, 112 ran out of memory.
PLAIN_JAX_MAX_PARAMS_H100 = 4.94e9


def sizes(smoke: bool) -> dict:
    if smoke:
        return {"gemm": {"sizes": [512], "tiles": [256], "repeats": 2},
                "train": {"model": dict(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=64),
                          "batch": 2, "seq": 64, "steps": 2, "calibration_steps": 2},
                "overhead_count": 200,
                # 2.7M parameters (42 MB of state) under a 16 MB limit: every level is used. Two CPU workers:
                # 15 (a 16-core GPU machine) would run 15 optimizer tasks of 2 MB at once, over the limit.
                "capacity": {"n_embd": 256, "n_head": 4, "vocab_size": 4096, "seq": 32, "batch": 2, "workers": 2,
                             "tiles": dict(tile_batch=1, tile_seq=16, tile_embd=128, tile_heads=2, tile_hidden=256,
                                           tile_vocab=1024)}}
    return {"gemm": {"sizes": [8192, 16384], "tiles": [2048, 4096], "repeats": 3},
            "train": {"model": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024),
                      "batch": 8, "seq": 1024, "steps": 10, "calibration_steps": 12},
            "overhead_count": 3000,
            "capacity": {"n_embd": 2048, "n_head": 16, "vocab_size": 50257, "seq": 1024, "batch": 1}}


# ---- measurements (each runs in a child process) ------------------------------------------------

PRECISIONS = ("highest", "tf32")  # FP32, and JAX's default on these GPUs (TF32)


def measure_gemm_jnntile(p: dict) -> dict:
    import numpy as np

    import jnntile
    from jnntile.ops import gemm
    from steps import best_seconds

    rows = []
    for precision in PRECISIONS:
        jnntile.runtime.stop()
        jnntile.runtime.start(matmul_precision=precision)
        for n in p["sizes"]:
            rng = np.random.default_rng(0)
            a_np, b_np = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
            for tile in p["tiles"]:
                a, b = jnntile.from_array(a_np, tile), jnntile.from_array(b_np, tile)

                def run():
                    c = gemm.matmul(a, b)
                    jnntile.runtime.wait_all()
                    c.free()

                rows.append({"precision": precision, "n": n, "tile": tile,
                             "jnntile_gflops": 2.0 * n**3 / best_seconds(run, p["repeats"]) / 1e9})
                a.free()
                b.free()
    return {"rows": rows}


def measure_gemm_xla(p: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from steps import best_seconds

    gflops = {}
    for precision, xla_precision in zip(PRECISIONS, (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT)):
        dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=xla_precision))
        for n in p["sizes"]:
            rng = np.random.default_rng(0)
            a, b = (jnp.asarray(rng.standard_normal((n, n), dtype=np.float32)) for _ in range(2))
            gflops[f"{precision} {n}"] = 2.0 * n**3 / best_seconds(lambda: dot(a, b).block_until_ready(),
                                                                     p["repeats"]) / 1e9
    return {"gflops": gflops, "jax_device": str(jax.devices()[0])}


def measure_gemm(p: dict, log, timeout_s: float, xla_env: dict) -> dict:
    """Tile GEMM through StarPU and jnp.dot, each in a child of its own: jnntile keeps JAX off the GPU
    StarPU owns, so XLA's product runs where JAX may take the GPU."""
    tiled = run_child("gemm_jnntile", p, timeout_s, log)
    xla = run_child("gemm_xla", p, timeout_s, log, env=xla_env)
    if "error" in tiled or "error" in xla:
        return {"error": f"jnntile: {tiled.get('error', 'ok')}; XLA: {xla.get('error', 'ok')}"}
    for row in tiled["rows"]:
        row["xla_gflops"] = xla["gflops"][f"{row['precision']} {row['n']}"]
        row["ratio"] = row["jnntile_gflops"] / row["xla_gflops"]
    return {"rows": tiled["rows"], "jax_device": xla["jax_device"]}


def _config(model: dict):
    from jnntile.models.gpt2.config import GPT2Config

    return GPT2Config(dropout=0.0, **model)


def _worker_shares(before: dict, after: dict) -> dict:
    """Tasks and busy seconds per worker kind between two stats() snapshots."""
    out = {}
    for w0, w1 in zip(before["workers"], after["workers"]):
        kind = "CUDA" if w1["name"].startswith("CUDA") else "CPU"
        entry = out.setdefault(kind, {"tasks": 0, "busy_s": 0.0})
        entry["tasks"] += w1["tasks"] - w0["tasks"]
        entry["busy_s"] += w1["busy_s"] - w0["busy_s"]
    total_tasks = sum(e["tasks"] for e in out.values()) or 1
    total_busy = sum(e["busy_s"] for e in out.values()) or 1.0
    for entry in out.values():
        entry["task_share"] = entry["tasks"] / total_tasks
        entry["busy_share"] = entry["busy_s"] / total_busy
    return out


def _kernels_per_step(before: dict, after: dict, steps: int, top: int = 12) -> list[dict]:
    """The kernels that took the most busy time per step, split between CPU and CUDA workers."""
    rows = []
    for name, c1 in after["codelets"].items():
        c0 = before["codelets"].get(name, {})
        delta = {k: (c1[k] - c0.get(k, 0)) / steps for k in ("tasks", "seconds", "cuda_tasks", "cuda_seconds")}
        if delta["tasks"] == 0:
            continue
        rows.append({"kernel": name, "cuda_tasks": delta["cuda_tasks"], "cuda_s": delta["cuda_seconds"],
                     "cpu_tasks": delta["tasks"] - delta["cuda_tasks"],
                     "cpu_s": delta["seconds"] - delta["cuda_seconds"]})
    rows.sort(key=lambda r: r["cuda_s"] + r["cpu_s"], reverse=True)
    return rows[:top]


def _bytes_per_step(before: dict, after: dict, steps: int) -> dict:
    keys = set(before["bytes_moved"]) | set(after["bytes_moved"])
    return {k: (after["bytes_moved"].get(k, 0) - before["bytes_moved"].get(k, 0)) / steps for k in sorted(keys)}


def _peaks(stats: dict) -> dict:
    peaks = {}
    for node in stats["nodes"]:
        peaks[node["kind"]] = max(peaks.get(node["kind"], 0), node["peak_used_bytes"])
    return peaks


def measure_jnntile_training(p: dict, gpu_memory_fraction: float | None = None) -> dict:
    """Tokens/s of jnntile's GPT-2 step; with gpu_memory_fraction, under that share of the step's memory."""
    import jnntile
    from jnntile import planning
    from steps import jnntile_step, step_seconds

    config = _config(p["model"])
    B, T = p["batch"], p["seq"]
    settings = {k: p[k] for k in ("placement", "workers", "fused_attention", "scheduler") if p.get(k) is not None}
    fused_update = p.get("fused_update") or "auto"
    if gpu_memory_fraction is not None:
        plan = planning.plan(planning.StepSpec(config, B, T))
        gpu_mb = settings["gpu_memory_limit_mb"] = max(1, int((plan.state + plan.activations) * gpu_memory_fraction
                                                              / MB))
        # Automatic tiles shrink where two of a step's largest tasks would not fit the GPU, as jnntile.train does.
        limits = planning.Limits(jnntile.runtime.config().memory_limit_mb, gpu_mb=gpu_mb,
                                 workers=settings.get("workers"))
        config = planning.fit_tiles(planning.StepSpec(config, B, T), limits)[0].config
    jnntile.runtime.stop()
    jnntile.runtime.start(**settings)
    step = jnntile_step(config, B, T, fused_update)
    # dmdas runs each kernel STARPU_CALIBRATE_MINIMUM (10) times per tile shape on each kind of worker before
    # it trusts its performance model, so the first steps put GEMMs on CPU workers on purpose (measured on an
    # H200 with 2 warm-up steps: 0.84 s/step, CPU workers 94% of the busy time). Measured after calibration.
    calibration_s = step_seconds(step, p["calibration_steps"], warmup=0)
    jnntile.runtime.wait_all()
    before = jnntile.runtime.stats()
    jnntile.runtime.reset_peaks()
    times = step_seconds(step, p["steps"], warmup=0)
    jnntile.runtime.wait_all()
    after = jnntile.runtime.stats()
    seconds = statistics.median(times)
    return {"config": p["model"], "batch": [B, T], "tiles": str(step.model.tiles),
            "runtime": jnntile.runtime.describe(), "settings": settings, "fused_update": fused_update,
            "calibration_step_s": calibration_s,
            "step_s": seconds, "steps": p["steps"], "tokens_per_s": B * T / seconds,
            "workers": _worker_shares(before, after),
            "kernels_per_step": _kernels_per_step(before, after, p["steps"]),
            "bytes_per_step": _bytes_per_step(before, after, p["steps"]), "peak_bytes": _peaks(after)}


def measure_xla_training(p: dict) -> dict:
    import jax

    from steps import median_step_seconds, xla_step

    config = _config(p["model"])
    B, T = p["batch"], p["seq"]
    seconds = median_step_seconds(xla_step(config, B, T), p["steps"])
    return {"jax_device": str(jax.devices()[0]), "step_s": seconds, "tokens_per_s": B * T / seconds}


def measure_capacity(p: dict) -> dict:
    """Two AdamW steps of a GPT-2 that needs GPU memory, host RAM and disk swap together."""
    import jnntile
    from jnntile import optim, planning
    from jnntile.models.gpt2.config import GPT2Config
    from steps import jnntile_step

    config = GPT2Config(n_layer=p["n_layer"], n_head=p["n_head"], n_embd=p["n_embd"], vocab_size=p["vocab_size"],
                        n_positions=p["seq"], dropout=0.0, **p.get("tiles", {}))
    B, T, workers = p["batch"], p["seq"], p.get("workers")
    plan = planning.plan(planning.StepSpec(config, B, T), workers=workers)
    if not p["full"]:  # a quarter of the state on the GPU, a quarter in RAM, the rest on disk
        quarter_mb = max(16, plan.state // MB // 4)
        p = dict(p, memory_limit_mb=quarter_mb, gpu_memory_limit_mb=quarter_mb if p["gpu"] else None)
    gpu_mb = p.get("gpu_memory_limit_mb") or jnntile.runtime.gpu_memory_mb()
    ram_mb = p["memory_limit_mb"]
    # The step clips under swap, so "auto" runs its update speculatively inside the backward: plan that step.
    update = optim.update_mode(clip=True, fused_update="auto", swap=True)
    spec, tiles_note = planning.fit_tiles(planning.StepSpec(config, B, T, update=update),  # as jnntile.train does
                                          planning.Limits(ram_mb, gpu_mb=gpu_mb, workers=workers))
    config = spec.config
    plan = planning.plan(spec, workers=workers)
    swap_mb = plan.swap_needed_mb(ram_mb, gpu_mb) or jnntile.runtime.MIN_SWAP_MB
    settings = {"memory_limit_mb": ram_mb, "swap_dir": p["swap_dir"], "swap_size_mb": swap_mb}
    if workers is not None:
        settings["workers"] = workers
    if p.get("gpu_memory_limit_mb"):
        settings["gpu_memory_limit_mb"] = p["gpu_memory_limit_mb"]
    verdict = plan.check(planning.Limits(ram_mb, swap_mb, gpu_mb))
    jnntile.runtime.stop()
    jnntile.runtime.start(**settings)
    started = time.perf_counter()
    step = jnntile_step(config, B, T)
    jnntile.runtime.wait_all()
    init_s = time.perf_counter() - started
    before = jnntile.runtime.stats()
    jnntile.runtime.reset_peaks()
    times, losses = [], []
    for _ in range(2):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    jnntile.runtime.wait_all()
    after = jnntile.runtime.stats()
    n_params = config.n_params()
    return {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_params": n_params,
            "state_bytes": plan.state, "planned_peak_bytes": plan.peak, "verdict": verdict, "tiles": tiles_note,
            "runtime": jnntile.runtime.describe(), "settings": settings, "init_s": init_s, "step_s": times,
            "losses": losses, "bytes_per_step": _bytes_per_step(before, after, 2), "peak_bytes": _peaks(after),
            "vs_plain_jax_h100": n_params / PLAIN_JAX_MAX_PARAMS_H100}


def measure_overhead(p: dict) -> dict:
    """StarPU's microseconds per empty task (bench/overhead.py) per scheduler and kind of worker."""
    from overhead import measure

    return {"us_per_task": {scheduler: measure(scheduler, p["count"]) for scheduler in OVERHEAD_SCHEDULERS}}


CHILDREN = {"gemm_jnntile": measure_gemm_jnntile, "gemm_xla": measure_gemm_xla,
            "train_jnntile": measure_jnntile_training, "train_xla": measure_xla_training,
            "overhead": measure_overhead,
            "limited": lambda p: measure_jnntile_training(p, gpu_memory_fraction=0.25), "capacity": measure_capacity}


# ---- the parent: one child process per measurement ------------------------------------------------

def run_child(name: str, params: dict, timeout_s: float, log, env: dict | None = None) -> dict:
    """One measurement in a child process; env: variables set for it (XLA's children get its GPU)."""
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--params", json.dumps(params)]
    started = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    log.write(result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        return {"error": f"exit code {result.returncode}: " + " | ".join(tail)}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = time.perf_counter() - started
    return out


def measure_variants(params: dict, timeout_s: float, log, xla_env: dict, overhead_count: int) -> dict:
    """Plain JAX's bfloat16 step once, then jnntile's under each of VARIANTS, and StarPU's cost per task."""
    out = {"xla": run_child("train_xla", params, timeout_s, log, env=xla_env), "runs": {}}
    for name, (settings, env) in VARIANTS.items():
        run = run_child("train_jnntile", {**params, **settings}, timeout_s, log, env=env)
        if "tokens_per_s" in run and "tokens_per_s" in out["xla"]:
            run["ratio"] = run["tokens_per_s"] / out["xla"]["tokens_per_s"]
        out["runs"][name] = run
    out["overhead"] = run_child("overhead", {"count": overhead_count}, timeout_s, log)
    return out


def gpu_summary() -> dict:
    import jnntile

    jnntile.runtime.start()
    return {"runtime": jnntile.runtime.describe(), "cuda_workers": jnntile.runtime.cuda_worker_count(),
            "gpu_memory_mb": jnntile.runtime.gpu_memory_mb(), "emulated_gpu": jnntile._xla_ffi.emulated_gpu()}


def main(argv=None) -> int:
    from jnntile.training.optim import FUSED_UPDATE_CHOICES
    from jnntile.core.runtime import SCHEDULERS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gpu/report.json")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--capacity-layers", type=int, default=16,
                        help="n_layer of the capacity run (16: 0.85B parameters; 250: 12.7B)")
    parser.add_argument("--capacity-full", action="store_true",
                        help="the capacity run gets the whole GPU and --memory-limit-mb of RAM, not quarters of "
                             "its state")
    parser.add_argument("--memory-limit-mb", type=int, default=None,
                        help="RAM for tiles in a --capacity-full run (default: half of what is available)")
    parser.add_argument("--swap-dir", default=None, help="disk swap of the capacity run (default: a temporary dir)")
    parser.add_argument("--placement", choices=("auto", "any", "cpu", "cuda"), default=None,
                        help="where jnntile's training runs kernels that have a CUDA version (default: the "
                             "runtime's, auto)")
    parser.add_argument("--workers", type=int, default=None, help="CPU workers of jnntile's training runs")
    parser.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=None,
                        help="whether jnntile's training runs take the fused bfloat16 attention kernels (runtime "
                             "setting; default: the runtime's, on)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default=None,
                        help="StarPU scheduler of jnntile's training runs (default: the runtime's, auto: dmdas "
                             "with a GPU)")
    parser.add_argument("--fused-update", choices=FUSED_UPDATE_CHOICES, default=None,
                        help="when jnntile's training runs update the parameters (default: auto; on: in the "
                             "backward, speculatively under the clip)")
    parser.add_argument("--tiles", nargs="+", default=[], metavar="AXIS=SIZE", type=_tile_setting,
                        help="tile sizes of the training runs (axes: batch seq embd heads hidden vocab; default: "
                             "jnntile's automatic tiles)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any hardware, to check the script")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(CHILDREN[args.child](json.loads(args.params))), flush=True)
        return 0

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(sys.argv), "smoke": args.smoke, **gpu_summary()}
    if report["cuda_workers"] == 0 and not args.smoke:
        report["skipped"] = ("no CUDA worker: " + report["runtime"] + ". Nothing was measured; --smoke checks "
                             "this script on the CPU")
        out_path.write_text(json.dumps(report, indent=2) + "\n")
        print(report["skipped"])
        return 0

    s = sizes(args.smoke)
    timeout_s = 300 if not args.smoke else 120
    log_path = out_path.with_suffix(".log")
    with log_path.open("w") as log, tempfile.TemporaryDirectory(prefix="jnntile-bench-swap-") as tmp_swap:
        # jnntile keeps JAX on the CPU with the CUDA build; the plain-JAX baselines ask for its GPU (an emulated
        # GPU has none for JAX: there they run on the CPU).
        xla_env = {"JAX_PLATFORMS": "cuda"} if report["cuda_workers"] > 0 and not report["emulated_gpu"] else {}
        runtime_flags = {"placement": args.placement, "workers": args.workers,  # of jnntile's training runs
                         "fused_attention": args.fused_attention, "scheduler": args.scheduler,
                         "fused_update": args.fused_update}
        tiles = dict(args.tiles)
        if "gemm" in args.only:
            report["gemm"] = measure_gemm(s["gemm"], log, timeout_s, xla_env)
            print_gemm(report["gemm"])
        for section, dtype in (("train", "float32"), ("train_bf16", "bfloat16")):
            if section not in args.only:
                continue
            params = {**s["train"], "model": {**s["train"]["model"], **tiles, "dtype": dtype}, **runtime_flags}
            jn = run_child("train_jnntile", params, timeout_s, log)
            xla = run_child("train_xla", params, timeout_s, log, env=xla_env)
            report[section] = {"jnntile": jn, "xla": xla}
            if "tokens_per_s" in jn and "tokens_per_s" in xla:
                report[section]["ratio"] = jn["tokens_per_s"] / xla["tokens_per_s"]
            print_train(report[section])
        if "variants" in args.only:
            params = {**s["train"], "model": {**s["train"]["model"], **tiles, "dtype": "bfloat16"}, **runtime_flags}
            report["variants"] = measure_variants(params, timeout_s, log, xla_env, s["overhead_count"])
            print_variants(report["variants"])
        if "limited" in args.only:
            params = {**s["train"], "model": {**s["train"]["model"], **tiles}, **runtime_flags}
            report["limited"] = run_child("limited", params, timeout_s, log)
            print_limited(report["limited"])
        if "capacity" in args.only:
            available_mb = _available_mb()
            params = dict(s["capacity"], n_layer=args.capacity_layers if not args.smoke else 2,
                          swap_dir=args.swap_dir or tmp_swap, full=args.capacity_full and not args.smoke,
                          gpu=report["cuda_workers"] > 0,
                          memory_limit_mb=args.memory_limit_mb or max(64, available_mb // 2))
            report["capacity"] = run_child("capacity", params, 3 * timeout_s, log)
            print_capacity(report["capacity"])
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out_path}, child logs: {log_path}")
    failed = [k for k in SECTIONS if isinstance(report.get(k), dict) and "error" in report[k]]
    return 1 if failed else 0


def _tile_setting(text: str) -> tuple[str, int]:
    """An AXIS=SIZE argument of --tiles as the GPT-2 config field and its value."""
    from jnntile.models import TILE_AXES

    axis, _, size = text.partition("=")
    if axis not in TILE_AXES or not size.isdigit() or int(size) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use AXIS=SIZE with AXIS one of {' '.join(TILE_AXES)} and a "
                                         "positive SIZE")
    return f"tile_{axis}", int(size)


def _available_mb() -> int:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) // 1024


# ---- printing ---------------------------------------------------------------------------------------

def print_gemm(result: dict) -> None:
    print(f"tile GEMM vs jnp.dot ({result.get('jax_device', result.get('error'))})")
    for r in result.get("rows", []):
        print(f"  {r['precision']:>7} n={r['n']:>6} tile={r['tile']:>5}: jnntile {r['jnntile_gflops']:10.0f} "
              f"GFLOP/s, XLA {r['xla_gflops']:10.0f} GFLOP/s, ratio {r['ratio']:.2f}")


def print_train(result: dict) -> None:
    jn, xla = result["jnntile"], result["xla"]
    if "error" in jn or "error" in xla:
        print(f"training: jnntile {jn.get('error', 'ok')}, XLA {xla.get('error', 'ok')}")
        return
    print(f"training {jn['config']} batch {jn['batch']}: jnntile {jn['tokens_per_s']:.0f} tokens/s, plain JAX "
          f"{xla['tokens_per_s']:.0f} tokens/s, ratio {result['ratio']:.2f}")
    print("  steps while dmdas calibrates: " + ", ".join(f"{t:.2f}" for t in jn["calibration_step_s"]) + " s")
    print(f"  step {jn['step_s'] * 1e3:.1f} ms, tiles {jn['tiles']}")
    for kind, share in jn["workers"].items():
        per_step_ms = share['busy_s'] / jn['steps'] * 1e3
        print(f"  {kind} workers: {share['tasks'] / jn['steps']:.0f} tasks and {per_step_ms:.1f} ms busy per step"
              f" ({share['task_share']:.0%} of tasks, {share['busy_share']:.0%} of busy time)")
    print("  busiest kernels per step:")
    for k in jn["kernels_per_step"]:
        print(_kernel_line(k))


def _kernel_line(k: dict) -> str:
    """One kernel's tasks and busy time per step on each kind of worker (an entry of kernels_per_step)."""
    return (f"    {k['kernel']:>30}: {k['cuda_tasks']:5.0f} tasks {k['cuda_s'] * 1e3:7.2f} ms on CUDA workers, "
            f"{k['cpu_tasks']:5.0f} tasks {k['cpu_s'] * 1e3:7.2f} ms on CPU workers")


def print_variants(result: dict) -> None:
    xla = result["xla"]
    print(f"bfloat16 training, one setting changed at a time (plain JAX: "
          f"{xla.get('tokens_per_s', 0):.0f} tokens/s{', ' + xla['error'] if 'error' in xla else ''})")
    for name, run in result["runs"].items():
        if "error" in run:
            print(f"  {name:>24}: {run['error']}")
            continue
        cuda = run["workers"].get("CUDA", {})
        print(f"  {name:>24}: {run['tokens_per_s']:8.0f} tokens/s, ratio {run.get('ratio', 0):.2f}, step "
              f"{run['step_s'] * 1e3:6.1f} ms, CUDA workers busy {cuda.get('busy_s', 0) / run['steps'] * 1e3:6.1f} "
              f"ms over {cuda.get('tasks', 0) / run['steps']:.0f} tasks per step")
    alone = result["runs"].get("one kernel at a time", {})
    if "kernels_per_step" in alone:
        print("  each kernel's own time per step (one kernel at a time):")
        for k in alone["kernels_per_step"]:
            print(_kernel_line(k))
    overhead = result["overhead"]
    if "error" in overhead:
        print(f"  StarPU's cost per empty task: {overhead['error']}")
        return
    for scheduler, rows in overhead["us_per_task"].items():
        for workers, row in rows.items():
            print(f"  StarPU per empty task, {scheduler} on {workers} workers: "
                  + ", ".join(f"{kind.replace('_', ' ')} {us:.1f} us" for kind, us in row.items()))


def print_limited(result: dict) -> None:
    if "error" in result:
        print(f"GPU-limited training: {result['error']}")
        return
    moved = ", ".join(f"{k} {v / MB:.0f} MB" for k, v in result["bytes_per_step"].items())
    print(f"training under {result['settings']}: {result['tokens_per_s']:.0f} tokens/s; per step {moved}")


def print_capacity(result: dict) -> None:
    if "error" in result:
        print(f"capacity: {result['error']}")
        return
    moved = ", ".join(f"{k} {v / MB:.0f} MB" for k, v in result["bytes_per_step"].items())
    peaks = ", ".join(f"{k} {v / MB:.0f} MB" for k, v in result["peak_bytes"].items())
    print(f"capacity: {result['n_params'] / 1e9:.2f}B parameters ({result['verdict']}), steps "
          f"{', '.join(f'{t:.1f}' for t in result['step_s'])} s; per step {moved}; peaks {peaks}")


if __name__ == "__main__":
    sys.exit(main())
