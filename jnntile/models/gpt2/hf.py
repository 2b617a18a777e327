"""GPT-2's names and layouts in Hugging Face files (`families.HFLayout`; `jnntile.models.hf` does the files).

The files are those of `GPT2LMHeadModel.save_pretrained(safe_serialization=True)`: tensors named
"transformer.<name>" in Conv1D layout, the LM head omitted because it is tied to wte. Reading also accepts the
unprefixed names of older checkpoints (e.g. openai-community/gpt2) and skips the causal-mask buffers they carry.
Parameters use the unprefixed names of `GPT2Config.param_shapes`; the model (`model.GPT2`) has the same names,
with more axes where tiling wants them:

    c_attn.weight  HF (C, 3C)   here (C, 3, H, D)   so q, k and v of a head tile are separate tiles
    c_attn.bias    HF (3C,)     here (3, H, D)
    attn.c_proj.weight HF (C, C) here (H, D, C)     contracts the attention output (B, T, H, D) over (H, D)
"""

from __future__ import annotations

import numpy as np

from jnntile.ops import values as values_ops
from jnntile.io.tensorfile import FileTensor, Reshaped, Stacked

from .config import GPT2Config

_PREFIX = "transformer."
# Non-parameter buffers (the causal mask and its fill value) that older
# transformers versions stored with every attention layer.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_LM_HEAD = "lm_head.weight"


def from_files(config: GPT2Config, tensors: dict, source) -> dict:
    """The parameters (unchecked) among a file's tensors: prefixes and buffers dropped, a tied LM head checked
    against wte.weight and dropped."""
    params = {}
    lm_head = None
    for key, value in tensors.items():
        if key.endswith(_BUFFER_SUFFIXES):
            continue
        if key == _LM_HEAD:
            lm_head = value
            continue
        name = key.removeprefix(_PREFIX)
        if name in params:
            raise ValueError(f"tensor {name!r} appears both with and without the {_PREFIX!r} prefix in {source}")
        params[name] = value
    wte = params.get("wte.weight")
    # A misshapen wte is reported by the shape check that follows.
    if lm_head is not None and wte is not None and tuple(wte.shape) == (config.vocab_size, config.n_embd) and \
            not _same_values(lm_head, wte):
        raise ValueError(f"{_LM_HEAD} in {source} differs from wte.weight: untied LM heads are unsupported")
    return params


def to_files(config: GPT2Config, params: dict) -> dict:
    """The file's names of the parameters (those of save_pretrained: prefixed, no lm_head)."""
    return {_PREFIX + name: value for name, value in params.items()}


def to_model(config: GPT2Config, params: dict) -> dict:
    """`model.GPT2`'s parameters (same names) as views of Hugging Face tensors in the model's shapes."""
    out = {}
    for name, value in params.items():
        shape = _model_shape(config, name, tuple(np.shape(value)))
        out[name] = value if shape == tuple(np.shape(value)) else Stacked([(value, shape, tuple(range(len(shape))))])
    return out


def from_model(config: GPT2Config, tensors: dict) -> dict:
    """Hugging Face's tensors (in `param_shapes` order) of `model.GPT2`'s parameter Tensors: unread views."""
    return {name: Reshaped(tensors[name], shape) for name, shape in config.param_shapes().items()}


def _model_shape(config: GPT2Config, name: str, shape: tuple) -> tuple:
    """The model's shape of a parameter of Hugging Face's `shape` (they differ only in grouping of axes)."""
    H, D = config.n_head, config.head_dim
    if name.endswith("c_attn.weight"):
        return (shape[0], 3, H, D)
    if name.endswith("c_attn.bias"):
        return (3, H, D)
    if name.endswith("attn.c_proj.weight"):
        return (H, D, shape[1])
    return shape


def _same_values(a: FileTensor, b: FileTensor) -> bool:
    """Whether two (V, C) tensors of a file hold the same values, compared a block of rows at a time."""
    if a.shape != b.shape:
        return False
    rows = max(1, values_ops.CHUNK_BYTES * a.shape[0] // max(1, a.nbytes))
    for start in range(0, a.shape[0], rows):
        stop = min(start + rows, a.shape[0])
        block = lambda t: t.read(a.shape, (start,) + (0,) * (len(a.shape) - 1), (stop,) + a.shape[1:])  # noqa: E731
        if not np.array_equal(block(a).astype(np.float32), block(b).astype(np.float32)):
            return False
    return True


# ---- LoRA adapters in PEFT's names and layouts ------------------------------------------------------

# PEFT target name -> the Linear modules of `model.GPT2` it adapts (the last part of their path). GPT-2's
# projections are one tensor each in Hugging Face's files too, so an adapter here is PEFT's exactly.
LORA_TARGETS = {"c_attn": "c_attn", "c_proj": "c_proj", "c_fc": "c_fc"}


def lora_parts(config: GPT2Config, module: str) -> dict:
    """{PEFT target: None}: each adapter covers its whole module."""
    return {module: None}


def lora_module(path: str, part: str) -> str:
    """The Hugging Face module of Linear `path` ("h.0.attn.c_attn")."""
    return _PREFIX + path


def lora_to_peft(config: GPT2Config, part: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A (rank, in), lora_B (out, rank)) of an adapter whose factors are stored input-first: a (*in, rank),
    b (rank, *out)."""
    rank = a.shape[-1]
    return a.reshape(-1, rank).T, b.reshape(rank, -1).T


def lora_from_peft(config: GPT2Config, part: str, lora_a, lora_b, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `lora_to_peft`: (a, b) in this model's layout from PEFT's lora_A, lora_B."""
    return np.asarray(lora_a).T.reshape(a_shape), np.asarray(lora_b).T.reshape(b_shape)
