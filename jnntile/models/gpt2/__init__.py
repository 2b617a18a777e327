"""GPT-2: its configuration (`config`), the tiled model (`model`), Hugging Face files (`hf`) and the
pure-JAX reference (`reference`, for tests). The model's API is re-exported here: `gpt2.GPT2`."""

from .config import PRESETS, GPT2Config
from .model import GPT2, loss_and_grads

__all__ = ["GPT2", "GPT2Config", "PRESETS", "loss_and_grads"]
