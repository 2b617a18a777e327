"""The training steps the benchmarks time, and how they time them: jnntile's model and the pure-JAX reference
of its family (GPT-2, Llama).

Both train the same model on the same batch with AdamW and global-norm
clipping under `jax.jit`; the reference donates its parameters and optimizer
state, as best-practice plain JAX does. Each `*_step` returns a callable that
runs one step and returns the loss as a float (the one blocking read).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jnntile.core import distributed
from jnntile.training import optim
from jnntile.models import families, gpt2, llama
from jnntile.models.gpt2 import reference as gpt2_reference
from jnntile.models.llama import reference as llama_reference
from jnntile.training.step import make_steps

LEARNING_RATE = 1e-4
MAX_NORM = 1.0


def reference_of(config):
    """The pure-JAX reference module (init_params, loss) of a config's family."""
    return {gpt2.GPT2Config: gpt2_reference, llama.LlamaConfig: llama_reference}[type(config)]


def random_batch(config, batch_size: int, seq_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, config.vocab_size, (batch_size, seq_len)).astype(np.int32) for _ in range(2))


def jnntile_step(config, batch_size: int, seq_len: int, fused_update: str = "auto"):
    """One jnntile training step per call (`.model` holds the model, for its tiles); `fused_update` as
    `jnntile.step.make_steps` takes it.

    In a distributed run each rank trains on its rows of the batch and the loss is the mean over the ranks.
    """
    idx, targets = (distributed.local_rows(a) for a in random_batch(config, batch_size, seq_len))
    with distributed.sharded_state():  # a run with shard_state=True: each tile of the state on one rank
        model = families.build(config, batch_size=idx.shape[0], seq_len=seq_len)
    tx = optax.chain(optim.clip_by_global_norm(MAX_NORM), optim.adamw(LEARNING_RATE))
    graphdef, params = nnx.split(model, nnx.Param)
    state = {"params": params, "opt": tx.init(params)}
    train_step, _ = make_steps(graphdef, tx, fused_update=fused_update)

    def step() -> float:
        # One micro-batch per step: ids shaped (1, B, T), one dropout seed (none).
        state["params"], state["opt"], loss = train_step(state["params"], state["opt"], idx[None], targets[None],
                                                         [None])
        return distributed.mean_and_any(float(loss), False, "the loss")[0]

    step.model = model
    return step


def xla_step(config, batch_size: int, seq_len: int):
    """One step of the pure-JAX reference per call, parameters and optimizer state donated. A config with
    dtype="bfloat16" computes as plain JAX's usual mixed precision does: float32 parameters and AdamW state,
    every parameter cast to bfloat16 at the start of the loss, so activations and products are bfloat16."""
    reference = reference_of(config)
    idx, targets = random_batch(config, batch_size, seq_len)
    params = reference.init_params(config, 0)
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LEARNING_RATE))
    state = {"params": params, "opt": tx.init(params)}
    compute_dtype = jnp.dtype(config.dtype)

    def loss(params, idx, targets):
        return reference.loss(jax.tree.map(lambda p: p.astype(compute_dtype), params), config, idx, targets)

    def train_step(params, opt_state, idx, targets):
        loss_value, grads = jax.value_and_grad(loss)(params, idx, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_value

    train_step = jax.jit(train_step, donate_argnums=(0, 1))

    def step() -> float:
        state["params"], state["opt"], loss = train_step(state["params"], state["opt"], idx, targets)
        return float(loss)

    return step


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of fn, after one warm-up call (compilation, first transfers)."""
    return min(step_seconds(fn, repeats, warmup=1))


def step_seconds(step, steps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of `steps` calls after `warmup` (compilation, first allocations)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def median_step_seconds(step, steps: int, warmup: int = 2) -> float:
    return statistics.median(step_seconds(step, steps, warmup))
