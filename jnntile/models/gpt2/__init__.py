"""GPT-2: its configuration (`config`), the tiled model (`model`), its layout in Hugging Face files (`hf`) and the
pure-JAX reference (`reference`, for tests). The model's API is re-exported here: `gpt2.GPT2`."""

from .config import PRESETS, GPT2Config
from . import hf
from .model import GPT2

__all__ = ["GPT2", "GPT2Config", "PRESETS", "hf"]
