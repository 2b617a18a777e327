"""One model trained by several processes (MPI ranks): data parallel with StarPU-MPI.

Every rank runs the same program: it traces the same jitted steps, so it
submits the same tasks in the same order, on its own copy of the parameters
and optimizer state. Rank r takes rows r*B/N ... (r+1)*B/N - 1 of each batch
that one process would take; `jnntile.optim.allreduce_sum` sums the gradients
over the ranks with StarPU-MPI transfers and addition tasks, and every rank
applies the same update to the same bits. The host exchanges here (checks at
start, the loss) are small messages that sleep while they wait and name the
ranks that never answer. See docs/distributed.md.

    mpirun -n 2 --bind-to none python -m jnntile.train ...            # the command
    jnntile.runtime.start(distributed=True)                            # from Python, under mpirun
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import struct

import numpy as np

from jnntile import _xla_ffi
from jnntile.core import runtime
from jnntile.core import tensor as tensor_mod


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Who owns which tiles (the default and, for now, only mapping; docs/distributed.md).

    * Batch rows, and every activation computed from them: rank r owns rows
      r*B/N ... (r+1)*B/N - 1 of each batch of B rows.
    * Parameters, their gradients and the optimizer state: every rank holds
      all of them (replicated), so each rank runs every optimizer task itself
      and no parameter moves between ranks.
    * The sum of gradient tile i (counting the tiles of all gradients in
      order) is formed at rank i mod N, which sends it to every rank: each
      rank forms 1/N of the sums, so sends and receives are spread evenly.

    Another mapping provides the same two methods (and, to shard the state
    ZeRO-style, more: docs/distributed.md says what).
    """

    def batch_rows(self, batch_size: int, rank: int, size: int) -> slice:
        if batch_size % size:
            raise ValueError(f"a batch of {batch_size} sequences cannot be split evenly across {size} ranks: use a "
                             f"batch size that is a multiple of {size}, or a number of ranks that divides {batch_size}")
        rows = batch_size // size
        return slice(rank * rows, (rank + 1) * rows)

    def reduction_roots(self, tiles: int, size: int) -> list[int]:
        return [i % size for i in range(tiles)]


DEFAULT_OWNERSHIP = DataParallel()


def launched_ranks() -> int:
    """How many processes the MPI launcher started (mpirun's or mpiexec's environment); 1 without one."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def local_rows(batch, ownership: DataParallel = DEFAULT_OWNERSHIP, axis: int = 0):
    """This rank's rows of a batch (numpy or JAX array) along `axis`; the whole batch on one process."""
    rows = ownership.batch_rows(batch.shape[axis], runtime.rank(), runtime.world_size())
    return batch[(slice(None),) * axis + (rows,)]


def _allgather(data: bytes, what: str, patient: bool = False) -> list[bytes]:
    return _xla_ffi.allgather(data, what, runtime.config().watchdog_s, patient)


def wait_for_every_rank(what: str) -> None:
    """Returns once every rank has called it: a barrier that sleeps while it waits, for as long as the
    ranks it waits for are alive (they answer pings), e.g. while rank 0 alone writes a checkpoint."""
    if runtime.world_size() > 1:
        _allgather(b"", what, patient=True)


def mean_and_any(value: float, flag: bool, what: str) -> tuple[float, bool]:
    """The mean of `value` over the ranks and whether `flag` is set on any rank, alike on every rank.

    The values are summed in rank order, so every rank gets the same bits. One
    exchange, e.g. at the end of each training step for the loss and a stop request.
    """
    if runtime.world_size() == 1:
        return float(value), bool(flag)
    pairs = [struct.unpack("<d?", raw) for raw in _allgather(struct.pack("<d?", float(value), bool(flag)), what)]
    total = 0.0
    for v, _ in pairs:
        total += v
    return total / len(pairs), any(f for _, f in pairs)


def _flatten(description: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in description.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _differences(descriptions: list[dict]) -> list[str]:
    """'name is A on ranks 0, 2; B on rank 1' for every (nested) entry that differs."""
    flat = [_flatten(d) for d in descriptions]
    out = []
    for key in sorted(set().union(*flat)):
        by_value: dict[str, list[int]] = {}
        for rank, description in enumerate(flat):
            by_value.setdefault(json.dumps(description.get(key)), []).append(rank)
        if len(by_value) > 1:
            out.append(f"{key} is " + "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} "
                                                   f"{', '.join(map(str, ranks))}" for value, ranks in by_value.items()))
    return out


class SetUpError(ValueError):
    """A check before training failed on some rank; every rank raises it, so every rank stops."""


