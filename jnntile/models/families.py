"""The model families the commands know, the contract a family fulfils, and the one place that picks a family.

A family is its own package (`gpt2/`, `llama/`) registered by one `Family` entry in FAMILIES: its config class
(`ModelConfig`), its model class (`Model`, on `jnntile.models.LanguageModel`) and its Hugging Face layout module
(`HFLayout`; `jnntile.models.hf` reads and writes the files for every family). The commands (train, generate,
memory), checkpoints, the planner and LoRA only go through these and the functions here: a preset name, a config
or a checkpoint directory selects the family, and the commands' help texts list what FAMILIES holds, so a new
family touches no command.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import numpy as np

from jnntile import nn
from jnntile.models import gpt2, hf, llama
from jnntile.models.llama.config import MODEL_TYPES as LLAMA_MODEL_TYPES


class ModelConfig(Protocol):
    """A family's config: a frozen dataclass on `jnntile.models.ExecutionFields` (tile_*, remat, dtype)."""

    FLAG_FIELDS: ClassVar[dict[str, str]]  # generic flag (n_layer, n_head, n_embd, max_positions) -> field
    vocab_size: int
    dropout: float

    @property
    def max_positions(self) -> int: ...
    @property
    def n_blocks(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    def axis_sizes(self) -> dict[str, int]: ...  # embd, heads (key/value heads), hidden, vocab
    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...  # Hugging Face's names and shapes, in file order
    def n_params(self) -> int: ...
    def describe(self) -> str: ...
    def kv_cache_bytes(self, batch: int, length: int) -> int: ...
    def to_hf_dict(self) -> dict[str, Any]: ...
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> ModelConfig: ...  # refuses what it cannot run
    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig: ...


class Model(Protocol):
    """A family's causal LM, built by `Model(config, batch_size=, seq_len=, seed=)`; `LanguageModel` gives all
    but the forward."""

    config: ModelConfig
    hf_layout: ClassVar[HFLayout]

    def __call__(self, idx, targets=None, *, dropout_seed=None, ignore_index: int = -100, cache=None):
        """(logits, loss or None) of int32 (B, T) Tensors; with a `kv_cache`, a decoding step over it."""
    def head(self, x): ...  # logits of the last block's output
    def token_tensor(self, ids, *, allow_ignore: bool = False, ignore_index: int = -100): ...
    def loss(self, idx, targets, dropout_seed=None): ...
    def kv_cache(self, batch_size: int, max_len: int): ...
    def named_params(self) -> dict: ...
    def to_hf_params(self) -> dict: ...
    def load_hf_params(self, params: dict) -> None: ...


class HFLayout(Protocol):
    """A family's names and layouts in Hugging Face files and PEFT adapters (a module, `<family>/hf.py`).
    Parameters are by the names of `config.param_shapes()`, in Hugging Face's layouts."""

    LORA_TARGETS: dict[str, str]  # PEFT's target name -> the model's Linear module that holds it

    def from_files(self, config, tensors: dict, source) -> dict:
        """The parameters among a file's tensors (by the file's names); `source` names the file in errors."""
    def to_files(self, config, params: dict) -> dict: ...  # the inverse: by the file's names
    def to_model(self, config, params: dict) -> dict: ...  # the model's parameters (by `named_params` name) as views
    def from_model(self, config, tensors: dict) -> dict: ...  # the inverse, of the model's parameter Tensors
    def lora_parts(self, config, module: str) -> dict: ...  # {PEFT target: its output rows in `module`, or None}
    def lora_module(self, path: str, part: str) -> str: ...  # the Hugging Face module of a Linear's part
    def lora_to_peft(self, config, part: str, a, b) -> tuple: ...  # (lora_A, lora_B) of one adapter
    def lora_from_peft(self, config, part: str, lora_a, lora_b, a_shape, b_shape) -> tuple: ...  # (a, b)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    title: str  # for help texts
    model_types: tuple[str, ...]  # the config.json model_type values it reads
    config: type[ModelConfig]
    model: type[Model]
    hf: HFLayout
    presets: dict


FAMILIES = (
    Family("gpt2", "GPT-2", ("gpt2",), gpt2.GPT2Config, gpt2.GPT2, gpt2.hf, gpt2.PRESETS),
    Family("llama", "the Llama family (Llama, Mistral, Qwen2)", LLAMA_MODEL_TYPES, llama.LlamaConfig, llama.Llama,
           llama.hf, llama.PRESETS),
)
# Every preset name, each in one family.
PRESETS = {name: family for family in FAMILIES for name in family.presets}
MODEL_TYPES = tuple(t for family in FAMILIES for t in family.model_types)
# For help texts: "GPT-2 or the Llama family (...)", and the presets of each.
TITLES = " or ".join(family.title for family in FAMILIES)
PRESETS_HELP = "; ".join(f"{family.title}: {', '.join(family.presets)}" for family in FAMILIES)


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
    model_type = hf.read_config_dict(directory).get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"{directory}: model_type {model_type!r} in config.json is not supported; jnntile reads "
                     f"{', '.join(MODEL_TYPES)}")


def read_config(directory, **tiles):
    """The config of a Hugging Face checkpoint directory, of whichever family, with `tiles` (tile_* sizes)."""
    return hf.read_config(directory, of_checkpoint(directory).config, **tiles)


def open_hf(directory, **tiles):
    """(config, params) of a Hugging Face checkpoint directory, of whichever family: every file checked,
    the tensors unread, by the names of `config.param_shapes()`."""
    family = of_checkpoint(directory)
    return hf.open_hf(directory, family.config, family.hf, **tiles)


def load_hf(directory):
    """(config, params) of a Hugging Face checkpoint directory, every tensor read into a float32 numpy array
    (for tests and benchmarks that run the pure-JAX references)."""
    config, params = open_hf(directory)
    return config, {name: value.read().astype(np.float32, copy=False) for name, value in params.items()}


def build(config, *, batch_size: int, seq_len: int, seed: int = 0, progress: bool = False):
    """The model of `config`'s family; with `progress`, a bar of its parameters drawn (`nn.progress`)."""
    with nn.progress(config.n_params(), "drawing the parameters", enabled=progress):
        return of_config(config).model(config, batch_size=batch_size, seq_len=seq_len, seed=seed)


def from_hf(directory, *, batch_size: int, seq_len: int, seed: int = 0, progress: bool = False, **tiles):
    """A model built from a Hugging Face checkpoint directory (any registered family), its tensors streamed
    into the tiles; `tiles` sets tile_* sizes; with `progress`, a bar of the parameters loaded."""
    config, params = open_hf(directory, **tiles)
    with nn.uninitialized():  # every parameter is overwritten from the files next
        model = build(config, batch_size=batch_size, seq_len=seq_len, seed=seed)
    with nn.progress(config.n_params(), f"loading {directory}", enabled=progress):
        model.load_hf_params(params)
    return model


def save_hf(model, directory, dtype: str = "float32", max_shard_bytes: int | None = None) -> None:
    """Writes `model` as a Hugging Face checkpoint directory of its family (`write_hf`)."""
    write_hf(directory, model.config, model.to_hf_params(), dtype, max_shard_bytes)


def write_hf(directory, config, params: dict, dtype: str = "float32", max_shard_bytes: int | None = None) -> None:
    """Writes config.json and the weights of `params` (by the names of `config.param_shapes()`) in `dtype`
    (float32, or bfloat16 rounded to nearest even from float32), in shards of `max_shard_bytes` where they are
    larger (`jnntile.models.hf.save_hf`)."""
    hf.save_hf(directory, config, params, of_config(config).hf, dtype, max_shard_bytes)
