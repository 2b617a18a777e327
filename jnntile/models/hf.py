"""Hugging Face checkpoint files, for every family: config.json and safetensors weights, in one
`model.safetensors` or in shards listed by `model.safetensors.index.json`, as `save_pretrained` writes them.

What differs between families is a small layout module of each (`<family>/hf.py`, `families.HFLayout`): how
its tensors are named in the files and how Hugging Face's layouts map to its model's. This module does the
files for all of them: it checks every header, name and shape before anything is read, and returns the tensors
unread (`jnntile.tensorfile.FileTensor`), to be streamed into tiles chunk by chunk; it writes tiled parameters
straight from their tiles, each file under a temporary name then renamed, so a crash never leaves a half-written
file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jnntile.io import jsonfile
from jnntile.io.tensorfile import FileTensor, SafetensorsFile, checked_parameters, write_atomically, write_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config_dict(directory) -> dict:
    """The JSON object of a Hugging Face checkpoint's config.json, or an error naming what is wrong with it."""
    return jsonfile.read_object(Path(directory) / CONFIG_FILE,
                                missing=f"a Hugging Face checkpoint directory holds {CONFIG_FILE} and its "
                                        "safetensors weights",
                                damaged="the checkpoint is damaged")


def read_config(directory, config_class, **tiles):
    """`config_class.from_hf_dict` of a checkpoint directory's config.json, with `tiles`; errors name the file."""
    try:
        return config_class.from_hf_dict(read_config_dict(directory), **tiles)
    except ValueError as e:
        raise ValueError(f"{Path(directory) / CONFIG_FILE}: {e}") from None


def weight_files(directory) -> tuple[Path, dict[str, FileTensor]]:
    """(the file that lists them, every tensor unread by name) of a checkpoint's safetensors file or shards,
    every header checked."""
    directory = Path(directory)
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        return single, dict(SafetensorsFile(single).items())
    if not index.is_file():
        raise FileNotFoundError(f"neither {single} nor {index} exists: a Hugging Face checkpoint needs "
                                f"{CONFIG_FILE} and its safetensors weights")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index with a weight_map ({e!r}): the checkpoint is "
                         "damaged") from None
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        path = directory / shard
        if not path.is_file():
            raise FileNotFoundError(f"{path}, a shard {index} lists, is missing")
        for name, tensor in SafetensorsFile(path).items():
            if weight_map.get(name) != shard:
                raise ValueError(f"{path} holds {name!r}, which {index} places in {weight_map.get(name)!r}")
            tensors[name] = tensor
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise ValueError(f"{index} lists {absent[:3]} ({len(absent)} in all), which no shard holds")
    return index, tensors


def checked(params: dict, config, source) -> dict:
    """`params` if they are exactly the parameters of `config` (`tensorfile.checked_parameters`), in its order."""
    return checked_parameters(params, config, source, f"the model of this config ({config.describe()})")


def open_hf(directory, config_class, layout, **tiles) -> tuple:
    """(config, params) of a checkpoint directory of the family of `config_class` and `layout`, checked and
    unread: params by the names of `config.param_shapes()`, in its order. Raises naming the file and the problem
    (damaged or truncated file, missing, unexpected or misshapen tensor, a dtype jnntile cannot read) before
    anything is read."""
    config = read_config(directory, config_class, **tiles)
    source, tensors = weight_files(directory)
    return config, checked(layout.from_files(config, tensors, source), config, source)


def save_hf(directory, config, params: dict, layout, dtype: str = "float32",
            max_shard_bytes: int | None = None) -> None:
    """Writes config.json and the weights (in `dtype`, float32 or bfloat16 rounded to nearest even) into
    directory, creating it: one model.safetensors, or, where they are larger than `max_shard_bytes`
    (transformers' max_shard_size; None: no limit), shards of at most that (a larger tensor alone in one) and
    their index. `params` by the names of
    `config.param_shapes()`: arrays, or tiled views (`Reshaped`, `Derived`) streamed from their tiles."""
    tensors = layout.to_files(config, checked(params, config, "the params to save"))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    itemsize = np.dtype(dtype).itemsize
    shards = _shards(tensors, itemsize, max_shard_bytes)
    # "format": "pt" is the metadata transformers requires to load the file.
    for file, names in shards.items():
        write_atomically(directory / file, lambda path, names=names: write_file(
            path, {name: tensors[name] for name in names}, metadata={"format": "pt"}, float_dtype=dtype))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t, itemsize) for t in tensors.values())},
                 "weight_map": {name: file for file, names in shards.items() for name in names}}
        _write_text(directory / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    _remove_other_weights(directory, shards)
    _write_text(directory / CONFIG_FILE, json.dumps({**config.to_hf_dict(), "torch_dtype": dtype}, indent=2) + "\n")


def _nbytes(tensor, itemsize: int) -> int:
    return math.prod(tensor.shape) * itemsize


def _shards(tensors: dict, itemsize: int, max_bytes: int | None) -> dict[str, list[str]]:
    """{file: tensor names} in order: WEIGHTS_FILE alone when everything fits in `max_bytes`, else shards named
    as transformers names them, each filled up to `max_bytes`."""
    groups, size = [[]], 0
    for name, tensor in tensors.items():
        nbytes = _nbytes(tensor, itemsize)
        if groups[-1] and max_bytes is not None and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {WEIGHTS_FILE: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": names for i, names in enumerate(groups, 1)}


def _remove_other_weights(directory: Path, shards: dict) -> None:
    """Removes the weights an earlier save left in `directory` that this one did not write (a single file where
    shards were written now, shards of another count, their index): a reader would take them for this one's."""
    kept = set(shards) | ({INDEX_FILE} if len(shards) > 1 else set())
    for path in (directory / WEIGHTS_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")):
        if path.name not in kept:
            path.unlink(missing_ok=True)


def _write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: Path(tmp).write_text(text))
