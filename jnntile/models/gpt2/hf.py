"""Read and write Hugging Face GPT-2 checkpoints (config.json + model.safetensors).

The files are those of `GPT2LMHeadModel.save_pretrained(safe_serialization=True)`:
tensors named "transformer.<name>" in Conv1D layout, the LM head omitted
because it is tied to wte. Loading also accepts the unprefixed names of older
checkpoints (e.g. openai-community/gpt2) and skips the causal-mask buffers
they carry. Parameters use the unprefixed names of `GPT2Config.param_shapes`.

Nothing here needs a whole checkpoint in RAM: `open_hf` checks both files and
returns the tensors unread (`jnntile.tensorfile.FileTensor`), which
`GPT2.load_hf_params` streams into tiles chunk by chunk, and `save_hf` writes
tiled parameters (`jnntile.tensorfile.Reshaped`, from `GPT2.to_hf_params`)
straight from their tiles. `load_hf` reads every tensor into numpy (for tests and
benchmarks that run the pure-JAX reference).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jnntile.ops import data as data_ops
from jnntile.tensorfile import (FileTensor, Reshaped, SafetensorsFile, checked_parameters, write_atomically,
                               write_file)

from jnntile.models import HF_CONFIG_FILE as CONFIG_FILE
from jnntile.models import config_from_hf

from .config import GPT2Config

WEIGHTS_FILE = "model.safetensors"
_PREFIX = "transformer."
# Non-parameter buffers (the causal mask and its fill value) that older
# transformers versions stored with every attention layer.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_LM_HEAD = "lm_head.weight"


def read_config(directory, **tiles) -> GPT2Config:
    """The GPT2Config of a Hugging Face GPT-2 checkpoint directory (its config.json), with `tiles` (tile_* sizes)."""
    return config_from_hf(directory, GPT2Config, **tiles)


def open_hf(directory, **tiles) -> tuple[GPT2Config, dict[str, FileTensor]]:
    """(config, params) of a Hugging Face GPT-2 checkpoint directory, checked and unread.

    Params are keyed by reference (unprefixed) names; each is read when asked
    (np.asarray, or chunk by chunk by GPT2.load_hf_params). Raises ValueError
    naming the file and the problem (damaged or truncated file, missing,
    unexpected or misshapen tensor, untied LM head) before anything is read.
    """
    directory = Path(directory)
    weights_path = directory / WEIGHTS_FILE
    config = read_config(directory, **tiles)
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} not found: a Hugging Face GPT-2 checkpoint needs "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    tensors = {}
    lm_head = None
    for key, value in SafetensorsFile(weights_path).items():
        if key.endswith(_BUFFER_SUFFIXES):
            continue
        if key == _LM_HEAD:
            lm_head = value
            continue
        name = key.removeprefix(_PREFIX)
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears both with and without the "
                             f"{_PREFIX!r} prefix in {weights_path}")
        tensors[name] = value

    params = _checked(tensors, config, weights_path)
    if lm_head is not None and not _same_values(lm_head, params["wte.weight"]):
        raise ValueError(f"{_LM_HEAD} in {weights_path} differs from wte.weight: "
                         "untied LM heads are unsupported")
    return config, params


def load_hf(directory) -> tuple[GPT2Config, dict[str, np.ndarray]]:
    """Load (config, params) from a Hugging Face GPT-2 checkpoint directory.
    Params are float32 numpy arrays keyed by reference (unprefixed) names."""
    config, params = open_hf(directory)
    return config, {name: value.read().astype(np.float32, copy=False) for name, value in params.items()}


def save_hf(directory, config: GPT2Config, params: dict, dtype: str = "float32") -> None:
    """Write config.json and model.safetensors (in `dtype`, float32 or bfloat16; "transformer."-prefixed
    names, no lm_head) into directory, creating it. Params are arrays or tiled
    parameters (`Reshaped`, streamed from their tiles). Each file is written to
    a temporary name and renamed, so a crash never leaves a half-written file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    checked = _checked(params, config, "the params to save")
    tensors = {_PREFIX + name: value if isinstance(value, Reshaped) and value.dtype == np.float32 else
               np.asarray(value, np.float32) for name, value in checked.items()}

    # "format": "pt" is the metadata transformers requires to load the file.
    write_atomically(directory / WEIGHTS_FILE, lambda path: write_file(path, tensors, metadata={"format": "pt"},
                                                                      float_dtype=dtype))
    text = json.dumps({**config.to_hf_dict(), "torch_dtype": dtype}, indent=2) + "\n"
    write_atomically(directory / CONFIG_FILE, lambda path: Path(path).write_text(text))


def _checked(tensors: dict, config: GPT2Config, source) -> dict:
    """The parameters of config in `tensors`, checked (`tensorfile.checked_parameters`), in reference order."""
    return checked_parameters(tensors, config, source, f"a GPT-2 with n_layer={config.n_layer}")


def _same_values(a: FileTensor, b: FileTensor) -> bool:
    """Whether two (V, C) tensors of a file hold the same values, compared a block of rows at a time."""
    if a.shape != b.shape:
        return False
    rows = max(1, data_ops.CHUNK_BYTES * a.shape[0] // max(1, a.nbytes))
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


def lora_to_peft(config: GPT2Config, path: str, a: np.ndarray, b: np.ndarray) -> dict:
    """{Hugging Face module: (lora_A (rank, in), lora_B (out, rank))} of the adapter of Linear `path`
    ("h.0.attn.c_attn"), whose factors are stored input-first: a (*in, rank), b (rank, *out)."""
    rank = a.shape[-1]
    return {_PREFIX + path: (a.reshape(-1, rank).T, b.reshape(rank, -1).T)}


def lora_from_peft(config: GPT2Config, path: str, peft: dict, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `lora_to_peft`: (a, b) in this model's layout from PEFT's {module: (lora_A, lora_B)}."""
    lora_a, lora_b = peft[_PREFIX + path]
    return np.asarray(lora_a).T.reshape(a_shape), np.asarray(lora_b).T.reshape(b_shape)
