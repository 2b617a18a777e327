"""The training step of the library: `make_steps` builds the jitted training and evaluation steps over the
trained parameters' state, with gradient accumulation, the fused update and data parallel; `step_batch` and
`dropout_seeds` give a step's batch and seeds as pure functions of (seed, step), which is what makes a resumed
run bit-identical. `python -m jnntile.train` calls these as any user would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jnntile.core import distributed, runtime
from jnntile.training import optim
from jnntile.core.grad import mark_computed, value_and_grad
from jnntile.core.tensor import pack
from jnntile.data import IGNORE_INDEX, ExampleDataset
from jnntile.ops import values


def make_steps(graphdef, tx, grad_accum_steps: int = 1, fused_update: str = "auto"):
    """The training and evaluation steps over (params, opt_state), the trained parameters' state.

    `train_step(params, opt_state, idx, targets, dropout_seeds, frozen, segments, positions, step_targets)` takes
    the token ids of a whole step, shaped (grad_accum_steps, B, T), one dropout
    seed per micro-batch, and the frozen parameters' state (None when
    everything trains): those are read, never differentiated. A packed batch of examples also gives its
    `segments` and `positions`, shaped as idx (None for text: its programs stay those without packing).

    The step's loss is the mean over the targets (those not -100) of the whole step, across micro-batches and
    ranks, not a mean of the micro-batches' means: micro-batch k, whose loss is the mean over its n_k targets,
    adds its gradients scaled by n_k / `step_targets` into the tiled gradients (the first starts them at zero),
    so N micro-batches give the gradient of one batch holding them all however their targets are spread.
    `step_targets` counts the targets of the whole step on every rank (`count_targets` of the step's batch before
    `jnntile.distributed.local_rows`: host data, no communication); left out, this rank's count times the ranks
    (exact where every rank counts as many, as text does). The scales are arguments of the compiled programs, so
    one program serves every batch. The last micro-batch also applies `tx`, so clipping and the update see the
    gradient of the whole batch. Returns the new (params, opt_state) and the loss; nothing blocks until the
    caller reads it.

    With `tx` an `optax.chain` of jnntile's (an optional clip, then adamw or sgd),
    the parameters are updated in the last micro-batch's backward as soon as
    their gradients are final, so those gradients never reach swap
    (`jnntile.optim.FusedUpdate`), when `fused_update` ("auto", "on", "off":
    `jnntile.optim.update_mode`) says so; under "auto", a step after one whose
    norm clipped updates after the backward. Every mode gives the same bits.

    In a distributed run (`runtime.world_size()` N > 1) each rank
    passes its own rows of the step's batch (`jnntile.distributed.local_rows`)
    and its own dropout seeds: the gradients, scaled by each rank's share of the step's targets, are summed
    over the ranks (`jnntile.optim.allreduce_sum`) before `tx`, so every rank
    applies the update of the whole batch. The loss returned is this rank's share of the step's loss times N,
    so that `jnntile.distributed.mean_and_any`, which averages it over the ranks, gives the step's loss.
    With sharded state (`jnntile.distributed.sharded_state`) each gradient is summed up to the owners of its
    parameter's tiles as soon as the backward finishes it (`jnntile.optim.SumToOwners`), and each owner
    clips and updates its own tiles.
    """
    ranks = runtime.world_size()
    summed = optim.allreduce_sum()

    def gradients(params, grads, batch, dropout_seed, scale, frozen, on_final=None):
        return value_and_grad(lambda p: merged(graphdef, p, frozen).loss(*batch[:2], dropout_seed, *batch[2:]),
                              accumulate=grads, scale=scale, on_final=on_final)(params)

    # The parameters, the optimizer state and the frozen weights cross each jitted call packed behind one
    # token (jnntile.tensor.Packed: JAX's dispatch would take 40-50 ms per step over their leaves).

    # The micro-batches before the last: compiled twice, without earlier gradients and with them.
    @jax.jit
    def add_gradients(packed, grads, batch, dropout_seed, scale):
        params, _, frozen = packed.unpack()
        return gradients(params, grads, batch, dropout_seed, scale, frozen)

    # The last micro-batch and the update in one program: a step without accumulation stays the one
    # program it was, and the update's tasks are submitted right after the last backward's (or in it).
    @functools.partial(jax.jit, static_argnames="setting")
    def last_and_update(packed, grads, batch, dropout_seed, scale, setting):
        params, opt_state, frozen = packed.unpack()
        if distributed.sharding():
            to_owners = optim.SumToOwners(params)
            loss, grads = gradients(params, grads, batch, dropout_seed, scale, frozen, on_final=to_owners.on_final)
            updates, opt_state = tx.update(to_owners.finish(grads), opt_state, params)
            return pack((optax.apply_updates(params, updates), opt_state)), loss, None
        fused = optim.fused_update(opt_state, params, setting)
        on_final = fused if fused is not None and fused.mode != "after" else None
        loss, grads = gradients(params, grads, batch, dropout_seed, scale, frozen, on_final=on_final)
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

    def train_step(params, opt_state, idx, targets, dropout_seeds, frozen=None, segments=None, positions=None,
                   step_targets=None):
        counts = count_targets(targets)
        total = max(step_targets if step_targets is not None else int(counts.sum()) * ranks, 1)
        # float64 then float32: text's n / (N n) rounds as 1 / N does, the scale of a text run's every step.
        scales = (counts / total).astype(np.float32)
        batches = [(idx[k], targets[k]) + (() if segments is None else (segments[k], positions[k]))
                   for k in range(grad_accum_steps)]
        grads, losses = None, []
        state = pack((params, opt_state, frozen))  # every micro-batch's program takes the same state
        for k in range(grad_accum_steps - 1):
            loss, grads = add_gradients(state, grads, batches[k], dropout_seeds[k], scales[k])
            # Run compiled, it told the ledger nothing: a trace of last_and_update made now (a setting not
            # compiled yet) would find these gradients consumed by the update of the step before.
            mark_computed(grads)
            losses.append(loss)
        setting = fused_update
        if setting == "auto" and last_norm[0] is not None and optim.speculates(opt_state, setting):
            setting = "off" if optim.clipped(opt_state, last_norm[0]) else setting
        packed, loss, last_norm[0] = last_and_update(state, grads, batches[-1], dropout_seeds[-1], scales[-1],
                                                     setting)
        params, opt_state = packed.unpack()
        losses.append(loss)
        if grad_accum_steps == 1 and ranks == 1:
            return params, opt_state, loss
        return params, opt_state, jnp.sum(jnp.stack(losses) * (scales * ranks))

    @jax.jit
    def eval_packed(packed, batch):
        params, frozen = packed.unpack()
        return values.to_array(merged(graphdef, params, frozen).loss(*batch[:2], None, *batch[2:]))

    def eval_step(params, idx, targets, frozen=None, segments=None, positions=None):
        """The mean loss over the targets of one batch (B, T) (a packed one with its segments and positions)."""
        return eval_packed(pack((params, frozen)), (idx, targets) + (() if segments is None else (segments, positions)))

    return train_step, eval_step


def split(model, finetune):
    """(graphdef, trained parameters, frozen parameters or None when everything trains)."""
    graphdef, params, frozen = nnx.split(model, finetune.filter(), nnx.Param)
    return graphdef, params, None if finetune.trains_everything else frozen


def merged(graphdef, params, frozen):
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def step_batch(dataset, step: int, *, batch_size: int, grad_accum_steps: int, seq_len: int, order: str, seed: int,
               packing: bool = True, truncate: bool = True) -> tuple:
    """(idx, targets, segments, positions) of training step `step`, each shaped (grad_accum_steps, batch_size,
    seq_len); segments and positions are None for text (a TokenDataset), whose every window is full. An
    ExampleDataset packs its examples into the rows (`packing`) or pads each to its own, and cuts those longer
    than seq_len (refused without `truncate`): `jnntile.data.ExampleDataset.batch`.

    Micro-batch k holds rows k*batch_size ... of the step's whole batch, so N
    micro-batches of B sequences see exactly what one batch of N*B would, in
    both data orders, and a resumed run sees what it would have seen.
    """
    n, b = grad_accum_steps, batch_size
    if isinstance(dataset, ExampleDataset):
        batch = dataset.batch(step, n * b, seq_len, order, seed=seed, packing=packing, truncate=truncate)
        arrays = (batch.idx, batch.targets, batch.segments, batch.positions)
    else:
        arrays = (*dataset.batch(step, n * b, seq_len, order, seed=seed), None, None)
    return tuple(None if a is None else a.reshape(n, b, seq_len) for a in arrays)


def count_targets(targets) -> np.ndarray:
    """The targets (those not IGNORE_INDEX) of each micro-batch of a step's targets (N, B, T): host data."""
    return np.sum(np.asarray(targets) != IGNORE_INDEX, axis=(1, 2), dtype=np.int64)


def dropout_seeds(seed: int, step: int, micro_batches: int) -> list:
    """The dropout seed of each micro-batch of training step `step`: pure functions of (seed, step), so a resumed
    run draws the masks it would have drawn. Ranks drop different units of their rows (a single process keeps
    its seeds)."""
    rank, ranks = runtime.rank(), runtime.world_size()
    return [dropout_seed(seed, (step * micro_batches + k) * ranks + rank) for k in range(micro_batches)]


def dropout_seed(seed: int, step: int):
    return jnp.asarray((seed * 1_000_003 + step) % (2**31 - 1), jnp.int32)
