"""The timeline of a training step's memory: what lives from the forward through the backward to the optimizer
update, and its peak (`simulate`); where a fused update updates each parameter inside the backward (`fused_at`)."""

from __future__ import annotations

import collections

from jnntile.training.optim import OPTIMIZER_STATES
from jnntile.planning.record import RecordedStep
from jnntile.planning.sharding import Shard


def fused_at(step: RecordedStep) -> dict:
    """Where a fused update updates each parameter inside the backward (jnntile.grad's `on_final`): backward
    op index -> the parameters whose gradient is final once the backward reached it, the backward of the
    first op that reads them (a compute copy's maker included), or, when that op is in a recomputed region,
    of the region's first op (a region's backward is one piece)."""
    region_start = {}
    for end, op in enumerate(step.ops):
        if op.region_output is not None:
            for index in range(op.region_start, end + 1):
                region_start[index] = op.region_start
    first_reader = {}
    for index, op in enumerate(step.ops):
        for t in op.inputs:
            if t.kind == "param":
                first_reader.setdefault(t.name, region_start.get(index, index))
    fused = collections.defaultdict(list)
    for p in step.params:
        if p.name in first_reader:
            fused[first_reader[p.name]].append(p)
    return fused


def simulate(step: RecordedStep, optimizer: str, shard: Shard, accumulating: bool = False, update: str = "after"):
    """Walks the step's timeline; returns (activations, activation-gradient peak, peak, phase).

    `accumulating`: a micro-batch after the first of a step, whose parameter
    gradients hold the earlier micro-batches' sum from the start (the first
    starts them lazily, as a step without accumulation does). `update`: a fused
    update frees the gradients of the parameters it updates in the backward; a
    speculative one also holds their next values and states until the step ends.
    `shard`: this process's part of the state (sharding.py; all of it on one
    rank). With several, the rank holds its own tiles of the state, and beside them the parameters fetched for the op in
    flight and the next one; a gradient is whole on every rank until final, then
    summed up to its owners and dropped elsewhere (when accumulating, every
    rank keeps every partial gradient until the last micro-batch, planned here
    as any other).
    """
    n_state = OPTIMIZER_STATES[optimizer]
    final = fused_at(step)
    held, in_flight = shard.held, shard.fetched
    params = sum(held(p) for p in step.params)
    base = (params * (1 + n_state) + accumulating * sum(p.nbytes for p in step.params)
            + sum(t.nbytes for t in step.inputs) + sum(held(t) for t in step.copies.values())
            + sum(held(t) for t in step.frozen) + shard.kept)
    live = 0  # activations, residuals, and gradients allocated so far
    peak, phase = base, "start"

    # Recomputed regions, by the index of their last op: what their ops create but the region's output,
    # freed after the region's forward and made again at its backward.
    made_again = {end: sum(t.nbytes for op in step.ops[last.region_start:end + 1]
                           for t in op.outputs + op.residuals if t is not last.region_output and t.kind != "copy")
                  for end, last in enumerate(step.ops) if last.region_output is not None}
    for index, op in enumerate(step.ops):  # forward
        live += sum(t.nbytes for t in op.outputs + op.residuals if t.kind != "copy")
        fetched = in_flight(*step.ops[index:index + 2])
        if base + live + fetched > peak:
            peak, phase = base + live + fetched, "end of forward"
        live -= made_again.get(index, 0)
    activations = live
    grads = {p.name for p in step.params} if accumulating else set()
    act_grad_live = act_grad_peak = 0
    # A recomputed region runs its forward again once its output's gradient is submitted, while StarPU may
    # still run the backward of the region after it: two regions' activations are alive at once.
    backward_order = sorted(made_again, reverse=True)
    recomputed = set()
    for index in reversed(range(len(step.ops))):  # backward: the op's tasks need its inputs' and outputs' gradients
        op = step.ops[index]
        if index in made_again:  # the forward again, with the next region's overlapping it
            position = backward_order.index(index)
            for end in backward_order[position:position + 2]:
                if end not in recomputed:
                    recomputed.add(end)
                    live += made_again[end] + step.ops[end].region_output.nbytes  # its output made again
        for t in map(step.gradient_owner, op.inputs + op.outputs):
            if t.has_grad and t.name not in grads:
                grads.add(t.name)
                live += t.nbytes
                if t.kind == "act":
                    act_grad_live += t.nbytes
        act_grad_peak = max(act_grad_peak, act_grad_live)
        fetched = in_flight(*step.ops[max(index - 1, 0):index + 1])
        if base + live + fetched > peak:
            peak, phase = base + live + fetched, f"backward of {op.name}"
        if op.region_output is not None:  # the recomputed output goes with the first one
            live -= op.region_output.nbytes
        for t in op.outputs + op.residuals:  # released after the op's backward (a compute copy stays)
            if t.kind != "copy":
                live -= t.nbytes
            if t.name in grads:
                live -= t.nbytes
                if t.kind == "act":
                    act_grad_live -= t.nbytes
        for p in final.get(index, []):
            if not accumulating:  # summed up to its owners: the other ranks' tiles leave (none on one rank)
                live -= p.nbytes - held(p)
            if update != "after":  # updated here: the gradient dies, a speculative update's values wait
                live -= held(p)
            if update == "speculative":
                live += held(p) * (1 + n_state) + (held(step.copies[p.name]) if p.name in step.copies else 0)
    for p in step.params:  # parameters nobody differentiated still get a zero gradient
        if p.name not in grads:
            live += p.nbytes
    if base + live > peak:
        peak, phase = base + live, "optimizer update"
    return activations, act_grad_peak, peak, phase
