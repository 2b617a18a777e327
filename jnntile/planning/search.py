"""The search over recomputation and tiles: `choose_remat` picks how many blocks to recompute under a memory limit,
`fit_tiles` shrinks the automatic tiles until every task fits the limits, `choose_keep_fetched` keeps a sharded
state's fetched parameters when they fit; `fit` does all three, as every command plans."""

from __future__ import annotations

import dataclasses
import functools

from jnntile.planning.plan import SHRINK_ORDER, MemoryPlan, plan
from jnntile.planning.spec import Limits, StepSpec


def fit(spec: StepSpec, limits: Limits) -> tuple[StepSpec, str]:
    """`spec` with its recomputation chosen (`choose_remat`), then its automatic tiles fitted to `limits`
    (`fit_tiles`), then with sharded state whether ranks keep what they fetch (`choose_keep_fetched`); the note
    says what was chosen and why, a line each ("" when the spec chose itself)."""
    spec, remat_note = choose_remat(spec, limits)
    spec, tiles_note = fit_tiles(spec, limits)
    spec, keep_note = choose_keep_fetched(spec, limits)
    return spec, "\n".join(note for note in (remat_note, tiles_note, keep_note) if note)


def choose_keep_fetched(spec: StepSpec, limits: Limits) -> tuple[StepSpec, str]:
    """With the state sharded across ranks, `spec` keeping the parameters a rank fetches until they are written
    (one fetch a step instead of one per op that reads them: the bytes of data parallel) when that plan fits in
    memory without swap, else as it is, fetching for each op."""
    if spec.shards == 1:
        return spec, ""
    kept = dataclasses.replace(spec, keep_fetched=True)
    kept_plan = plan(kept, workers=limits.workers, gpu_mb=limits.gpu_mb)
    if not kept_plan.verdict(limits).startswith("fits"):
        return spec, ""
    return kept, (f"sharded state: the parameters a rank fetches are kept until written "
                  f"({kept_plan.fetched / 2**20:,.0f} MB of other ranks' tiles), as they fit")


def choose_remat(spec: StepSpec, limits: Limits) -> tuple[StepSpec, str]:
    """`spec` with its config's remat="auto" resolved. "none" when the step fits the memory limit without
    recomputation (beside the GPU memory of `limits`: what the GPU holds needs no RAM);
    else "block" with the fewest blocks recomputed (`remat_blocks`) that make it fit; when even all of them do
    not, all blocks or none, whichever the planner predicts to move fewer bytes to and from swap
    (`MemoryPlan.swap_traffic`). Returns (spec, note); the note says what was chosen and why ("" when the
    config chose itself)."""
    config = spec.config
    if config.remat != "auto":
        return spec, ""
    memory_limit_mb, gpu_mb = limits.memory_limit_mb, limits.gpu_mb
    limit = memory_limit_mb * 2**20
    peak = "planned peak" + (f" beyond the GPU's {gpu_mb:.0f} MB" if gpu_mb else "")
    capacity_mb = memory_limit_mb + gpu_mb  # what swap traffic is predicted against: GPU and RAM together

    @functools.cache  # each plan records the whole model
    def plan_with(blocks: int) -> MemoryPlan:
        chosen = spec.with_config(remat="block" if blocks else "none", remat_blocks=blocks or None)
        return plan(chosen, workers=limits.workers, gpu_mb=gpu_mb)

    def peak_with(blocks: int) -> int:  # what host memory must hold
        return plan_with(blocks).host_bytes(gpu_mb)

    plain_peak = peak_with(0)
    plain = spec.with_config(remat="none", remat_blocks=None)
    if plain_peak <= limit:
        return plain, (f"--remat auto: none (the step's {peak}, {plain_peak / 2**20:.0f} MB, fits the "
                       f"{memory_limit_mb:.0f} MB limit)")
    n_blocks = config.n_blocks
    all_peak = peak_with(n_blocks)
    if all_peak > limit:  # swap either way: the fewer bytes moved
        moved = {blocks: sum(plan_with(blocks).swap_traffic(capacity_mb)) for blocks in (0, n_blocks)}
        if moved[0] <= moved[n_blocks]:
            return plain, (f"--remat auto: none (the step swaps either way, and recomputation would not lower "
                           f"the predicted swap traffic of {_amount(moved[0])} per step)")
        chosen = spec.with_config(remat="block", remat_blocks=n_blocks)
        return chosen, (f"--remat auto: block, all {n_blocks} blocks recomputed in the backward (the step swaps "
                        f"either way: swap traffic per step predicted {_instead(moved[n_blocks], moved[0])}; {peak} "
                        f"{_instead(all_peak, plain_peak)}, under the {memory_limit_mb:.0f} MB limit)")
    low, high = 1, n_blocks  # the fewest blocks that fit: the peak falls as blocks are added
    while low < high:
        middle = (low + high) // 2
        if peak_with(middle) <= limit:
            high = middle
        else:
            low = middle + 1
    chosen = spec.with_config(remat="block", remat_blocks=low)
    return chosen, (f"--remat auto: block, the first {low} of {n_blocks} blocks recomputed in the backward "
                    f"({peak} {peak_with(low) / 2**20:.0f} MB instead of {plain_peak / 2**20:.0f} MB under "
                    f"the {memory_limit_mb:.0f} MB limit)")


def _amount(n_bytes: float) -> str:
    """Bytes in GB from 1 GB up, else in MB, to a tenth."""
    return f"{n_bytes / 2**30:,.1f} GB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MB"


def _instead(chosen: float, without: float) -> str:
    """"A instead of B", two byte counts (`_amount`), or "A, about as much as without" where they print alike."""
    chosen_text, without_text = _amount(chosen), _amount(without)
    return (f"{chosen_text} instead of {without_text}" if chosen_text != without_text
            else f"{chosen_text}, about as much as without")


def fit_tiles(spec: StepSpec, limits: Limits) -> tuple[StepSpec, str]:
    """`spec` with its config's automatic tile sizes shrunk where the largest tasks would not fit `limits`.

    Returns (spec, note). The note says which tiles were chosen and why, and
    is "" when the automatic tiles fit. Tile sizes the config sets (--tile-*
    flags) never change: when shrinking the automatic ones cannot make every
    task fit, the spec comes back as it was and `plan(...).check` refuses it
    with a suggestion.
    """
    config, memory_limit_mb, gpu_mb = spec.config, limits.memory_limit_mb, limits.gpu_mb
    memory_plan = plan(spec, workers=limits.workers, gpu_mb=gpu_mb)
    problem = memory_plan.task_fit_problem(memory_limit_mb, gpu_mb)
    if problem is None:
        return spec, ""
    automatic = tuple(axis for axis in SHRINK_ORDER if getattr(config, f"tile_{axis}") is None)
    tiles = memory_plan.smaller_tiles(memory_limit_mb, gpu_mb, automatic)
    if tiles is None:
        return spec, ""
    before = dataclasses.asdict(memory_plan.tiles)
    changed = {axis: tiles[axis] for axis in automatic if tiles[axis] != before[axis]}
    fitted = spec.with_config(**{f"tile_{axis}": size for axis, size in changed.items()})
    shrunk = ", ".join(f"{axis} {before[axis]} -> {size}" for axis, size in changed.items())
    return fitted, f"automatic tiles shrunk ({shrunk}): with the default ones {problem}"
