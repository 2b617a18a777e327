"""A model of StarPU's swap: the tile accesses of a training step replayed through RAM as a cache of the swap that
evicts as StarPU does, predicting the bytes a step writes to swap and reads back (`traffic`)."""

from __future__ import annotations

import collections
import dataclasses
import heapq

from jnntile.training.optim import OPTIMIZER_STATES
from jnntile.planning.record import Op, RecordedStep, T
from jnntile.planning import timeline


_MAX_CHUNKS = 64  # a tensor counts as at most this many tiles in the swap model (a bound on its work)


def _chunks(t: T) -> list:
    n = min(_MAX_CHUNKS, max(1, t.nbytes // max(1, t.tile_bytes)))
    return [((t.name, i), t.nbytes // n) for i in range(n)]


def _step_accesses(step: RecordedStep, optimizer: str, mode: str, clip: bool, grad_accum_steps: int) -> list:
    """The tile accesses of one training step, in the order the runtime submits them: (tile, bytes, reads,
    writes) for a use, (tile, 0, False, False) when the tile dies. Forward: each op reads its inputs and
    writes its outputs and residuals; a recomputed region's intermediates die at its end. Backward, in
    reverse: a recomputed region runs its forward again first, then each op reads its inputs, residuals and
    its outputs' gradients, adds into its inputs' gradients, and its outputs, residuals and their gradients
    die. The optimizer reads a parameter, its gradient and state and writes them back after the backward,
    after the global norm read every gradient when it `clip`s. A fused update (`mode`, one of
    jnntile.optim.UPDATE_MODES) updates each parameter inside the backward, once its gradient is final
    (`timeline.fused_at`), and the gradient dies there; a speculative one reads the parameter and its states there
    and writes the next ones apart, and after the backward (the norm not clipping) the old ones die and the
    new ones take their place (`_RENAME`). A model in bfloat16 converts each weight into its compute copy
    once (the update writes the copy with the parameter): the convert reads and writes nothing in a step,
    and the products that read the copy add into the parameter's gradient."""
    accesses = []
    state = {p.name: [dataclasses.replace(p, name=f"{p.name} {kind}", kind="state")
                      for kind in ("moment 1", "moment 2")[:OPTIMIZER_STATES[optimizer]]] for p in step.params}
    grad = {}

    def use(t: T, reads: bool = True, writes: bool = False) -> None:
        accesses.extend((key, nbytes, reads, writes) for key, nbytes in _chunks(t))

    def free(t: T) -> None:
        accesses.extend((key, 0, False, False) for key, _ in _chunks(t))

    def grad_of(t: T) -> T:
        if t.name not in grad:
            grad[t.name] = dataclasses.replace(t, name=f"{t.name} gradient")
        return grad[t.name]

    def update(p: T) -> None:
        use(p, writes=True)
        use(grad_of(p))
        for s in state[p.name]:
            use(s, writes=True)
        if p.name in step.copies:
            use(step.copies[p.name], reads=False, writes=True)
        free(grad.pop(p.name))

    def kept(p: T) -> list:  # what a speculative update writes apart: the parameter, its states and copy
        return [p, *state[p.name], *([step.copies[p.name]] if p.name in step.copies else [])]

    def update_apart(p: T) -> None:
        use(grad_of(p))
        for t in kept(p):
            if t.kind != "copy":
                use(t)
            use(dataclasses.replace(t, name=f"{t.name} next"), reads=False, writes=True)
        free(grad.pop(p.name))

    def commit(p: T) -> None:
        for t in kept(p):
            free(t)
            after = dataclasses.replace(t, name=f"{t.name} next")
            accesses.extend((next_key, _RENAME, key, False) for (key, _), (next_key, _) in zip(_chunks(t),
                                                                                               _chunks(after)))

    def makes_copy(op: Op) -> bool:
        return any(t.kind == "copy" for t in op.outputs)

    def forward(ops) -> None:
        for op in ops:
            if makes_copy(op):  # fresh: no task
                continue
            for t in op.inputs:
                use(t)
            for t in op.outputs + op.residuals:
                use(t, reads=False, writes=True)

    fused_at = timeline.fused_at(step) if mode != "after" else {}
    in_backward = {p.name for params in fused_at.values() for p in params}
    for micro_batch in range(grad_accum_steps):
        last = micro_batch == grad_accum_steps - 1
        for index, op in enumerate(step.ops):
            forward([op])
            if op.region_output is not None:
                for made in step.ops[op.region_start:index + 1]:
                    for t in made.outputs + made.residuals:
                        if t is not op.region_output and t.kind != "copy":
                            free(t)
        for index in reversed(range(len(step.ops))):
            op = step.ops[index]
            if op.region_output is not None:
                forward(step.ops[op.region_start:index + 1])
            if not makes_copy(op):  # (whose backward submits nothing: the products added into the master's)
                for t in op.inputs + op.residuals:
                    use(t)
                for t in op.outputs:
                    if t.has_grad:
                        use(grad_of(t))
                for t in map(step.gradient_owner, op.inputs):
                    if t.has_grad:
                        use(grad_of(t), writes=True)
            for t in op.outputs + op.residuals:
                if t.kind != "copy":
                    free(t)
                if t.name in grad:
                    free(grad.pop(t.name))
            for p in fused_at.get(index, []) if last else []:
                (update_apart if mode == "speculative" else update)(p)
    after = [p for p in step.params if p.name not in in_backward]
    if clip:
        for p in after:
            use(grad_of(p))
    for p in after:
        update(p)
    if mode == "speculative":
        for p in step.params:
            if p.name in in_backward:
                commit(p)
    return accesses


_RENAME = -1  # the bytes of an access that renames a tile: (old key, _RENAME, new key, False)


def traffic(step: RecordedStep, optimizer: str, capacity: int, update: str, clip: bool,
                  grad_accum_steps: int = 1) -> tuple[int, int]:
    """(bytes written to swap, bytes read from it) by a training step in steady state with `capacity` bytes
    of RAM (the second of three, so that the first's cold start and the last's missing future do not
    count): the step's tile accesses (`_step_accesses`) replayed through RAM as a cache of the swap that
    evicts as StarPU does (`_starpu_allocate_interface`, src/datawizard/memalloc.c): a tile that does not fit
    takes over the memory of the least recently used clean tile of its size (one whose copy on disk is
    current, so nothing is written), and when there is none StarPU frees twice its size in least recently
    used order. A dirty tile evicted is written to swap; one read while not in RAM is read back; one written
    whole (a new output) needs no read; a dead tile leaves RAM and swap at no cost. A tile renamed (a
    speculative update's result becoming the parameter) keeps its place and state. (Plain LRU predicted
    15-30% fewer bytes than StarPU moved with the update fused; this is within 10% at batch 1 x 64 and 30%
    low at 4 x 1024: docs/memory.md.)
    """
    one_step = _step_accesses(step, optimizer, update, clip, grad_accum_steps)
    accesses = one_step * 3
    resident, dirty, on_disk, heap = {}, set(), set(), []  # resident: tile -> (bytes, index of its last use)
    clean = collections.defaultdict(list)  # bytes -> heap of (last use, tile) of clean tiles of that size
    used = written = read = 0

    def current(entry) -> bool:  # not stale: the tile was neither used again nor dropped since
        last_use, tile = entry
        return resident.get(tile, (0, None))[1] == last_use

    def evict(victim) -> tuple[int, int]:
        """Drops `victim` from RAM: (its bytes, the bytes written to swap for it)."""
        victim_bytes = resident.pop(victim)[0]
        on_disk.add(victim)
        if victim in dirty:
            dirty.discard(victim)
            return victim_bytes, victim_bytes
        return victim_bytes, 0

    for i, (key, nbytes, reads, writes) in enumerate(accesses):
        counted = len(one_step) <= i < 2 * len(one_step)
        if nbytes == _RENAME:
            new_key = reads
            for where in (dirty, on_disk):
                if key in where:
                    where.discard(key)
                    where.add(new_key)
            if key in resident:
                resident[new_key] = resident.pop(key)
                heapq.heappush(heap, (resident[new_key][1], new_key))
                if new_key not in dirty:
                    heapq.heappush(clean[resident[new_key][0]], (resident[new_key][1], new_key))
            continue
        if not nbytes:  # the tile dies: nothing to write or read
            used -= resident.pop(key, (0, 0))[0]
            dirty.discard(key)
            on_disk.discard(key)
            continue
        if key not in resident and used + nbytes > capacity:
            # StarPU takes over the memory of the least recently used clean tile of the same size (one with a
            # copy on disk: nothing to write), and without one frees twice the size in least-recently-used order.
            same_size = clean[nbytes]
            while same_size and not (current(same_size[0]) and same_size[0][1] not in dirty):
                heapq.heappop(same_size)
            if same_size:
                used -= evict(heapq.heappop(same_size)[1])[0]
            else:
                freed = 0
                while heap and (used + nbytes > capacity or freed < 2 * nbytes):
                    entry = heapq.heappop(heap)
                    if current(entry):
                        victim_bytes, victim_written = evict(entry[1])
                        used -= victim_bytes
                        freed += victim_bytes
                        written += victim_written if counted else 0
        if key not in resident:
            if reads and key in on_disk:
                read += nbytes if counted else 0
            used += nbytes
        resident[key] = (nbytes, i)
        heapq.heappush(heap, (i, key))
        if writes:
            dirty.add(key)
            on_disk.discard(key)
        elif key not in dirty:
            heapq.heappush(clean[nbytes], (i, key))
    return written, read
