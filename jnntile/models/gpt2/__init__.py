"""GPT-2: its configuration (`config`), the tiled model (`model`), Hugging Face files (`hf`) and the
pure-JAX reference (`reference`, for tests). The model's API is re-exported here: `gpt2.GPT2`."""

from .config import PRESETS, GPT2Config
from .model import GPT2, Tiles, from_hf, loss_and_grads, resolve_tiles, save_hf

__all__ = ["GPT2", "GPT2Config", "PRESETS", "Tiles", "from_hf", "loss_and_grads", "resolve_tiles", "save_hf"]
