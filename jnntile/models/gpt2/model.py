"""GPT-2 on jnntile: Flax NNX modules whose every operation is tiled StarPU tasks.

Parameter names follow Hugging Face GPT-2 (`GPT2Config.param_shapes`); the
layouts differ where tiling wants more axes (`hf.py` lists them and converts).

Activations are (B, T, C) tiled (tile_batch, tile_seq, tile_embd). Dropout
(when config.dropout > 0 and a seed is given) is applied to the embeddings
and to the outputs of both residual branches; unlike Hugging Face, not to the
attention probabilities (the fused attention never materialises them).
"""

from __future__ import annotations


import numpy as np
from flax import nnx

from jnntile import nn
from jnntile.models.decoding import KVCache
from jnntile.ops import attention as attention_ops
from jnntile.ops import elementwise as ew
from jnntile.ops import embedding as embedding_ops
from jnntile.core.tensor import Tensor

from jnntile.models import LanguageModel, Packing, Tiles, recomputed_blocks, resolve_tiles

from . import hf
from .config import GPT2Config


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPT2Config, tiles: Tiles, seed: int, prefix: str):
        C, H, D = config.n_embd, config.n_head, config.head_dim
        self.c_attn = nn.Linear((C,), (3, H, D), in_tiles=(tiles.embd,), out_tiles=(1, tiles.heads, D),
                                seed=seed, name=prefix + "c_attn", dtype=config.dtype)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) at init.
        self.c_proj = nn.Linear((H, D), (C,), in_tiles=(tiles.heads, D), out_tiles=(tiles.embd,), seed=seed,
                                name=prefix + "c_proj", std=0.02 / np.sqrt(2 * config.n_layer), dtype=config.dtype)

    def __call__(self, x: Tensor, cache: KVCache | None = None, layer: int = 0, residual: Tensor | None = None,
                 packing: Packing | None = None, dropout_seed=None):
        """With a cache (decoding), keys and values go to layer `layer`'s cache and the queries attend over it;
        `residual` is added to the output (by the projection's tasks); with a packing, each token attends only
        within its example. `dropout_seed` reaches the projections (LoRA adapters' dropout)."""
        qkv = self.c_attn(x, dropout_seed=dropout_seed)  # (B, T, 3, H, D)
        documents = None if packing is None else packing.documents
        y = attention_ops.causal_attention(qkv, documents) if cache is None else cache.attend(layer, qkv)
        return self.c_proj(y, residual, dropout_seed)   # (B, T, C)


class MLP(nnx.Module):
    def __init__(self, config: GPT2Config, tiles: Tiles, seed: int, prefix: str):
        C = config.n_embd
        self.c_fc = nn.Linear((C,), (4 * C,), in_tiles=(tiles.embd,), out_tiles=(tiles.hidden,), seed=seed,
                              name=prefix + "c_fc", dtype=config.dtype)
        self.c_proj = nn.Linear((4 * C,), (C,), in_tiles=(tiles.hidden,), out_tiles=(tiles.embd,), seed=seed,
                                name=prefix + "c_proj", std=0.02 / np.sqrt(2 * config.n_layer), dtype=config.dtype)

    def __call__(self, x: Tensor, residual: Tensor | None = None, dropout_seed=None) -> Tensor:
        hidden = ew.gelu_tanh(self.c_fc(x, dropout_seed=dropout_seed))  # (B, T, 4C)
        return self.c_proj(hidden, residual, dropout_seed)              # (B, T, C)


class Block(nnx.Module):
    def __init__(self, config: GPT2Config, tiles: Tiles, seed: int, index: int):
        prefix = f"h.{index}."
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.n_embd, tile=tiles.embd, eps=eps)
        self.attn = CausalSelfAttention(config, tiles, seed, prefix + "attn.")
        self.ln_2 = nn.LayerNorm(config.n_embd, tile=tiles.embd, eps=eps)
        self.mlp = MLP(config, tiles, seed, prefix + "mlp.")
        self.attn_dropout = nn.Dropout(config.dropout, site=2 * index + 1)
        self.mlp_dropout = nn.Dropout(config.dropout, site=2 * index + 2)

    def __call__(self, x: Tensor, dropout_seed, packing: Packing | None = None, cache: KVCache | None = None,
                 layer: int = 0) -> Tensor:
        # Each residual addition is the branch's last projection's (without dropout): no task of its own.
        x = self.attn_dropout.residual(x, lambda r: self.attn(self.ln_1(x), cache, layer, r, packing, dropout_seed),
                                       dropout_seed)
        return self.mlp_dropout.residual(x, lambda r: self.mlp(self.ln_2(x), r, dropout_seed), dropout_seed)


class GPT2(LanguageModel):
    """GPT-2 with a tied LM head. Tiles are fixed at construction for (batch_size, seq_len)."""

    hf_layout = hf

    def __init__(self, config: GPT2Config, *, batch_size: int, seq_len: int, seed: int = 0):
        if seq_len > config.n_positions:
            raise ValueError(f"seq_len={seq_len} is longer than n_positions={config.n_positions}")
        self.config = config
        self.batch_size, self.seq_len = batch_size, seq_len
        self.tiles = tiles = resolve_tiles(config, batch_size, seq_len)
        self.recomputed_blocks = recomputed_blocks(config)
        C = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, C, tiles=(tiles.vocab, tiles.embd), seed=seed, name="wte",
                                dtype=config.dtype)
        self.wpe = nn.Embedding(config.n_positions, C, tiles=(tiles.seq, tiles.embd), seed=seed, name="wpe",
                                std=0.01, dtype=config.dtype)
        self.embd_dropout = nn.Dropout(config.dropout, site=0)
        self.h = nnx.List([Block(config, tiles, seed, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(C, tile=tiles.embd, eps=config.layer_norm_epsilon)

    # ---- forward

    def __call__(self, idx: Tensor, targets: Tensor | None = None, *, dropout_seed=None,
                 ignore_index: int = -100, cache: KVCache | None = None, packing: Packing | None = None):
        """idx, targets: int32 (B, T) Tensors. Returns (logits (B, T, V) Tensor, loss scalar Tensor or None).

        With a key/value cache (`kv_cache`, jnntile.decoding), idx holds the tokens at the cache's positions
        pos .. pos + T - 1, every layer writes its keys and values there and attends over the cache; a cache
        that reads no logits (a prefill) skips the head and returns (None, None). With a packing
        (`packing_tensors`: a packed batch) each example gets what it would alone: its positions restart at 0
        and its tokens attend only within it.
        """
        self.check_packing(packing, cache)
        B, T = idx.shape
        if packing is not None:
            positions = packing.positions
        elif cache is None:
            positions = embedding_ops.position_ids(B, T, (self.tiles.batch, self.tiles.seq))
        else:
            positions = cache.positions(idx)
        x = self.embd_dropout(self.embed(idx, positions), dropout_seed)
        for layer, block in enumerate(self.h):
            if cache is None and layer < self.recomputed_blocks:
                x = nn.recomputed(block, x, dropout_seed, packing)
            else:
                x = block(x, dropout_seed, packing, cache, layer)
            if cache is not None:
                cache.block_done(layer, x)
        return self.logits_and_loss(x, targets, ignore_index, cache)

    def embed(self, idx: Tensor, positions: Tensor) -> Tensor:
        """Token plus position embeddings (B, T, C) of int32 (B, T) ids and positions."""
        return ew.add(self.wte(idx), self.wpe(positions))

    def head(self, x: Tensor) -> Tensor:
        """Logits (B, T, V) of the last block's output: final layer norm, then the head tied to wte."""
        return self.wte.attend(self.ln_f(x))
