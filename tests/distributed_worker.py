"""A small GPT-2 trained data parallel: run by tests/test_distributed.py under mpirun, and in-process as the
single-process reference (`train`).

    mpirun -n N python tests/distributed_worker.py OUT [--steps S] [--signal KILL|STOP --at-step K --on-rank R]

Every rank writes OUT/rank<r>.npz: the losses (the mean over the ranks), its parameters, the tile bytes it
sent, the tasks its CUDA workers ran, the CPU its process used per second while idle after training, and the
errors that gradients not summed, and summed twice, gave.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

BATCH, SEQ, MICRO_BATCHES = 12, 8, 2  # rows split by 2, 3 and 4 ranks
LEARNING_RATE = 1e-2
# Uneven tiles (vocabulary 97 in tiles of 40, width 24 in tiles of 16): an odd number of gradient tiles, so
# reduction roots do not fall evenly on the ranks.
CONFIG = dict(n_layer=2, n_head=2, n_embd=24, vocab_size=97, n_positions=SEQ, tile_embd=16, tile_vocab=40,
              tile_hidden=48)


def train(steps: int, before_step=lambda step: None):
    """Losses and parameters of `steps` steps: this rank's rows of each batch, the loss averaged over the ranks."""
    import optax
    from flax import nnx

    import jnntile
    from jnntile.core import distributed
    from jnntile.training import optim
    from jnntile.models import gpt2
    from jnntile.models.gpt2.config import GPT2Config
    from jnntile.training.step import make_steps

    ranks = jnntile.runtime.world_size()
    with distributed.sharded_state():  # with --shard-state: each tile of the parameters on one rank
        model = gpt2.GPT2(GPT2Config(**CONFIG), batch_size=BATCH // ranks, seq_len=SEQ, seed=3)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optim.clip_by_global_norm(0.5), optim.adamw(LEARNING_RATE))
    opt_state = tx.init(params)
    train_step, _ = make_steps(graphdef, tx, MICRO_BATCHES)
    rng = np.random.default_rng(0)  # the same batches on every rank, each takes its rows
    losses = []
    for step in range(steps):
        idx, targets = (rng.integers(0, CONFIG["vocab_size"], (MICRO_BATCHES, BATCH, SEQ)).astype(np.int32)
                        for _ in range(2))
        before_step(step)
        params, opt_state, loss = train_step(params, opt_state, distributed.local_rows(idx, axis=1),
                                             distributed.local_rows(targets, axis=1), [np.int32(0)] * MICRO_BATCHES)
        losses.append(distributed.mean_and_any(float(loss), False, "the loss")[0])
    nnx.update(model, params)
    return np.array(losses), {name: p.get_value().numpy() for name, p in model.named_params().items()}


def _misuse_errors() -> list[str]:
    """What adamw says to gradients of this rank alone, and allreduce_sum to gradients summed already."""
    import jnntile
    from jnntile.training import optim
    from jnntile.ops import elementwise as ew

    w = jnntile.from_array(np.ones((4, 4), np.float32), (2, 2))
    _, grads = jnntile.value_and_grad(lambda w: jnntile.to_array(ew.gelu_tanh(w)).sum())(w)
    errors = []
    adamw = optim.adamw(LEARNING_RATE)
    try:
        adamw.update(grads, adamw.init(w), w)
    except ValueError as e:
        errors.append(str(e))
    summed, _ = optim.allreduce_sum().update(grads, None)  # every rank sums, as it must
    try:
        optim.allreduce_sum().update(summed, None)
    except ValueError as e:
        errors.append(str(e))
    jnntile.runtime.wait_all()
    return errors


def _idle_cpu_per_s() -> float:
    time.sleep(0.3)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--signal", choices=["KILL", "STOP"])
    p.add_argument("--at-step", type=int, default=2)
    p.add_argument("--on-rank", type=int, default=1)
    p.add_argument("--watchdog-s", type=float, default=60)
    p.add_argument("--shard-state", action="store_true")
    p.add_argument("--keep-fetched", action="store_true")
    args = p.parse_args()

    import jnntile

    jnntile.runtime.start(distributed=True, workers=1, watchdog_s=args.watchdog_s, shard_state=args.shard_state,
                          shard_keep_fetched=args.keep_fetched)
    rank = jnntile.runtime.rank()

    def before_step(step):
        if args.signal and step == args.at_step and rank == args.on_rank:
            os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))

    losses, params = train(args.steps, before_step)
    jnntile.runtime.wait_all()
    stats = jnntile.runtime.stats()
    cuda_tasks = sum(codelet["cuda_tasks"] for codelet in stats["codelets"].values())
    np.savez(Path(args.out) / f"rank{rank}.npz", losses=losses, sent=stats["mpi_bytes_sent"], cuda_tasks=cuda_tasks,
             idle_cpu_per_s=_idle_cpu_per_s(), misuse_errors=_misuse_errors(),
             **{f"param:{k}": v for k, v in params.items()})


if __name__ == "__main__":
    sys.exit(main())
