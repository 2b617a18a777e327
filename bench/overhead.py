"""StarPU's cost of a task, per scheduler: empty tasks (one-float tiles, kernels that do nothing).

    .venv/bin/python bench/overhead.py [--count 20000] [--schedulers eager lws dmdas ...]
    .venv-cuda/bin/python bench/overhead.py          # on a GPU machine: CUDA workers too

Three columns of microseconds per task:
  round trip   one task at a time, each waited for: submission to completion, as a blocking read pays
  chain        all submitted at once on one tile, each waiting for the one before: what a chain of ops
               (a model's forward, then its backward) pays between two kernels on top of their run time
  independent  all submitted at once, each on a tile of its own: how many tasks per second the workers take
On CPU workers, then (with a CUDA worker) on CUDA workers: there a task still launches nothing, so the chain
column is StarPU's gap between dependent kernels on the GPU.
"""

import argparse

import jnntile
from jnntile import _xla_ffi

SCHEDULERS = ["eager", "lws", "ws", "prio", "dmda", "dmdas"]
KINDS = ("round_trip", "chain", "independent")


def measure(scheduler: str, count: int) -> dict[str, dict[str, float]]:
    """Microseconds per empty task of each kind (KINDS) under `scheduler`, on CPU workers and, where the runtime
    has one, on a CUDA worker: {"CPU": {kind: us}, "CUDA": {...}}."""
    jnntile.runtime.start(scheduler=scheduler)
    rows = {}
    for on_cuda in [False] + ([True] if jnntile.runtime.cuda_worker_count() > 0 else []):
        row = rows["CUDA" if on_cuda else "CPU"] = {}
        for name in KINDS:
            kind = getattr(_xla_ffi.EmptyTasks, name)
            _xla_ffi.measure_empty_tasks(min(500, count), kind, on_cuda)  # warm-up, calibration
            row[name] = _xla_ffi.measure_empty_tasks(count, kind, on_cuda) * 1e6
    jnntile.runtime.stop()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20000, help="tasks per measurement")
    parser.add_argument("--schedulers", nargs="+", choices=SCHEDULERS, default=SCHEDULERS)
    args = parser.parse_args()
    default = jnntile.runtime.resolved_scheduler(jnntile.runtime.config())
    print(f"{'scheduler':>10} {'workers':>8} " + " ".join(f"{kind.replace('_', ' '):>12}" for kind in KINDS)
          + "   (us per empty task)")
    for scheduler in args.schedulers:
        for workers, row in measure(scheduler, args.count).items():
            mark = "  (default)" if scheduler == default else ""
            print(f"{scheduler:>10} {workers:>8} " + " ".join(f"{row[kind]:12.2f}" for kind in KINDS) + mark,
                  flush=True)


if __name__ == "__main__":
    main()
