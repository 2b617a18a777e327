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
# here, and so are gate and up: their adapter is one, with one A shared by the parts and a B that covers
# every part's rows, so they are targeted together. In PEFT's files it is written as one adapter per part,
# each with that A and its rows of B, which is the same function; reading PEFT's files back needs the parts'
# A to be equal (as jnntile writes them).
LORA_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def _peft_parts(config: LlamaConfig, path: str) -> dict:
    """{Hugging Face module: (lora_B of our B, our B's part of lora_B)} for Linear `path` of the model."""
    G, KV, D = config.kv_groups, config.num_key_value_heads, config.head_dim
    prefix, _, module = path.rpartition(".")
    hf = lambda name: f"model.{prefix}.{name}"  # noqa: E731
    if module == "qkv_proj":  # B (G + 2, KV, D, r): query head kv * G + g at [g, kv]
        return {hf("q_proj"): (lambda b: np.swapaxes(b[:G], 0, 1).reshape(KV * G * D, -1),
                               lambda q: np.swapaxes(q.reshape(KV, G, D, -1), 0, 1)),
                hf("k_proj"): (lambda b: b[G].reshape(KV * D, -1), lambda k: k.reshape(1, KV, D, -1)),
                hf("v_proj"): (lambda b: b[G + 1].reshape(KV * D, -1), lambda v: v.reshape(1, KV, D, -1))}
    if module == "gate_up_proj":  # B (2, I, r)
        return {hf("gate_proj"): (lambda b: b[0], lambda g: g[None]), hf("up_proj"): (lambda b: b[1], lambda u: u[None])}
    return {hf(module): (lambda b: b.reshape(-1, b.shape[-1]), lambda b: b)}


def _o_proj_a(config: LlamaConfig, a: np.ndarray, to_peft: bool) -> np.ndarray:
    """o_proj's A: ours (r, G, KV, D) (or (r, KV, D) where G = 1), PEFT's (r, KV * G * D), head kv * G + g."""
    G, KV, D = config.kv_groups, config.num_key_value_heads, config.head_dim
    rank = a.shape[0]
    if G == 1:
        return a.reshape(rank, -1) if to_peft else a.reshape(rank, KV, D)
    return np.swapaxes(a, 1, 2).reshape(rank, -1) if to_peft else np.swapaxes(a.reshape(rank, KV, G, D), 1, 2)


def lora_to_peft(config: LlamaConfig, path: str, a: np.ndarray, b: np.ndarray) -> dict:
    """{Hugging Face module: (lora_A (rank, in), lora_B (out, rank))} of the adapter of Linear `path`
    ("layers.0.self_attn.qkv_proj"), whose factors are stored output-first: a (rank, *in), b (*out, rank)."""
    lora_a = _o_proj_a(config, a, True) if path.endswith(".o_proj") else a.reshape(a.shape[0], -1)
    return {module: (lora_a, to_peft(b)) for module, (to_peft, _) in _peft_parts(config, path).items()}


def lora_from_peft(config: LlamaConfig, path: str, peft: dict, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `lora_to_peft`: (a, b) in this model's layout from PEFT's {module: (lora_A, lora_B)}.
    Raises when the parts of a fused projection have different A (separate PEFT adapters, which one fused
    product cannot hold)."""
    parts = _peft_parts(config, path)
    lora_as = [np.asarray(peft[module][0]) for module in parts]
    if any(not np.array_equal(lora_as[0], other) for other in lora_as[1:]):
        raise ValueError(f"the adapters of {', '.join(parts)} have different lora_A: jnntile fuses these "
                         "projections into one product, whose adapter has one A; train them together with jnntile, "
                         "or leave them out of the adapter")
    a = _o_proj_a(config, lora_as[0], False) if path.endswith(".o_proj") else lora_as[0].reshape(a_shape)
    b = np.concatenate([from_peft(np.asarray(peft[module][1])) for module, (_, from_peft) in parts.items()])
    return a.reshape(a_shape), b.reshape(b_shape)
