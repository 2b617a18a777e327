"""Data-parallel training on several ranks of this machine: tokens/s, bytes sent per step, the CPU of
StarPU-MPI's progression thread, and the two reduction schedules (tree, ring); with --shard-state, sharded
state against replicated at the same ranks (the most RAM StarPU held per rank, besides).

    .venv/bin/python bench/multinode.py [--repeats 2] [--steps 6] [--json] [--shard-state [--no-limit]
                                        [--keep-fetched]] [--tcp]
    .venv/bin/python bench/multinode.py --large [--steps 2] [--swap-dir DIR]

One model, one global batch, every configuration in processes of its own: one process with 1 and with 2
CPU workers, then 2 and 3 ranks under mpirun with one CPU worker each (--oversubscribe: 3 ranks share 2
cores here). Configurations run interleaved, --repeats times, and the table gives medians: the machine is
shared, so compare within one run. Bytes are the tile bytes a rank sends per step (mean over ranks), next
to what docs/distributed.md predicts, 2 (N-1)/N times the gradient bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(n_layer=4, n_head=4, n_embd=256, vocab_size=4096, n_positions=128)
BATCH, SEQ = 6, 128
# --shard-state --model: the default's model; one whose state (16 bytes a parameter) outweighs its activations;
# GPT-2 124M's shape, as (GPT-2 config, sequence length).
SHARDED_MODELS = {"default": (MODEL, SEQ),
                  "state": (dict(n_layer=16, n_head=8, n_embd=512, vocab_size=8192, n_positions=32, tile_vocab=1024), 32),
                  "124m": (dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=128), 128),
                  "large": (dict(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257, n_positions=128), 128)}
# --large: GPT-2 large's shape on 4 sharded ranks, each under this limit with no swap, against one process under
# the same limit with disk swap (its 12.4 GB of state do not fit).
LARGE_RANKS, LARGE_LIMIT_MB = 4, 4000
# (ranks, CPU workers per rank, allreduce schedule); the two schedules route 2 ranks the same way.
CONFIGS = [(1, 1, "tree"), (1, 2, "tree"), (2, 1, "tree"), (3, 1, "tree"), (3, 1, "ring")]
# --shard-state: (ranks, CPU workers per rank, schedule, sharded), replicated and sharded at each rank count.
SHARDED_BATCH = 4  # split by 2 and 4 ranks


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by this process's threads, by thread name (StarPU names its own)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        kind = "MPI" if name == "MPI" else "workers" if name.startswith("CPU ") else "other"
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def measure(workers: int, schedule: str, steps: int, shard_state: bool = False, batch: int = BATCH,
            model: str = "default", limit_mb: int = 0, swap_dir: str = "", warmup: int = 2,
            keep_fetched: bool = False) -> dict:
    """Runs on every rank: this rank's numbers for `steps` steps after `warmup` steps. Runs are under `limit_mb`
    when given (-1: no limit), else sharded ones under their share of the state + 20%; `swap_dir`: disk swap
    there; `keep_fetched`: sharded ranks keep the parameters they fetch until written."""
    import jnntile
    from jnntile.core import distributed
    from jnntile.models.gpt2.config import GPT2Config
    from steps import jnntile_step, step_seconds

    several = distributed.launched_ranks() > 1
    sizes, seq = SHARDED_MODELS[model]
    config = GPT2Config(dropout=0.0, **sizes)
    state_bytes = 16 * config.n_params()  # parameters, gradients, AdamW's two moments, float32
    # Sharded state runs under a memory limit of its share of the state plus 20% (the goal), with no
    # swap: StarPU then frees what it would keep cached for reuse, and the run shows whether the share fits.
    limit = {"memory_limit_mb": math.ceil(1.2 * state_bytes / distributed.launched_ranks() / 2**20)} \
        if shard_state and several else {}
    if limit_mb:
        limit = {"memory_limit_mb": limit_mb} if limit_mb > 0 else {}
    swap = {"swap_dir": swap_dir, "swap_size_mb": math.ceil(1.5 * state_bytes / 2**20)} if swap_dir else {}
    jnntile.runtime.start(distributed=several, workers=workers, allreduce=schedule,
                          shard_state=shard_state and several, shard_keep_fetched=keep_fetched and shard_state and several,
                          **limit, **swap)
    rss_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step = jnntile_step(config, batch, seq)
    for _ in range(warmup):
        step()
    jnntile.runtime.wait_all()
    jnntile.runtime.reset_peaks()  # the peak of the measured steps, not of the start
    sent, cpu, started = jnntile.runtime.stats()["mpi_bytes_sent"], _thread_cpu_s(), time.perf_counter()
    swap_before = jnntile.runtime.swap_bytes()
    times = step_seconds(step, steps, warmup=0)
    jnntile.runtime.wait_all()
    wall = time.perf_counter() - started
    cpu_after = _thread_cpu_s()
    params = sum(p.get_value().size for p in step.model.named_params().values())
    ram = next(node for node in jnntile.runtime.stats()["nodes"] if node["kind"] == "RAM")
    return {"rank": jnntile.runtime.rank(), "tokens_per_s": batch * seq / statistics.median(times),
            "peak_ram_bytes": ram["peak_used_bytes"], "state_bytes": state_bytes,
            "rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_at_start,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": statistics.median(times),
            "swap_read_bytes_per_step": (jnntile.runtime.swap_bytes()[1] - swap_before[1]) / steps,
            "memory_limit_mb": limit.get("memory_limit_mb", 0),
            "bytes_sent_per_step": (jnntile.runtime.stats()["mpi_bytes_sent"] - sent) / steps,
            "gradient_bytes": 4 * params,
            **{f"{kind}_cores": (cpu_after[kind] - cpu.get(kind, 0.0)) / wall for kind in cpu_after}}


def run(ranks: int, workers: int, schedule: str, steps: int, shard_state: bool = False, batch: int = BATCH,
        model: str = "default", tcp: bool = False, limit_mb: int = 0, swap_dir: str = "",
        warmup: int = 2, keep_fetched: bool = False) -> list[dict]:
    """Every rank's numbers for one configuration, each in processes of its own; with `tcp`, Open MPI's ranks
    talk through TCP alone, as between machines (its ob1 layer with the tcp and self transports: no shared
    memory)."""
    here = os.path.dirname(os.path.abspath(__file__))
    results = Path(tempfile.mkdtemp(prefix="multinode-"))
    worker = [sys.executable, os.path.abspath(__file__), "--worker", str(workers), schedule, results,
              "--steps", str(steps), "--batch", str(batch), "--model", model, "--limit-mb", str(limit_mb),
              "--warmup", str(warmup)] + (["--shard-state"] if shard_state else []) + \
        (["--keep-fetched"] if keep_fetched else []) + \
        (["--swap-dir", swap_dir] if swap_dir else [])
    if ranks == 1:
        argv = worker
    else:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise SystemExit("mpirun not found: apt-get install openmpi-bin (make test installs it)")
        argv = [mpirun, "-n", str(ranks), "--oversubscribe", "--bind-to", "none",
                *(["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"] if tcp else []),
                *(["--allow-run-as-root"] if os.geteuid() == 0 else []), *worker]
    result = subprocess.run(list(map(str, argv)), capture_output=True, text=True, cwd=here)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} failed:\n{result.stderr[-3000:]}")
    out = [json.loads((results / f"rank{r}.json").read_text()) for r in range(ranks)]
    shutil.rmtree(results)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", action="store_true")
    p.add_argument("--tcp", action="store_true", help="ranks talk through TCP alone, as between machines (Open "
                   "MPI's shared-memory transport off)")
    p.add_argument("--shard-state", action="store_true", help="sharded state against replicated instead")
    p.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    p.add_argument("--model", choices=sorted(SHARDED_MODELS), default="default",
                   help="with --shard-state: the model (state: one whose state outweighs its activations; 124m)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="with --shard-state: the rank counts")
    p.add_argument("--large", action="store_true", help=f"GPT-2 large's shape on {LARGE_RANKS} sharded ranks under "
                   f"{LARGE_LIMIT_MB} MB each, no swap, against one process under {LARGE_LIMIT_MB} MB with disk swap")
    p.add_argument("--swap-dir", default=tempfile.gettempdir(), help="with --large: where the one process swaps")
    p.add_argument("--no-limit", action="store_true", help="with --shard-state: sharded runs without a memory "
                   "limit (for speed alone)")
    p.add_argument("--keep-fetched", action="store_true", help="with --shard-state: sharded ranks keep the "
                   "parameters they fetch until written (runtime setting shard_keep_fetched)")
    p.add_argument("--limit-mb", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs=3, metavar=("WORKERS", "SCHEDULE", "RESULTS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        workers, schedule, results = args.worker
        result = measure(int(workers), schedule, args.steps, args.shard_state, args.batch, args.model, args.limit_mb,
                         args.swap_dir if args.limit_mb > 0 and not args.shard_state else "", args.warmup,
                         args.keep_fetched)
        (Path(results) / f"rank{result['rank']}.json").write_text(json.dumps(result))
        return
    if args.large:
        compare_large(args)
        return
    if args.shard_state:
        compare_sharded(args)
        return

    runs: dict[tuple, list[list[dict]]] = {config: [] for config in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            runs[config].append(run(*config, args.steps, tcp=args.tcp))
    rows = []
    for (ranks, workers, schedule), repeats in runs.items():
        gradient_bytes = repeats[0][0]["gradient_bytes"]

        def mean(key):  # over the ranks of a run, then the median over runs
            return statistics.median(statistics.mean(rank.get(key, 0.0) for rank in ranks_) for ranks_ in repeats)

        rows.append({"ranks": ranks, "workers_per_rank": workers, "schedule": schedule if ranks > 2 else "-",
                     "tokens_per_s": statistics.median(rs[0]["tokens_per_s"] for rs in repeats),
                     "mb_sent_per_step_per_rank": mean("bytes_sent_per_step") / 2**20,
                     "mb_predicted": 2 * (ranks - 1) / ranks * gradient_bytes / 2**20,
                     "mpi_thread_cores": mean("MPI_cores"), "worker_cores": mean("workers_cores"),
                     "gradient_mb": gradient_bytes / 2**20})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"GPT-2 {MODEL}, global batch {BATCH} x {SEQ}, gradients {rows[0]['gradient_mb']:.1f} MB; medians of "
          f"{args.repeats} interleaved runs of {args.steps} steps")
    print(f"{'ranks':>5} {'workers':>7} {'schedule':>8} {'tokens/s':>9} {'MB sent/step/rank':>18} {'predicted':>9} "
          f"{'MPI thread cores':>16} {'worker cores':>12}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['workers_per_rank']:>7} {r['schedule']:>8} {r['tokens_per_s']:>9.0f} "
              f"{r['mb_sent_per_step_per_rank']:>18.2f} {r['mb_predicted']:>9.2f} {r['mpi_thread_cores']:>16.2f} "
              f"{r['worker_cores']:>12.2f}")


def compare_sharded(args) -> None:
    """Replicated against sharded state at --ranks (2 and 4): tokens/s, the most RAM StarPU held per rank (the
    largest rank's), the bytes sent per step and rank against docs/distributed.md's 3 (N-1)/N of the
    parameter bytes (data parallel, and sharded ranks keeping what they fetch: 2 (N-1)/N)."""
    configs = [(1, False)] + [(ranks, sharded) for ranks in args.ranks for sharded in (False, True)]
    runs: dict[tuple, list[list[dict]]] = {config: [] for config in configs}
    for _ in range(args.repeats):
        for ranks, sharded in configs:
            runs[(ranks, sharded)].append(run(ranks, 1, "tree", args.steps, sharded, SHARDED_BATCH, args.model, args.tcp,
                                              limit_mb=-1 if args.no_limit else 0, keep_fetched=args.keep_fetched))
    rows = []
    for (ranks, sharded), repeats in runs.items():
        param_bytes = repeats[0][0]["gradient_bytes"]
        rows.append({"ranks": ranks, "sharded": sharded,
                     "tokens_per_s": statistics.median(rs[0]["tokens_per_s"] for rs in repeats),
                     "peak_ram_mb": statistics.median(max(r["peak_ram_bytes"] for r in rs) for rs in repeats) / 2**20,
                     "rss_growth_mb": statistics.median(max(r["rss_growth_bytes"] for r in rs) for rs in repeats) / 2**20,
                     "memory_limit_mb": repeats[0][0]["memory_limit_mb"],
                     "mb_sent_per_step_per_rank": statistics.median(
                         statistics.mean(r["bytes_sent_per_step"] for r in rs) for rs in repeats) / 2**20,
                     "mb_predicted": (3 if sharded and not args.keep_fetched else 2) * (ranks - 1) / ranks
                                     * param_bytes / 2**20,
                     "state_mb": repeats[0][0]["state_bytes"] / 2**20})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    sizes, seq = SHARDED_MODELS[args.model]
    print(f"GPT-2 {sizes}, global batch {SHARDED_BATCH} x {seq}, state {rows[0]['state_mb']:.1f} MB (parameters, gradients, "
          f"AdamW moments); medians of {args.repeats} interleaved runs of {args.steps} steps")
    print("peak RAM: the most StarPU held (the largest rank's), which keeps freed tiles cached for reuse unless a "
          "limit needs them; " + ("no run had a limit" if args.no_limit else "sharded runs ran under a limit of "
          "their share of the state + 20%, with no swap") + ". RSS "
          "growth: the process's peak RSS less its RSS once the runtime started (JAX and the libraries)")
    print(f"{'ranks':>5} {'state':>10} {'limit MB':>8} {'tokens/s':>9} {'peak RAM MB/rank':>17} {'RSS growth MB':>13} "
          f"{'MB sent/step/rank':>18} {'predicted':>9}")
    for r in rows:
        print(f"{r['ranks']:>5} {'sharded' if r['sharded'] else 'replicated':>10} {r['memory_limit_mb'] or '-':>8} "
              f"{r['tokens_per_s']:>9.0f} {r['peak_ram_mb']:>17.1f} {r['rss_growth_mb']:>13.1f} "
              f"{r['mb_sent_per_step_per_rank']:>18.2f} {r['mb_predicted']:>9.2f}")


def compare_large(args) -> None:
    """GPT-2 large's shape (774M parameters, 12.4 GB of float32 state with AdamW), global batch 4 x 128: on
    LARGE_RANKS sharded ranks under LARGE_LIMIT_MB each with no swap, then in one process under the same limit
    with disk swap under --swap-dir. One warm-up step (the model's first step), then --steps steps."""
    swap_root = tempfile.mkdtemp(prefix="multinode-large-", dir=args.swap_dir)
    try:
        configs = {f"{LARGE_RANKS} sharded ranks, no swap": run(LARGE_RANKS, 1, "tree", args.steps, True, 4, "large",
                                                                args.tcp, LARGE_LIMIT_MB, warmup=1),
                   "1 process, disk swap": run(1, 2, "tree", args.steps, False, 4, "large", False, LARGE_LIMIT_MB,
                                               swap_root, warmup=1)}
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)
    rows = [{"run": name, "step_s": max(r["step_s"] for r in ranks), "tokens_per_s": 4 * 128 / max(r["step_s"] for r in ranks),
             "peak_rss_mb": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
             "peak_ram_mb": max(r["peak_ram_bytes"] for r in ranks) / 2**20,
             "swap_read_mb_per_step": max(r["swap_read_bytes_per_step"] for r in ranks) / 2**20,
             "mb_sent_per_step_per_rank": statistics.mean(r["bytes_sent_per_step"] for r in ranks) / 2**20,
             "state_mb": ranks[0]["state_bytes"] / 2**20} for name, ranks in configs.items()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"GPT-2 large's shape, global batch 4 x 128, state {rows[0]['state_mb']:.0f} MB; every process under "
          f"{LARGE_LIMIT_MB} MB; median of {args.steps} steps after one; the largest rank's figures")
    print(f"{'run':>28} {'s/step':>7} {'tokens/s':>8} {'peak RSS MB':>11} {'StarPU peak MB':>14} {'swap read MB/step':>17} "
          f"{'MB sent/step/rank':>17}")
    for r in rows:
        print(f"{r['run']:>28} {r['step_s']:>7.1f} {r['tokens_per_s']:>8.1f} {r['peak_rss_mb']:>11.0f} {r['peak_ram_mb']:>14.0f} "
              f"{r['swap_read_mb_per_step']:>17.0f} {r['mb_sent_per_step_per_rank']:>17.0f}")


if __name__ == "__main__":
    main()
