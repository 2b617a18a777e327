"""Model families, one package each (`gpt2/`, `llama/`): config, the model on jnntile's modules, Hugging
Face files, and a pure-JAX reference that only tests and benchmarks use as an oracle."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

# The logical axes a model cuts into tiles, each with a tile_<axis> field on its config (None: automatic).
# tile_heads counts heads per tile; tile_hidden is the MLP's hidden axis.
TILE_AXES = ("batch", "seq", "embd", "heads", "hidden", "vocab")


@dataclasses.dataclass(frozen=True)
class TileSizes:
    """The tile_<axis> fields every model config has (None lets jnntile choose; see TILE_AXES)."""

    tile_batch: Optional[int] = None
    tile_seq: Optional[int] = None
    tile_embd: Optional[int] = None
    tile_heads: Optional[int] = None
    tile_hidden: Optional[int] = None
    tile_vocab: Optional[int] = None

    def check_tile_sizes(self) -> None:
        for axis in TILE_AXES:
            value = getattr(self, f"tile_{axis}")
            if value is not None and (not is_int(value) or value <= 0):
                raise ValueError(f"tile_{axis}={value!r} must be a positive integer, or None to let jnntile choose")


def is_int(value) -> bool:
    """An integer (numpy's too) that is not a bool (True would pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
