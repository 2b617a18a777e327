"""StarPU per-task overhead: an empty task from submission to completion, per scheduler.

    .venv/bin/python bench/overhead.py [--count 20000]
"""

import argparse

import jnntile
from jnntile import _xla_ffi

SCHEDULERS = ["eager", "lws", "ws", "prio", "dmda"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20000)
    args = parser.parse_args()
    default = jnntile.runtime.resolved_scheduler(jnntile.runtime.config())
    print(f"{'scheduler':>10} {'us per empty task':>18}")
    for scheduler in SCHEDULERS:
        jnntile.runtime.start(scheduler=scheduler)
        _xla_ffi.measure_empty_task_latency(500)  # warm-up
        latency = _xla_ffi.measure_empty_task_latency(args.count)
        mark = "  (default)" if scheduler == default else ""
        print(f"{scheduler:>10} {latency * 1e6:18.2f}{mark}")
        jnntile.runtime.stop()


if __name__ == "__main__":
    main()
