"""Read and write Hugging Face GPT-2 checkpoints (config.json + model.safetensors).

The files are those of `GPT2LMHeadModel.save_pretrained(safe_serialization=True)`:
tensors named "transformer.<name>" in Conv1D layout, the LM head omitted
because it is tied to wte. Loading also accepts the unprefixed names of older
checkpoints (e.g. openai-community/gpt2) and skips the causal-mask buffers
they carry. Parameters use the names of `models.gpt2_reference`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import safetensors.numpy

from .config import GPT2Config
from .gpt2_reference import param_shapes

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_PREFIX = "transformer."
# Non-parameter buffers (the causal mask and its fill value) that older
# transformers versions stored with every attention layer.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_LM_HEAD = "lm_head.weight"


def load_hf(directory) -> tuple[GPT2Config, dict[str, np.ndarray]]:
    """Load (config, params) from a Hugging Face GPT-2 checkpoint directory.
    Params are float32 numpy arrays keyed by reference (unprefixed) names."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    weights_path = directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a Hugging Face GPT-2 checkpoint needs "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    with open(config_path) as f:
        config = GPT2Config.from_hf_dict(json.load(f))

    tensors = {}
    lm_head = None
    for key, value in safetensors.numpy.load_file(weights_path).items():
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

    params = _checked_float32(tensors, config, weights_path)
    if lm_head is not None and not np.array_equal(lm_head, params["wte.weight"]):
        raise ValueError(f"{_LM_HEAD} in {weights_path} differs from wte.weight: "
                         "untied LM heads are unsupported")
    return config, params


def save_hf(directory, config: GPT2Config, params: dict) -> None:
    """Write config.json and model.safetensors (float32, "transformer."-prefixed
    names, no lm_head) into directory, creating it. Each file is written to a
    temporary name and renamed, so a crash never leaves a half-written file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(value) for name, value in params.items()}  # jax -> numpy
    arrays = _checked_float32(arrays, config, "the params to save")
    tensors = {_PREFIX + name: np.ascontiguousarray(value) for name, value in arrays.items()}

    # "format": "pt" is the metadata transformers requires to load the file.
    _write_atomically(directory / WEIGHTS_FILE,
                      lambda path: safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"}))
    text = json.dumps(config.to_hf_dict(), indent=2) + "\n"
    _write_atomically(directory / CONFIG_FILE, lambda path: Path(path).write_text(text))


def _checked_float32(tensors: dict, config: GPT2Config, source) -> dict[str, np.ndarray]:
    """Check that tensors holds exactly the parameters of config, with the right
    shapes, and return them as float32 in reference order."""
    expected = param_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"tensor {name!r} (expected shape {shape}) is missing from {source}")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ValueError(f"tensor {name!r} has shape {found} in {source}, expected {shape} "
                             f"for {config}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise ValueError(f"unexpected tensor {name!r} with shape {tuple(tensors[name].shape)} in "
                         f"{source} ({len(unexpected)} unexpected in all); a GPT-2 with "
                         f"n_layer={config.n_layer} has only {len(expected)} parameter tensors")
    out = {}
    for name in expected:
        value = tensors[name]
        if not np.issubdtype(value.dtype, np.floating):
            raise ValueError(f"tensor {name!r} in {source} has dtype {value.dtype}, expected floating point")
        out[name] = value.astype(np.float32, copy=False)
    return out


def _write_atomically(path: Path, write) -> None:
    # The temporary file lives in the same directory so os.replace is a rename
    # within one file system, which is atomic.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # Temporary files are owner-only; a checkpoint is meant to be shared.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
