"""The training step of the library: `make_steps` builds the jitted training and evaluation steps over the
trained parameters' state, with gradient accumulation, the fused update and data parallel; `step_batch` and
`dropout_seeds` give a step's batch and seeds as pure functions of (seed, step), which is what makes a resumed
run bit-identical. `python -m jnntile.train` calls these as any user would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jnntile.core import runtime
from jnntile.training import optim
from jnntile.core.grad import mark_computed, value_and_grad
from jnntile.core.tensor import pack
from jnntile.ops import values


def make_steps(graphdef, tx, grad_accum_steps: int = 1, fused_update: str = "auto"):
    """The training and evaluation steps over (params, opt_state), the trained parameters' state.

    `train_step(params, opt_state, idx, targets, dropout_seeds, frozen)` takes the
    token ids of a whole step, shaped (grad_accum_steps, B, T), one dropout
    seed per micro-batch, and the frozen parameters' state (None when
    everything trains): those are read, never differentiated. Each micro-batch adds its gradients, scaled by
    1/grad_accum_steps, into the tiled gradients (the first starts them at
    zero); the last one also applies `tx`, so clipping and the update see the
    mean gradient of the whole batch. Returns the new (params, opt_state) and
    the mean loss of the micro-batches; nothing blocks until the caller reads
    the loss.

    With `tx` an `optax.chain` of jnntile's (an optional clip, then adamw or sgd),
    the parameters are updated in the last micro-batch's backward as soon as
    their gradients are final, so those gradients never reach swap
    (`jnntile.optim.FusedUpdate`), when `fused_update` ("auto", "on", "off":
    `jnntile.optim.update_mode`) says so; under "auto", a step after one whose
    norm clipped updates after the backward. Every mode gives the same bits.

    In a distributed run (`runtime.world_size()` N > 1) each rank
    passes its own rows of the step's batch (`jnntile.distributed.local_rows`)
    and its own dropout seeds: the gradients are scaled by 1/N more and summed
    over the ranks (`jnntile.optim.allreduce_sum`) before `tx`, so every rank
    applies the update of the whole batch. The loss returned is this rank's;
    `jnntile.distributed.mean_and_any` averages it over the ranks.
    """
    scale = 1.0 / (grad_accum_steps * runtime.world_size())
    summed = optim.allreduce_sum()

    def gradients(params, grads, idx, targets, dropout_seed, frozen, on_final=None):
        return value_and_grad(lambda p: merged(graphdef, p, frozen).loss(idx, targets, dropout_seed),
                                      accumulate=grads, scale=scale, on_final=on_final)(params)

    # The parameters, the optimizer state and the frozen weights cross each jitted call packed behind one
    # token (jnntile.tensor.Packed: JAX's dispatch would take 40-50 ms per step over their leaves).

    # The micro-batches before the last: compiled twice, without earlier gradients and with them.
    @jax.jit
    def add_gradients(packed, grads, idx, targets, dropout_seed):
        params, _, frozen = packed.unpack()
        return gradients(params, grads, idx, targets, dropout_seed, frozen)

    # The last micro-batch and the update in one program: a step without accumulation stays the one
    # program it was, and the update's tasks are submitted right after the last backward's (or in it).
    @functools.partial(jax.jit, static_argnames="setting")
    def last_and_update(packed, grads, idx, targets, dropout_seed, setting):
        params, opt_state, frozen = packed.unpack()
        fused = optim.fused_update(opt_state, params, setting)
        on_final = fused if fused is not None and fused.mode != "after" else None
        loss, grads = gradients(params, grads, idx, targets, dropout_seed, frozen, on_final=on_final)
        if fused is None:
            grads, _ = summed.update(grads, summed.init(params), params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return pack((optax.apply_updates(params, updates), opt_state)), loss, None
        updates, opt_state = fused.finish(grads)
        return pack((optax.apply_updates(params, updates), opt_state)), loss, fused.norm

    # The global norm of the step before: under "auto", a step after one whose norm clipped updates after the
    # backward instead of speculating (the same bits; a speculative update that clips moves more bytes, and
    # a norm that clipped tends to clip again: jnntile.optim.clipped).
    last_norm = [None]

    def train_step(params, opt_state, idx, targets, dropout_seeds, frozen=None):
        grads, losses = None, []
        state = pack((params, opt_state, frozen))  # every micro-batch's program takes the same state
        for k in range(grad_accum_steps - 1):
            loss, grads = add_gradients(state, grads, idx[k], targets[k], dropout_seeds[k])
            # Run compiled, it told the ledger nothing: a trace of last_and_update made now (a setting not
            # compiled yet) would find these gradients consumed by the update of the step before.
            mark_computed(grads)
            losses.append(loss)
        setting = fused_update
        if setting == "auto" and last_norm[0] is not None and optim.speculates(opt_state, setting):
            setting = "off" if optim.clipped(opt_state, last_norm[0]) else setting
        packed, loss, last_norm[0] = last_and_update(state, grads, idx[-1], targets[-1], dropout_seeds[-1],
                                                     setting)
        params, opt_state = packed.unpack()
        losses.append(loss)
        return params, opt_state, losses[0] if grad_accum_steps == 1 else jnp.mean(jnp.stack(losses))

    @jax.jit
    def eval_packed(packed, idx, targets):
        params, frozen = packed.unpack()
        return values.to_array(merged(graphdef, params, frozen).loss(idx, targets))

    def eval_step(params, idx, targets, frozen=None):
        return eval_packed(pack((params, frozen)), idx, targets)

    return train_step, eval_step


def split(model, finetune):
    """(graphdef, trained parameters, frozen parameters or None when everything trains)."""
    graphdef, params, frozen = nnx.split(model, finetune.filter(), nnx.Param)
    return graphdef, params, None if finetune.trains_everything else frozen


def merged(graphdef, params, frozen):
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def step_batch(dataset, step: int, *, batch_size: int, grad_accum_steps: int, seq_len: int, order: str, seed: int):
    """Token ids and targets of training step `step`, shaped (grad_accum_steps, batch_size, seq_len).

    Micro-batch k holds rows k*batch_size ... of the step's whole batch, so N
    micro-batches of B sequences see exactly what one batch of N*B would, in
    both data orders, and a resumed run sees what it would have seen.
    """
    n, b = grad_accum_steps, batch_size
    idx, targets = dataset.batch(step, n * b, seq_len, order, seed=seed)
    return idx.reshape(n, b, seq_len), targets.reshape(n, b, seq_len)


def dropout_seeds(seed: int, step: int, micro_batches: int) -> list:
    """The dropout seed of each micro-batch of training step `step`: pure functions of (seed, step), so a resumed
    run draws the masks it would have drawn. Ranks drop different units of their rows (a single process keeps
    its seeds)."""
    rank, ranks = runtime.rank(), runtime.world_size()
    return [dropout_seed(seed, (step * micro_batches + k) * ranks + rank) for k in range(micro_batches)]


def dropout_seed(seed: int, step: int):
    return jnp.asarray((seed * 1_000_003 + step) % (2**31 - 1), jnp.int32)