def require_same(what: str, description: dict) -> None:
    """Raises SetUpError on every rank, naming the differences, unless every rank passed the same description."""
    if runtime.world_size() == 1:
        return
    everyone = [json.loads(raw) for raw in _allgather(json.dumps(description, sort_keys=True).encode(),
                                                        f"the check of {what}")]
    differences = _differences(everyone)
    if differences:
        raise SetUpError(f"{what} differs across ranks: {'. '.join(differences)}. Every rank must run the same "
                         "command, with the same model, batch, tiles, optimizer and data")


def _agree_on_the_runtime() -> None:
    # Every rank must sum gradients the same way; this also waits for every rank to start.
    if runtime.config().distributed:
        require_same("the runtime", {"allreduce": runtime.config().allreduce,
                                     "shard_state": runtime.config().shard_state})


runtime.after_start(_agree_on_the_runtime)


def sharding() -> bool:
    """Whether this run shards its training state across ranks (`runtime.start(distributed=True,
    shard_state=True)` with several ranks)."""
    return runtime.config().shard_state and runtime.world_size() > 1


@contextlib.contextmanager
def sharded_state():
    """Shards every tensor created inside (a model's parameters, as it builds them): each tile gets one owner
    rank, the rank holding the fewest bytes of the block so far (ties: the lowest), so every rank holds about
    1/N of them. Only the owner computes and stores a tile's values; other ranks fetch it for the op that
    reads it and drop it after (docs/distributed.md, "Sharded state"). Every rank must create the same tensors
    in the same order, as building the same model does. Does nothing unless `sharding()`."""
    if not sharding():
        yield
        return
    held = [0] * runtime.world_size()
    layouts = []

    def shard(handle):
        itemsize = np.dtype(handle.dtype).itemsize
        _xla_ffi.tensor_shard(handle.id, least_held_owners(tile_bytes(handle.shape, handle.tile_shape, itemsize), held))
        layouts.append(f"{handle.shape} {handle.tile_shape} {handle.dtype}")

    with tensor_mod.on_creation(shard):
        yield
    # Tensors created in another order would give their tiles other transfer tags on each rank: StarPU-MPI
    # would then match a tile with another's, or wait forever. Said here, before anything is sent.
    require_same("the tensors sharded", {"count": len(layouts),
                                         "layout": hashlib.sha256("\n".join(layouts).encode()).hexdigest()[:16]})


def owners(handle) -> list[int]:
    """The owner rank of each tile of a tensor (row-major), empty when every rank holds it."""
    return list(_xla_ffi.tensor_owners(handle.id)) if handle.native else []


def least_held_owners(tiles_bytes, held: list[int]) -> list[int]:
    """The owner of each tile (`tiles_bytes`: their bytes, in order): the rank holding the fewest bytes so far
    (`held`, one count a rank, which grows by the tile's bytes; ties: the lowest rank). `sharded_state` shards
    with it, and the memory planner plans a rank's shard with it (jnntile/planning/sharding.py)."""
    owners = []
    for n_bytes in tiles_bytes:
        owner = min(range(len(held)), key=lambda r: (held[r], r))
        held[owner] += n_bytes
        owners.append(owner)
    return owners


def tile_bytes(shape, tile_shape, itemsize: int) -> list[int]:
    """The bytes of each tile (row-major) of a tensor of `shape` cut into `tile_shape` tiles."""
    extents = [[min(t, n - start) for start in range(0, n, t)] for n, t in zip(shape, tile_shape)]
    return [math.prod(tile) * itemsize for tile in itertools.product(*extents)]


@contextlib.contextmanager
def checked_together(what: str):
    """Runs a set-up block on every rank; an error on any rank is raised on every rank.

    Yields a dict that the block fills with what must be the same on every
    rank (compared after the block, see `require_same`). Ranks then stop
    together, each with the error, before anything runs. On one process the
    block's errors pass through unchanged.
    """
    description: dict = {}
    if runtime.world_size() == 1:
        yield description
        return
    error = None
    try:
        yield description
    except (ValueError, FileNotFoundError) as e:
        error = str(e)
    everyone = [json.loads(raw) for raw in _allgather(json.dumps({"error": error}).encode(), what)]
    errors = {r: e["error"] for r, e in enumerate(everyone) if e["error"] is not None}
    if errors:
        if len(set(errors.values())) == 1 and len(errors) == len(everyone):
            raise SetUpError(next(iter(errors.values())))
        raise SetUpError("; ".join(f"rank {r}: {message}" for r, message in errors.items()))
    require_same(what, description)


__all__ = ["DataParallel", "DEFAULT_OWNERSHIP", "SetUpError", "checked_together", "launched_ranks", "least_held_owners",
           "local_rows", "mean_and_any", "owners", "require_same", "sharded_state", "sharding", "tile_bytes",
           "wait_for_every_rank"]
