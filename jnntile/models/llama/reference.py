"""A readable pure-JAX Llama (Llama 2/3, SmolLM, TinyLlama, Qwen2, Mistral), the float32 test oracle.

Parameters are a flat dict keyed by Hugging Face names ("model.layers.0.self_attn.q_proj.weight", ...)
in Hugging Face's layouts: a projection weight is (out, in) and `y = x @ W.T + b`. Shapes in comments:
B batch, T sequence, C hidden_size, I intermediate_size, V vocab, H query heads, KV key/value heads,
G = H / KV query heads per key/value head, D head_dim. Every product runs at HIGHEST precision.

Grouped-query attention reshapes the queries into (KV, G) groups and never copies keys or values per
query head; rotary embeddings follow Hugging Face's convention (the two halves of each head rotated,
`rotate_half`), with Llama 3.1's frequency scaling (`rope_scaling` of type llama3).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from .config import LlamaConfig

HIGHEST = jax.lax.Precision.HIGHEST


def init_params(config: LlamaConfig, seed: int) -> dict[str, jax.Array]:
    """Weights ~ N(0, 0.02), biases 0, norm weights 1, in float32 (as Hugging Face initialises Llama)."""
    key = jax.random.key(seed)
    params = {}
    for index, (name, shape) in enumerate(config.param_shapes().items()):
        if "norm" in name:
            params[name] = jnp.ones(shape, jnp.float32)
        elif name.endswith(".bias"):
            params[name] = jnp.zeros(shape, jnp.float32)
        else:
            params[name] = 0.02 * jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32)
    return params


def rotary(x, positions, inv_freq):
    """x (B, T, heads, D) rotated by the angles positions (B, T) x inv_freq, halves paired as Hugging Face."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq          # (B, T, D/2)
    cos = jnp.cos(jnp.concatenate([angles, angles], axis=-1))[:, :, None]  # (B, T, 1, D)
    sin = jnp.sin(jnp.concatenate([angles, angles], axis=-1))[:, :, None]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rms_norm(x, weight, eps):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * weight


def _linear(params, name, x):
    y = jnp.einsum("...i,oi->...o", x, params[name + ".weight"], precision=HIGHEST)
    return y + params[name + ".bias"] if name + ".bias" in params else y


def attention(params, prefix, config: LlamaConfig, x, positions):
    """Causal grouped-query attention with rotary embeddings: (B, T, C) -> (B, T, C)."""
    B, T, _ = x.shape
    H, KV, D, G = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.kv_groups
    inv_freq = jnp.asarray(config.inverse_frequencies())
    q = rotary(_linear(params, prefix + "q_proj", x).reshape(B, T, H, D), positions, inv_freq)
    k = rotary(_linear(params, prefix + "k_proj", x).reshape(B, T, KV, D), positions, inv_freq)
    v = _linear(params, prefix + "v_proj", x).reshape(B, T, KV, D)
    q = q.reshape(B, T, KV, G, D)  # query head h = kv * G + g uses key/value head kv
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, precision=HIGHEST) / math.sqrt(D)  # (B, KV, G, T, T)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    y = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(scores, axis=-1), v, precision=HIGHEST)
    return _linear(params, prefix + "o_proj", y.reshape(B, T, H * D))


def mlp(params, prefix, x):
    """SwiGLU: down(silu(gate(x)) * up(x)), (B, T, C) -> (B, T, I) -> (B, T, C)."""
    return _linear(params, prefix + "down_proj", jax.nn.silu(_linear(params, prefix + "gate_proj", x))
                   * _linear(params, prefix + "up_proj", x))


@partial(jax.jit, static_argnums=1)
def forward(params: dict, config: LlamaConfig, idx, positions=None):
    """Logits (B, T, V) of token ids idx (B, T) at `positions` (B, T; default 0 .. T-1)."""
    B, T = idx.shape
    config.check_sequence_length(T)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = params["model.embed_tokens.weight"][idx]  # (B, T, C)
    eps = config.rms_norm_eps
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        x = x + attention(params, p + "self_attn.", config, rms_norm(x, params[p + "input_layernorm.weight"], eps),
                          positions)
        x = x + mlp(params, p + "mlp.", rms_norm(x, params[p + "post_attention_layernorm.weight"], eps))
    x = rms_norm(x, params["model.norm.weight"], eps)
    head = params["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return jnp.einsum("btc,vc->btv", x, head, precision=HIGHEST)


@partial(jax.jit, static_argnums=1, static_argnames="ignore_index")
def loss(params: dict, config: LlamaConfig, idx, targets, *, ignore_index: int = -100):
    """Mean cross-entropy of targets (B, T) (already shifted: targets[b, t] follows idx[b, :t+1]) over the
    positions where targets != ignore_index; 0 when every target is ignored."""
    logprobs = jax.nn.log_softmax(forward(params, config, idx), axis=-1)
    valid = targets != ignore_index
    nll = -jnp.take_along_axis(logprobs, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
