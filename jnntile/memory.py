"""`python -m jnntile.memory`: what one training step needs in memory, and whether it runs under the limits.

`python -m jnntile.memory --model gpt2 --batch-size 8 --seq-len 1024 --memory-limit-mb 4096` (or --model
llama-1b, ...) prints the table and the verdict of the step the flags describe, with the tiles and recomputation
`python -m jnntile.train` would choose (the planner: jnntile.planning).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jnntile import flags
from jnntile.core import distributed, runtime
from jnntile.models import families
from jnntile.training.optim import OPTIMIZER_STATES
from jnntile.planning import MB, MemoryPlan, fit, plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, batch, tile and runtime flags of a training step (`python -m jnntile.train` takes the same)."""
    parser.add_argument("--model", choices=list(families.PRESETS), default="tiny",
                        help=f"size preset: {families.PRESETS_HELP}")
    for name in ("n-layer", "n-head", "n-embd", "vocab-size", "n-positions"):
        parser.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    parser.add_argument("--dropout", type=float, default=None, help="override the preset")
    flags.add_batch_flags(parser, batch_size=8)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's positions")
    # Taken as train takes them; a packed batch plans as a full one: its layout adds two int32 (B, T) tensors.
    flags.add_example_flags(parser)
    flags.add_execution_flags(parser)
    flags.add_finetune_flags(parser)
    flags.add_runtime_flags(parser)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    flags.add_update_flags(parser)
    parser.add_argument("--ranks", type=int, default=1,
                        help="plan one rank of a run of this many (mpirun -n N): its rows of each batch, and with "
                             "--shard-state its shard of the state, the parameters it fetches and the bytes it "
                             "sends and receives per step (default: 1)")


def config_from_args(args):
    """The config the flags describe (preset, size overrides and tiles)."""
    overrides = families.size_overrides(args.model, max_positions=getattr(args, "n_positions", None))
    if getattr(args, "vocab_size", None) is not None:
        overrides["vocab_size"] = args.vocab_size
    return flags.preset_config(args, **overrides, **flags.execution_settings(args))


def plan_from_args(args) -> MemoryPlan:
    """The plan of the step the flags describe, recomputation and automatic tiles fitted to the limits (see
    `jnntile.planning.fit`); flags that `python -m jnntile.train` refuses are refused alike
    (`flags.check_step_flags`)."""
    flags.check_step_flags(args)
    args = flags.one_batch_per_step(args)
    shards = _shards(args)
    config = config_from_args(args)
    seq_len = args.seq_len if args.seq_len is not None else config.max_positions
    if seq_len > config.max_positions:  # as python -m jnntile.train does: the positions grow to the sequence
        config = dataclasses.replace(config, **families.size_overrides(args.model, max_positions=seq_len))
    limits = flags.limits(args, what_if=True)
    rows = distributed.DEFAULT_OWNERSHIP.batch_rows(args.batch_size, 0, args.ranks)  # every rank's as many
    spec, note = fit(flags.step_spec(args, config, seq_len=seq_len, batch_size=rows.stop - rows.start,
                                     shards=shards), limits)
    memory_plan = plan(spec, workers=limits.workers, gpu_mb=limits.gpu_mb)
    memory_plan.tiles_note = note
    return memory_plan


def _shards(args) -> int:
    """The ranks the state is sharded across (1: not sharded), from --ranks and --shard-state."""
    if args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks}: give the number of ranks, at least 1")
    if not args.shard_state:
        return 1
    if args.ranks == 1:
        raise ValueError("--shard-state shards the training state across ranks, and --ranks is 1: give --ranks N, "
                         "the ranks mpirun starts, or leave --shard-state out")
    return args.ranks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jnntile.memory",
                                     description="What one training step needs in memory, and whether it "
                                                 "runs on the GPU, in RAM or with disk swap under the limits.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        memory_plan = plan_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    limits = flags.limits(args, what_if=True)
    limit, swap_mb, gpu_mb = limits.memory_limit_mb, limits.swap_mb, limits.gpu_mb
    config = memory_plan.config
    print(f"{config.describe()} ({args.model}), {args.optimizer}")
    if memory_plan.tiles_note:
        print(memory_plan.tiles_note)
    print(memory_plan.table())
    gpu = f"GPU memory {gpu_mb} MB, " if gpu_mb else ""
    swap = f" and {swap_mb} MB of swap" if swap_mb else ""
    verdict = memory_plan.verdict(limits)
    print(f"{gpu}memory limit {limit} MB{swap}: {verdict}")
    if memory_plan.shards > 1:
        fetches = ("the parameters it reads, fetched once from their owners and kept until written"
                   if memory_plan.keep_fetched else
                   "the parameters of each op that reads them, from their owners (forward and backward)")
        print(f"per step this rank sends {memory_plan.sent / MB:,.1f} MB and receives {memory_plan.received / MB:,.1f} "
              f"MB: {fetches}, and the gradients, summed up to their owners")
    if verdict.startswith("needs") and memory_plan.shards == 1:  # swap traffic of a shard: not modelled
        written, read = memory_plan.swap_traffic(limit, args.grad_clip > 0)
        how = {"after": "the update after the backward", "fused": "the update fused into the backward",
               "speculative": "the update fused into the backward, speculative until the norm is known "
                              "(when it does not clip)"}[memory_plan.update]
        print(f"swap traffic per step, predicted: {written / MB:,.0f} MB written and {read / MB:,.0f} MB read, "
              f"with {how}")
    backend = args.swap_backend or runtime.config().swap_backend
    if verdict.startswith("needs") and backend == "unistd":
        print(f"swap backend unistd: the kernel's page cache may also hold up to "
              f"{memory_plan.swap_needed_mb(limit, gpu_mb)} MB of the swap in RAM (unistd_o_direct bypasses it)")
    return 1 if verdict.startswith("cannot run") else 0


if __name__ == "__main__":
    sys.exit(main())
