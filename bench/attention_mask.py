"""Document masking's cost: a training step's attention (forward and backward) with and without it.

    .venv/bin/python bench/attention_mask.py [--batch 2] [--seq 1024] [--heads 4] [--head-dim 64] [--tile-seq 256]
                                             [--reps 5] [--seed 0]

Same shape, one run, float32 on the CPU workers, a batch row per tile, each the median of --reps jitted steps (after one that
compiles), the three steps taken in turn in each repetition:

a. plain causal attention against document masking of full sequences (one example per row): the goal is a
   ratio of at most 1.05 (the same tasks run; the op only reads the starts when it submits);
b. real packing: examples of lengths drawn between 30 and 1000 tokens packed into the rows (the last one cut
   at the row's end): the time and the attention step tasks against plain causal attention, which the skipped
   (query tile, key tile) pairs save.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jnntile
from jnntile.ops import attention


def packed_segments(rng, batch: int, seq: int) -> np.ndarray:
    """Rows of examples of 30..1000 tokens, numbered 1, 2, ... per row, the last cut at the row's end."""
    segments = np.zeros((batch, seq), np.int32)
    for row in segments:
        t, s = 0, 1
        while t < seq:
            n = int(rng.integers(30, 1001))
            row[t:t + n] = s
            t, s = t + n, s + 1
    return segments


def make_step(qkv, tiles, segments):
    """A jitted value-and-gradient step of sum(attention(qkv)^2), compiled: a function that runs it once and
    returns its seconds and its step tasks."""
    x = jnntile.from_array(qkv, tiles)

    def loss(x):
        documents = None if segments is None else attention.documents(segments, tiles[:2])
        return jnp.sum(jnntile.to_array(attention.causal_attention(x, documents)) ** 2)

    step = jax.jit(jnntile.value_and_grad(loss))

    def tasks():
        codelets = jnntile.runtime.stats()["codelets"]
        return sum(codelets.get(n, {}).get("tasks", 0) for n in ("attention_forward_step", "attention_backward_step"))

    def run():
        before, start = tasks(), time.perf_counter()
        value, grad = step(x)
        jnntile.grad_of(grad).numpy()
        return time.perf_counter() - start, tasks() - before

    run()  # compiles
    return run


def timed(steps: dict, reps: int) -> dict:
    """{name: (median seconds, step tasks)}, the steps taken in turn within each repetition, so that a change in
    the machine's load (other jobs on a shared VM) falls on every variant alike."""
    runs = {name: [] for name in steps}
    for _ in range(reps):
        for name, run in steps.items():
            runs[name].append(run())
    return {name: (statistics.median(s for s, _ in r), r[0][1]) for name, r in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tile-seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    B, T, H, D = args.batch, args.seq, args.heads, args.head_dim
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(np.float32)
    tiles = (1, args.tile_seq, 1, H, D)  # a batch row per tile: pairs are skipped per row
    segments = packed_segments(rng, B, T)
    results = timed({"plain": make_step(qkv, tiles, None), "full": make_step(qkv, tiles, np.ones((B, T), np.int32)),
                     "packed": make_step(qkv, tiles, segments)}, args.reps)
    (plain, plain_tasks), (full, full_tasks), (packed, packed_tasks) = (results[k] for k in ("plain", "full", "packed"))
    lengths = [int(n) for row in segments for n in np.unique(row, return_counts=True)[1]]
    print(f"attention step, B={B} T={T} H={H} D={D} tile_seq={args.tile_seq}, float32, median of {args.reps}")
    print(f"plain causal:                      {plain * 1e3:8.1f} ms  {plain_tasks} step tasks")
    print(f"masked, one example per row:       {full * 1e3:8.1f} ms  {full_tasks} step tasks  "
          f"ratio {full / plain:.3f} (goal <= 1.05)")
    print(f"masked, packed examples {lengths}: {packed * 1e3:8.1f} ms  {packed_tasks} step tasks  "
          f"ratio {packed / plain:.3f}")


if __name__ == "__main__":
    main()
