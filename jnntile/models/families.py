"""The model families the commands know, and the one place that picks a family.

A family is registered by one `Family` entry: its config class (presets, Hugging Face config.json), its
model class, and its Hugging Face module (`read_config`, `open_hf`, `save_hf`). The commands (train,
generate, memory) and checkpoints only go through the functions here: a preset name, a config or a
checkpoint directory selects the family, so a new family touches no command.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from jnntile import nn
from jnntile.models import gpt2, llama, read_hf_config
from jnntile.models.gpt2 import hf as gpt2_hf
from jnntile.models.llama import hf as llama_hf
from jnntile.models.llama.config import MODEL_TYPES as LLAMA_MODEL_TYPES


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the config.json model_type values it reads
    config: type  # preset(name, **overrides), from_hf_dict, param_shapes, n_params, axis_sizes
    model: type  # model(config, *, batch_size, seq_len, seed); max_positions, named_params, load_hf_params...
    hf: ModuleType  # read_config(directory, **tiles), open_hf(directory, **tiles), save_hf(directory, config, params, dtype)
    presets: dict


FAMILIES = (
    Family("gpt2", ("gpt2",), gpt2.GPT2Config, gpt2.GPT2, gpt2_hf, gpt2.PRESETS),
    Family("llama", LLAMA_MODEL_TYPES, llama.LlamaConfig, llama.Llama, llama_hf, llama.PRESETS),
)
# Every preset name, each in one family.
PRESETS = {name: family for family in FAMILIES for name in family.presets}
MODEL_TYPES = tuple(t for family in FAMILIES for t in family.model_types)


def preset(name: str, **overrides):
    """The config of preset `name` (of any family) with fields replaced by `overrides`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name].config.preset(name, **overrides)


def size_overrides(preset_name: str, **sizes) -> dict:
    """The config fields of preset `preset_name`'s family that the commands' generic size flags set: `sizes`
    by FLAG_FIELDS key (n_layer, n_head, n_embd, max_positions), those given (not None) only."""
    fields = PRESETS[preset_name].config.FLAG_FIELDS
    return {fields[flag]: value for flag, value in sizes.items() if value is not None}


def of_config(config) -> Family:
    for family in FAMILIES:
        if isinstance(config, family.config):
            return family
    raise TypeError(f"{type(config).__name__} is not the config of a registered model family")


def of_checkpoint(directory) -> Family:
    """The family of a Hugging Face checkpoint directory, from its config.json's model_type."""
    model_type = read_hf_config(directory).get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"{directory}: model_type {model_type!r} in config.json is not supported; jnntile reads "
                     f"{', '.join(MODEL_TYPES)}")


def read_config(directory, **tiles):
    """The config of a Hugging Face checkpoint directory, of whichever family, with `tiles` (tile_* sizes)."""
    return of_checkpoint(directory).hf.read_config(directory, **tiles)


def open_hf(directory, **tiles):
    """(config, params) of a Hugging Face checkpoint directory, of whichever family: every file checked,
    the tensors unread."""
    return of_checkpoint(directory).hf.open_hf(directory, **tiles)


def build(config, *, batch_size: int, seq_len: int, seed: int = 0):
    """The model of `config`'s family."""
    return of_config(config).model(config, batch_size=batch_size, seq_len=seq_len, seed=seed)


def from_hf(directory, *, batch_size: int, seq_len: int, seed: int = 0, **tiles):
    """A model built from a Hugging Face checkpoint directory (any registered family), its tensors streamed
    into the tiles; `tiles` sets tile_* sizes."""
    config, params = open_hf(directory, **tiles)
    with nn.uninitialized():  # every parameter is overwritten from the files next
        model = build(config, batch_size=batch_size, seq_len=seq_len, seed=seed)
    model.load_hf_params(params)
    return model


def save_hf(model, directory, dtype: str = "float32") -> None:
    """Writes `model` as a Hugging Face checkpoint directory of its family (config.json, model.safetensors in
    `dtype`: float32, or bfloat16 rounded to nearest even from the float32 parameters)."""
    of_config(model.config).hf.save_hf(directory, model.config, model.to_hf_params(), dtype)
