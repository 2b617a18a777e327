"""A rank's part of a step whose training state is sharded across ranks (docs/distributed.md, "Sharded state";
xla_ffi/sharding.h): the parameter tiles it owns, with their gradients, moments and compute copies; the
parameters it fetches from their owners for the ops in flight; and the bytes it sends and receives per step.

Owners are chosen as `jnntile.distributed.sharded_state` chooses them, tile by tile to the rank holding the fewest
bytes so far, over the parameters in the order the planner records them (the model's order, which may differ
from the order it creates them: the same balance, to within a tile a rank). The plan is that of the rank holding
the most state.
"""

from __future__ import annotations

import dataclasses

from jnntile.core import distributed
from jnntile.planning.record import Op, RecordedStep, T
from jnntile.training.optim import OPTIMIZER_STATES

SHARDED_KINDS = ("param", "frozen", "copy")  # a compute copy's tiles are owned as its parameter's


@dataclasses.dataclass(frozen=True)
class Shard:
    """The planned rank's part of a step sharded across `ranks` (1: one process, which holds it all): `owned`
    maps each parameter (trained or frozen) and compute copy to the bytes of its tiles this rank owns. With
    `keep_fetched` (the runtime's shard_keep_fetched) the rank keeps what it fetches until its owner writes it,
    and runs unpaced (xla_ffi/sharding.cc), so a rank ahead may hold its partial sum of every gradient tile
    another owns until that owner takes it: `kept` bytes, the other ranks' tiles of every tensor the step
    reads and of every gradient, planned as held all step."""

    ranks: int
    owned: dict
    keep_fetched: bool = False
    kept: int = 0

    def held(self, t: T) -> int:
        """The bytes of `t` this rank holds between ops: its own tiles of a parameter or compute copy, all of
        anything else (activations, token ids)."""
        return self.owned[t.name] if t.kind in SHARDED_KINDS else t.nbytes

    def fetched(self, *ops: Op) -> int:
        """The bytes this rank receives to run `ops` (the op in flight and the next one): the other ranks' tiles
        of the parameters they read, each tensor once (none beyond `kept` when it keeps them)."""
        if self.keep_fetched:
            return 0
        return sum(t.nbytes - self.held(t) for t in _fetches(*ops).values())

    def traffic(self, step: RecordedStep, grad_accum_steps: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by this rank in one step of `grad_accum_steps` micro-batches: each op
        fetches the parameter tiles it reads from their owners in the forward, again in the backward and in a
        recomputed forward (kept, each tile trained once a step, a frozen one never again); each gradient is
        summed up to its owners once a step (counted as a flat reduce: the runtime's `allreduce` schedules move
        as many bytes in all, spread over the ranks otherwise)."""
        recomputed = {index for end, op in enumerate(step.ops) if op.region_output is not None
                      for index in range(op.region_start, end + 1)}
        if self.keep_fetched:  # each tensor read once a step, a frozen one never again
            fetches = [(t, int(t.kind != "frozen")) for t in _fetches(*step.ops).values()]
        else:
            fetches = [(t, grad_accum_steps * (2 + (index in recomputed)))
                       for index, op in enumerate(step.ops) for t in _fetches(op).values()]
        sent = received = 0
        for t, passes in fetches:
            received += passes * (t.nbytes - self.held(t))
            sent += passes * (self.ranks - 1) * self.held(t)
        sent += sum(p.nbytes - self.held(p) for p in step.params)  # this rank's partial sums of others' tiles
        received += (self.ranks - 1) * sum(self.held(p) for p in step.params)  # the others' of its own
        return sent, received


def _fetches(*ops: Op) -> dict:
    """The sharded tensors `ops` read, by name. An op that makes a compute copy runs on the owner of each tile it
    writes, which holds the parameter's tile: it fetches nothing."""
    return {t.name: t for op in ops if not any(t.kind == "copy" for t in op.outputs)
            for t in op.inputs if t.kind in SHARDED_KINDS}


def shard_of(step: RecordedStep, ranks: int, optimizer: str, keep_fetched: bool = False) -> Shard:
    """The shard of the rank holding the most state (parameters, gradients, moments, compute copies) of `step`
    sharded across `ranks` (all of it, for 1), keeping what it fetches with `keep_fetched`."""
    held = [0] * ranks
    tensors = step.params + step.frozen
    tiles = {p.name: distributed.tile_bytes(p.shape, p.tile, p.itemsize) for p in tensors}
    owners = {p.name: distributed.least_held_owners(tiles[p.name], held) for p in tensors}

    def owned(rank: int) -> dict:
        mine = {p.name: sum(n for n, owner in zip(tiles[p.name], owners[p.name]) if owner == rank) for p in tensors}
        # A compute copy's tile i is owned as its parameter's tile i, at its own itemsize.
        mine.update({copy.name: mine[name] * copy.itemsize // next(p.itemsize for p in tensors if p.name == name)
                     for name, copy in step.copies.items()})
        return mine

    def state(mine: dict) -> int:
        gradients_and_moments = (1 + OPTIMIZER_STATES[optimizer]) * sum(mine[p.name] for p in step.params)
        return sum(mine.values()) + gradients_and_moments

    shard = Shard(ranks, max((owned(rank) for rank in range(ranks)), key=state))
    if not keep_fetched or ranks == 1:
        return shard
    kept = (sum(t.nbytes - shard.held(t) for t in _fetches(*step.ops).values())
            + sum(p.nbytes - shard.held(p) for p in step.params))
    return dataclasses.replace(shard, keep_fetched=True, kept=kept)
