"""Training-step throughput: jnntile GPT-2 vs the pure-JAX reference under jit (XLA CPU), same run.

    .venv/bin/python bench/train.py [--model tiny] [--batch-size 8] [--seq-len 128] [--steps 20]

Both run AdamW + global-norm clipping on the same batch shape; prints tokens/s
(median over steps after a warm-up) and the ratio jnntile / XLA.
"""

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import jnntile
from jnntile import optim
from jnntile.models import gpt2, gpt2_reference
from jnntile.models.config import PRESETS, GPT2Config
from jnntile.train import make_steps


def median_step_seconds(step, steps):
    times = []
    for i in range(steps + 2):  # two warm-up steps: compilation, first allocations
        start = time.perf_counter()
        step(i)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(PRESETS), default="tiny")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    config = GPT2Config.preset(args.model, vocab_size=args.vocab_size, n_positions=max(args.seq_len, 256))
    B, T = args.batch_size, args.seq_len
    rng = np.random.default_rng(0)
    idx = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)

    model = gpt2.GPT2(config, batch_size=B, seq_len=T)
    tiles = model.tiles
    tx = optax.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-4))
    graphdef, params = nnx.split(model, nnx.Param)
    state = {"params": params, "opt": tx.init(params)}
    train_step, _ = make_steps(graphdef, tx)

    def jnntile_step(i):
        # One micro-batch per step: ids shaped (1, B, T), one dropout seed (none).
        state["params"], state["opt"], loss = train_step(state["params"], state["opt"], idx[None], targets[None],
                                                         [None])
        float(loss)

    ref_params = gpt2_reference.init_params(config, 0)
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    ref_state = {"params": ref_params, "opt": ref_tx.init(ref_params)}

    @jax.jit
    def reference_train_step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: gpt2_reference.loss(p, config, idx, targets))(params)
        updates, opt_state = ref_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def reference_step(i):
        ref_state["params"], ref_state["opt"], loss = reference_train_step(ref_state["params"], ref_state["opt"])
        float(loss)

    tokens = B * T
    jn = median_step_seconds(jnntile_step, args.steps)
    xla = median_step_seconds(reference_step, args.steps)
    print(f"GPT-2 {args.model} ({config.n_params() / 1e6:.2f}M params), batch {B}x{T}, tiles {tiles}, "
          f"{jnntile.runtime.config().workers} workers, OpenBLAS {jnntile.runtime.blas_core()}")
    print(f"{'':>10} {'ms/step':>9} {'tokens/s':>10}")
    print(f"{'jnntile':>10} {jn * 1e3:9.1f} {tokens / jn:10.0f}")
    print(f"{'XLA':>10} {xla * 1e3:9.1f} {tokens / xla:10.0f}")
    print(f"ratio jnntile/XLA throughput: {xla / jn:.2f}")


if __name__ == "__main__":
    main()
