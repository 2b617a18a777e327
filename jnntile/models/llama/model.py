"""Llama-family models (Llama 2/3, TinyLlama, SmolLM, Qwen2, Mistral) on jnntile: Flax NNX modules whose
every operation is tiled StarPU tasks.

Shapes: B batch, T sequence, C hidden_size, I intermediate_size, V vocab, KV key/value heads, G query heads
per key/value head (grouped-query attention), D head_dim. Weights are stored output-first, as torch.nn.Linear
does (`nn.Linear(weight_out_first=True)`), and where Hugging Face has one tensor this model has the same one.
Two products are fused so that one task reads each input tile once:

    self_attn.qkv_proj   HF q_proj (KV*G*D, C), k_proj, v_proj (KV*D, C)    here (G + 2, KV, D, C): query head
                         kv * G + g at [g, kv], keys at [G], values at [G + 1]; the biases (Qwen2) alike
    self_attn.o_proj     HF (C, KV*G*D)                                      here (C, G, KV, D) ((C, KV, D) where G = 1)
    mlp.gate_up_proj     HF gate_proj, up_proj (I, C)                        here (2, I, C)

`hf.py` converts both ways. The attention output (B, T, G, KV, D) is then contracted by o_proj over (G, KV, D),
and the rotary embedding turns the G query parts and the keys of qkv (the values are copied).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jnntile import nn
from jnntile.models.decoding import KVCache
from jnntile.ops import attention as attention_ops
from jnntile.ops import gated
from jnntile.ops import rotary as rotary_ops
from jnntile.core.tensor import Tensor

from jnntile.models import LanguageModel, Packing, Tiles, recomputed_blocks, resolve_tiles

from . import hf
from .config import LlamaConfig


def _linear(in_shape, out_shape, in_tiles, out_tiles, *, seed, name, dtype, bias=False):
    return nn.Linear(in_shape, out_shape, in_tiles=in_tiles, out_tiles=out_tiles, seed=seed, name=name,
                     use_bias=bias, weight_out_first=True, dtype=dtype)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, tiles: Tiles, seed: int, prefix: str):
        C, KV, G, D = config.hidden_size, config.num_key_value_heads, config.kv_groups, config.head_dim
        self.groups = G
        self.inv_freq = tuple(float(f) for f in config.inverse_frequencies())
        self.qkv_proj = _linear((C,), (G + 2, KV, D), (tiles.embd,), (1, tiles.heads, D), seed=seed,
                                name=prefix + "qkv_proj", dtype=config.dtype, bias=config.qkv_bias)
        # The attention output is (B, T, KV, D) where G = 1 (multi-head attention).
        heads, head_tiles = ((KV, D), (tiles.heads, D)) if G == 1 else ((G, KV, D), (1, tiles.heads, D))
        self.o_proj = _linear(heads, (C,), head_tiles, (tiles.embd,), seed=seed, name=prefix + "o_proj",
                              dtype=config.dtype, bias=config.o_bias)

    def __call__(self, x: Tensor, cache: KVCache | None = None, layer: int = 0, residual: Tensor | None = None,
                 packing: Packing | None = None, dropout_seed=None):
        """With a cache (decoding), keys and values go to layer `layer`'s cache and the queries attend over it;
        `residual` is added to the output (by the projection's tasks); with a packing, positions restart at
        each example and each token attends only within its example. `dropout_seed` reaches the projections
        (LoRA adapters' dropout)."""
        qkv = self.qkv_proj(x, dropout_seed=dropout_seed)       # (B, T, G + 2, KV, D)
        pos = jnp.int32(0) if cache is None else cache.pos
        positions, documents = (None, None) if packing is None else (packing.positions, packing.documents)
        qkv = rotary_ops.rotary(qkv, self.inv_freq, pos, rotated_parts=self.groups + 1, positions=positions)
        y = attention_ops.causal_attention(qkv, documents) if cache is None else cache.attend(layer, qkv)
        return self.o_proj(y, residual, dropout_seed)           # (B, T, C)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, tiles: Tiles, seed: int, prefix: str):
        C, I = config.hidden_size, config.intermediate_size
        self.gate_up_proj = _linear((C,), (2, I), (tiles.embd,), (1, tiles.hidden), seed=seed,
                                    name=prefix + "gate_up_proj", dtype=config.dtype)
        self.down_proj = _linear((I,), (C,), (tiles.hidden,), (tiles.embd,), seed=seed, name=prefix + "down_proj",
                                 dtype=config.dtype)

    def __call__(self, x: Tensor, residual: Tensor | None = None, dropout_seed=None) -> Tensor:
        # (B, T, 2, I) -> (B, T, I) -> (B, T, C)
        return self.down_proj(gated.swiglu(self.gate_up_proj(x, dropout_seed=dropout_seed)), residual, dropout_seed)


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, tiles: Tiles, seed: int, index: int):
        prefix = f"model.layers.{index}."
        C, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(C, tile=tiles.embd, eps=eps)
        self.self_attn = Attention(config, tiles, seed, prefix + "self_attn.")
        self.post_attention_layernorm = nn.RMSNorm(C, tile=tiles.embd, eps=eps)
        self.mlp = MLP(config, tiles, seed, prefix + "mlp.")

    def __call__(self, x: Tensor, dropout_seed=None, packing: Packing | None = None, cache: KVCache | None = None,
                 layer: int = 0) -> Tensor:
        # Each residual addition is the branch's last projection's: no task of its own.
        x = self.self_attn(self.input_layernorm(x), cache, layer, residual=x, packing=packing,
                           dropout_seed=dropout_seed)
        return self.mlp(self.post_attention_layernorm(x), residual=x, dropout_seed=dropout_seed)


class Llama(LanguageModel):
    """A Llama-family causal LM, its head tied to the embeddings or not. Tiles are fixed at construction for
    (batch_size, seq_len)."""

    hf_layout = hf

    def __init__(self, config: LlamaConfig, *, batch_size: int, seq_len: int, seed: int = 0):
        config.check_sequence_length(seq_len)
        self.config = config
        self.batch_size, self.seq_len = batch_size, seq_len
        self.tiles = tiles = resolve_tiles(config, batch_size, seq_len)
        self.recomputed_blocks = recomputed_blocks(config)
        C, V = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(V, C, tiles=(tiles.vocab, tiles.embd), seed=seed,
                                         name="model.embed_tokens", dtype=config.dtype)
        self.layers = nnx.List([DecoderLayer(config, tiles, seed, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(C, tile=tiles.embd, eps=config.rms_norm_eps)
        # An untied head is a (V, C) table like the embeddings: logits = x @ lm_head^T.
        self.lm_head = None if config.tie_word_embeddings else nn.Embedding(
            V, C, tiles=(tiles.vocab, tiles.embd), seed=seed, name="lm_head", dtype=config.dtype)

    # ---- forward

    def __call__(self, idx: Tensor, targets: Tensor | None = None, *, dropout_seed=None,
                 ignore_index: int = -100, cache: KVCache | None = None, packing: Packing | None = None):
        """idx, targets: int32 (B, T) Tensors. Returns (logits (B, T, V) Tensor, loss scalar Tensor or None).

        Llama has no dropout of its own: `dropout_seed` reaches only LoRA adapters' (`nn.LoRA`). With a key/value
        cache (`kv_cache`, jnntile.decoding), idx holds the tokens at the cache's positions pos .. pos + T - 1; a
        cache that reads no logits (a prefill) skips the head and returns (None, None). With a packing
        (`packing_tensors`: a packed batch) each example gets what it would alone: its positions restart at 0 and
        its tokens attend only within it.
        """
        self.check_packing(packing, cache)
        x = self.embed_tokens(idx)                              # (B, T, C)
        for layer, block in enumerate(self.layers):
            recompute = cache is None and layer < self.recomputed_blocks
            if recompute:
                x = nn.recomputed(block, x, dropout_seed, packing)
            else:
                x = block(x, dropout_seed, packing, cache, layer)
            if cache is not None:
                cache.block_done(layer, x)
        return self.logits_and_loss(x, targets, ignore_index, cache)

    def head(self, x: Tensor) -> Tensor:
        """Logits (B, T, V) of the last layer's output: final RMSNorm, then the (tied) head."""
        table = self.embed_tokens if self.lm_head is None else self.lm_head
        return table.attend(self.norm(x))
