"""The Llama family's names and layouts in Hugging Face files (`families.HFLayout`; `jnntile.models.hf` does
the files).

The files are those of `LlamaForCausalLM` (and Mistral's, Qwen2's) `save_pretrained`: tensors under the names of
`LlamaConfig.param_shapes`. A tied head's `lm_head.weight`, when a file carries one, is skipped (the embeddings
serve). `to_model` describes each parameter of `model.Llama` as the file tensors it is made of
(`tensorfile.Stacked`: q, k and v for the fused projection, gate and up), which `load_into` streams into the
tiles chunk by chunk; `from_model` gives Hugging Face's tensors of the model's: one that is a parameter as it is
streams from its tiles, one cut from a fused parameter (q_proj from qkv_proj) is computed when it is written,
one at a time.
"""

from __future__ import annotations

import numpy as np

from jnntile.io.tensorfile import Derived, Reshaped, Stacked

from .config import LlamaConfig

_LM_HEAD = "lm_head.weight"


def from_files(config: LlamaConfig, tensors: dict, source) -> dict:
    """The parameters (unchecked) among a file's tensors: a tied head's lm_head.weight dropped."""
    if config.tie_word_embeddings:
        return {name: value for name, value in tensors.items() if name != _LM_HEAD}
    return tensors


def to_files(config: LlamaConfig, params: dict) -> dict:
    """The file's names of the parameters: their own."""
    return params


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


# ---- LoRA adapters in PEFT's names and layouts ------------------------------------------------------

# PEFT target name -> the Linear module of `model.Llama` that holds it. q, k and v are one fused product
# here, and so are gate and up; each targeted part still has its own adapter (`lora_parts`), whose update
# lands in its rows of the fused product, as PEFT's adapters of separate modules do.
LORA_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def lora_parts(config: LlamaConfig, module: str) -> dict:
    """{PEFT target: its rows (start, stop) of the first output axis of Linear `module`, or None for all}."""
    G = config.kv_groups
    if module == "qkv_proj":  # (G + 2, KV, D): query head kv * G + g at [g, kv]
        return {"q_proj": (0, G), "k_proj": (G, G + 1), "v_proj": (G + 1, G + 2)}
    if module == "gate_up_proj":  # (2, I)
        return {"gate_proj": (0, 1), "up_proj": (1, 2)}
    return {module: None}


def lora_module(path: str, part: str) -> str:
    """The Hugging Face module of part `part` of Linear `path` ("layers.0.self_attn.qkv_proj")."""
    return f"model.{path.rpartition('.')[0]}.{part}"


def _o_proj_a(config: LlamaConfig, a: np.ndarray, to_peft: bool) -> np.ndarray:
    """o_proj's A: ours (r, G, KV, D) (or (r, KV, D) where G = 1), PEFT's (r, KV * G * D), head kv * G + g."""
    G, KV, D = config.kv_groups, config.num_key_value_heads, config.head_dim
    rank = a.shape[0]
    if G == 1:
        return a.reshape(rank, -1) if to_peft else a.reshape(rank, KV, D)
    return np.swapaxes(a, 1, 2).reshape(rank, -1) if to_peft else np.swapaxes(a.reshape(rank, KV, G, D), 1, 2)


def lora_to_peft(config: LlamaConfig, part: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A (rank, in), lora_B (out, rank)) of the adapter of PEFT module `part`, whose factors are stored
    output-first: a (rank, *in), b (*its rows of out, rank)."""
    rank = a.shape[0]
    lora_a = _o_proj_a(config, a, True) if part == "o_proj" else a.reshape(rank, -1)
    lora_b = np.swapaxes(b, 0, 1) if part == "q_proj" else b  # q: (G, KV, D, r) -> head kv * G + g
    return lora_a, lora_b.reshape(-1, rank)


def lora_from_peft(config: LlamaConfig, part: str, lora_a, lora_b, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `lora_to_peft`: (a, b) in this model's layout from PEFT's lora_A, lora_B."""
    G, KV, D = config.kv_groups, config.num_key_value_heads, config.head_dim
    lora_a, lora_b = np.asarray(lora_a), np.asarray(lora_b)
    a = _o_proj_a(config, lora_a, False) if part == "o_proj" else lora_a
    b = np.swapaxes(lora_b.reshape(KV, G, D, -1), 0, 1) if part == "q_proj" else lora_b
    return a.reshape(a_shape), b.reshape(b_shape)
