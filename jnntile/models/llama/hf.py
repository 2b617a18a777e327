"""Read and write Hugging Face Llama-family checkpoints (config.json + safetensors, one file or shards).

The files are those of `LlamaForCausalLM` (and Mistral's, Qwen2's) `save_pretrained`: tensors in
float32, bfloat16 or float16 under the names of `LlamaConfig.param_shapes`, in one `model.safetensors` or
in shards listed by `model.safetensors.index.json`. A tied head's `lm_head.weight`, when a file carries
one, is skipped (the embeddings serve).

Nothing needs a whole checkpoint in RAM: `open_hf` checks the files and returns the tensors unread
(`jnntile.tensorfile.FileTensor`); `to_model` describes each parameter of `model.Llama` as the file
tensors it is made of (`tensorfile.Stacked`: q, k and v for the fused projection, gate and up), which
`load_into` streams into the tiles chunk by chunk. `save_hf` writes float32 or bfloat16 files in Hugging Face's
names: a tensor that is a parameter as it is streams from its tiles, one cut from a fused parameter
(q_proj from qkv_proj) is computed when it is written, one at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jnntile.tensorfile import (Derived, FileTensor, Reshaped, SafetensorsFile, Stacked, checked_parameters,
                               write_atomically, write_file)

from jnntile.models import HF_CONFIG_FILE as CONFIG_FILE
from jnntile.models import config_from_hf

from .config import LlamaConfig

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LM_HEAD = "lm_head.weight"


def read_config(directory, **tiles) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face checkpoint directory (its config.json), with `tiles` (tile_* sizes)."""
    return config_from_hf(directory, LlamaConfig, **tiles)


def weight_files(directory) -> dict[str, FileTensor]:
    """Every tensor of a checkpoint's safetensors file or shards, unread, by name (headers checked)."""
    directory = Path(directory)
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        return dict(SafetensorsFile(single).items())
    if not index.is_file():
        raise FileNotFoundError(f"neither {single} nor {index} exists: a Hugging Face checkpoint needs its weights")
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
    return tensors


def open_hf(directory, **tiles) -> tuple[LlamaConfig, dict[str, FileTensor]]:
    """(config, params) of a checkpoint directory, checked and unread: params by Hugging Face name in
    `config.param_shapes()` order. Raises naming the file and the problem (damaged or truncated file,
    missing, unexpected or misshapen tensor, a dtype jnntile cannot read) before anything is read."""
    config = read_config(directory, **tiles)
    tensors = weight_files(directory)
    if config.tie_word_embeddings:
        tensors.pop(_LM_HEAD, None)
    return config, checked(tensors, config, f"{directory}")


def checked(tensors: dict, config: LlamaConfig, source) -> dict:
    """`tensors` if they are exactly the parameters of `config` (`tensorfile.checked_parameters`), in its order."""
    return checked_parameters(tensors, config, source, f"a {config.model_type} with these settings")


def _model_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def to_model(config: LlamaConfig, params: dict) -> dict:
    """`model.Llama`'s parameters (by `Llama.named_params` name) as views of Hugging Face tensors (by name)."""
    KV, G, D, C, I = (config.num_key_value_heads, config.kv_groups, config.head_dim, config.hidden_size,
                      config.intermediate_size)
    out = {}
    for name, value in params.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue  # fused with q_proj, gate_proj
        if ".self_attn.q_proj." in name:
            prefix, kind = name.split(".self_attn.q_proj.")
            part = lambda which: params[f"{prefix}.self_attn.{which}_proj.{kind}"]  # noqa: E731
            trailing = (D, C) if kind == "weight" else (D,)
            identity = tuple(range(2 + len(trailing)))
            out[_model_name(f"{prefix}.self_attn.qkv_proj.{kind}")] = Stacked([
                (part("q"), (KV, G) + trailing, (1, 0) + identity[2:]),  # query head kv * G + g -> [g, kv]
                (part("k"), (1, KV) + trailing, identity),
                (part("v"), (1, KV) + trailing, identity)])
        elif name.endswith(".self_attn.o_proj.weight"):
            view, axes = ((C, KV, D), (0, 1, 2)) if G == 1 else ((C, KV, G, D), (0, 2, 1, 3))
            out[_model_name(name)] = Stacked([(value, view, axes)])
        elif name.endswith(".mlp.gate_proj.weight"):
            up = params[name.replace(".gate_proj.", ".up_proj.")]
            out[_model_name(name.replace(".gate_proj.", ".gate_up_proj."))] = Stacked(
                [(value, (1, I, C), (0, 1, 2)), (up, (1, I, C), (0, 1, 2))])
        else:
            out[_model_name(name)] = value
    return out


def from_model(config: LlamaConfig, tensors: dict) -> dict:
    """Hugging Face's tensors (by name, in `param_shapes` order) of `model.Llama`'s parameter Tensors (by
    `named_params` name): unread views that `write_file` streams or computes one at a time."""
    G = config.kv_groups
    out = {}
    for name, shape in config.param_shapes().items():
        mine = name.removeprefix("model.")
        if ".self_attn." in name and name.split(".self_attn.")[1].split(".")[0] in ("q_proj", "k_proj", "v_proj"):
            which, kind = name.split(".self_attn.")[1].split(".")
            fused = tensors[mine.replace(f".{which}.", ".qkv_proj.")]
            rows = {"q_proj": slice(0, G), "k_proj": slice(G, G + 1), "v_proj": slice(G + 1, G + 2)}[which]
            # (parts, KV, ...) -> (KV, parts, ...): query head kv * G + g comes from [g, kv].
            out[name] = Derived(fused, shape, lambda w, rows=rows: np.swapaxes(w[rows], 0, 1))
        elif name.endswith(".self_attn.o_proj.weight"):
            o = tensors[mine]
            out[name] = Reshaped(o, shape) if G == 1 else Derived(o, shape, lambda w: np.swapaxes(w, 1, 2))
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            which = 0 if ".gate_proj." in name else 1
            fused = tensors[mine.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")]
            out[name] = Derived(fused, shape, lambda w, which=which: w[which])
        else:
            out[name] = Reshaped(tensors[mine], shape)
    return out


def save_hf(directory, config: LlamaConfig, tensors: dict, dtype: str = "float32") -> None:
    """Writes config.json and model.safetensors (in `dtype`, float32 or bfloat16) into directory, creating it; `tensors` as
    `from_model` gives them. Each file is written under a temporary name and renamed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    checked(tensors, config, "the params to save")
    # "format": "pt" is the metadata transformers requires to load the file.
    write_atomically(directory / WEIGHTS_FILE, lambda path: write_file(path, tensors, metadata={"format": "pt"},
                                                                      float_dtype=dtype))
    text = json.dumps({**config.to_hf_dict(), "torch_dtype": dtype}, indent=2) + "\n"
    write_atomically(directory / CONFIG_FILE, lambda path: Path(path).write_text(text))
