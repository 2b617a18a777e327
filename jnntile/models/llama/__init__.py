"""The Llama family (Llama 2/3, TinyLlama, SmolLM, Qwen2, Mistral): its configuration (`config`), the tiled
model (`model`), its layout in Hugging Face files (`hf`) and the pure-JAX reference (`reference`, a test
oracle). The model's API is re-exported here: `llama.Llama`."""

from .config import PRESETS, LlamaConfig
from . import hf
from .model import Llama

__all__ = ["Llama", "LlamaConfig", "PRESETS", "hf"]
