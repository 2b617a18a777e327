"""The Llama family (Llama 2/3, TinyLlama, SmolLM, Qwen2, Mistral): its configuration (`config`) and the
pure-JAX reference (`reference`, a test oracle). The tiled model comes with the Llama ops."""

from .config import PRESETS, LlamaConfig

__all__ = ["LlamaConfig", "PRESETS"]
