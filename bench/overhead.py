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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20000, help="tasks per measurement")
    parser.add_argument("--schedulers", nargs="+", choices=SCHEDULERS, default=SCHEDULERS)
    args = parser.parse_args()
    default = jnntile.runtime.resolved_scheduler(jnntile.runtime.config())
    print(f"{'scheduler':>10} {'workers':>8} " + " ".join(f"{kind.replace('_', ' '):>12}" for kind in KINDS)
          + "   (us per empty task)")
    for scheduler in args.schedulers:
        jnntile.runtime.start(scheduler=scheduler)
        on = [False] + ([True] if jnntile.runtime.cuda_worker_count() > 0 else [])
        for on_cuda in on:
            row = []
            for kind in KINDS:
                kind = getattr(_xla_ffi.EmptyTasks, kind)
                _xla_ffi.measure_empty_tasks(min(500, args.count), kind, on_cuda)  # warm-up, calibration
                row.append(_xla_ffi.measure_empty_tasks(args.count, kind, on_cuda) * 1e6)
            mark = "  (default)" if scheduler == default else ""
            print(f"{scheduler:>10} {'CUDA' if on_cuda else 'CPU':>8} " + " ".join(f"{us:12.2f}" for us in row)
                  + mark, flush=True)
        jnntile.runtime.stop()


if __name__ == "__main__":
    main()
