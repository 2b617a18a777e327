"""A readable pure-JAX GPT-2 (nanoGPT style), the fp32 reference for jnntile.

Parameters are a flat dict keyed by Hugging Face GPT-2 names without the
"transformer." prefix, in Hugging Face's Conv1D layout: a weight is
(in, out) and a projection is `y = x @ W + b`. The LM head is tied to
`wte.weight`. Shapes in comments: B batch, T sequence, C n_embd, V vocab,
P n_positions, nh heads, hd head_dim.

Every function is jit-able; pass the (frozen, hashable) config as a static
argument, e.g. `jax.jit(loss, static_argnums=1)`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .config import GPT2Config

_INIT_STD = 0.02


def init_params(config: GPT2Config, seed: int) -> dict[str, jax.Array]:
    """GPT-2 initialisation in float32: weights and embeddings ~ N(0, 0.02),
    the two residual projections (c_proj) scaled by 1/sqrt(2 * n_layer) so the
    residual stream does not grow with depth, biases 0, LayerNorm weight 1."""
    return _init_params(config, seed)


# One compiled program per config instead of one dispatch per tensor; the seed
# is traced so a new seed does not recompile.
@partial(jax.jit, static_argnums=0)
def _init_params(config: GPT2Config, seed) -> dict[str, jax.Array]:
    key = jax.random.key(seed)
    residual_std = _INIT_STD / math.sqrt(2 * config.n_layer)
    params = {}
    for index, (name, shape) in enumerate(config.param_shapes().items()):
        if ".ln_" in name or name.startswith("ln_f."):
            value = 1.0 if name.endswith(".weight") else 0.0
            params[name] = jnp.full(shape, value, jnp.float32)
        elif name.endswith(".bias"):
            params[name] = jnp.zeros(shape, jnp.float32)
        else:
            std = residual_std if name.endswith("c_proj.weight") else _INIT_STD
            # fold_in by position: each tensor gets its own stream for any n_layer.
            params[name] = std * jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32)
    return params


def n_params(params: dict) -> int:
    """Number of scalars in a parameter dict (the tied LM head is not a separate entry)."""
    return sum(int(np.prod(p.shape)) for p in params.values())


# ------------------------------------------------------------------ layers


def layer_norm(x, weight, bias, eps):
    # Biased variance over the feature axis, as torch.nn.LayerNorm.
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * weight + bias


def gelu_new(x):
    # Hugging Face "gelu_new": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    return jax.nn.gelu(x, approximate=True)


def dropout(x, rate, rng):
    """Inverted dropout; identity when rng is None (evaluation) or rate is 0."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def attention(p, prefix, config, x, rng):
    B, T, C = x.shape
    nh, hd = config.n_head, config.head_dim
    qkv = x @ p[prefix + "c_attn.weight"] + p[prefix + "c_attn.bias"]  # (B,T,3C)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # 3 x (B,T,C)
    # (B,T,C) -> (B,nh,T,hd)
    q, k, v = (t.reshape(B, T, nh, hd).transpose(0, 2, 1, 3) for t in (q, k, v))
    att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hd)  # (B,nh,T,T)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    # The diagonal is always allowed, so every row keeps a finite entry.
    att = jnp.where(causal, att, -jnp.inf)
    att = jax.nn.softmax(att, axis=-1)
    att = dropout(att, config.dropout, None if rng is None else jax.random.fold_in(rng, 0))
    y = att @ v  # (B,nh,T,hd)
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # re-assemble heads side by side
    y = y @ p[prefix + "c_proj.weight"] + p[prefix + "c_proj.bias"]  # (B,T,C)
    return dropout(y, config.dropout, None if rng is None else jax.random.fold_in(rng, 1))


def mlp(p, prefix, config, x, rng):
    h = gelu_new(x @ p[prefix + "c_fc.weight"] + p[prefix + "c_fc.bias"])  # (B,T,4C)
    y = h @ p[prefix + "c_proj.weight"] + p[prefix + "c_proj.bias"]  # (B,T,C)
    return dropout(y, config.dropout, rng)


def block(p, i, config, x, rng):
    h = f"h.{i}."
    eps = config.layer_norm_epsilon
    attn_rng = mlp_rng = None
    if rng is not None:
        attn_rng, mlp_rng = jax.random.split(rng)
    x = x + attention(p, h + "attn.", config, layer_norm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"], eps), attn_rng)
    x = x + mlp(p, h + "mlp.", config, layer_norm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"], eps), mlp_rng)
    return x


# ------------------------------------------------------------------ model


def forward(params: dict, config: GPT2Config, idx, *, dropout_rng: Optional[jax.Array] = None):
    """Logits (B,T,V) for token ids idx (B,T).

    Dropout runs only when config.dropout > 0 and dropout_rng is given.
    Token ids are range-checked when idx is concrete. Under jit they cannot
    be; an out-of-range id then gives NaN logits rather than silently reading
    another embedding row (JAX's default gather would clamp or wrap it).
    """
    _check_tokens(config, idx, "idx")
    B, T = idx.shape
    rng = dropout_rng if config.dropout > 0 else None
    layer_rngs = [None] * (config.n_layer + 1)
    if rng is not None:
        layer_rngs = list(jax.random.split(rng, config.n_layer + 1))

    wte = jnp.asarray(params["wte.weight"])
    tok_emb = wte.at[idx].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)  # (B,T,C)
    x = tok_emb + params["wpe.weight"][:T]  # (B,T,C) + (T,C)
    x = dropout(x, config.dropout, layer_rngs[-1])
    for i in range(config.n_layer):
        x = block(params, i, config, x, layer_rngs[i])
    x = layer_norm(x, params["ln_f.weight"], params["ln_f.bias"], config.layer_norm_epsilon)
    return x @ wte.T  # tied LM head: (B,T,C) @ (C,V) -> (B,T,V)


def loss(params: dict, config: GPT2Config, idx, targets, *, ignore_index: int = -100,
         dropout_rng: Optional[jax.Array] = None):
    """Mean cross-entropy of targets (B,T) under forward(idx), over the
    positions where targets != ignore_index.

    targets[b, t] is the token that should follow idx[b, :t+1] (already
    shifted, nanoGPT style). If every target is ignored the loss is 0 rather
    than torch's NaN, so a fully padded batch does not poison training.
    """
    if targets.shape != idx.shape:
        raise ValueError(f"targets shape {targets.shape} differs from idx shape {idx.shape}")
    _check_tokens(config, targets, "targets", ignore_index=ignore_index)
    logits = forward(params, config, idx, dropout_rng=dropout_rng)  # (B,T,V)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    valid = targets != ignore_index  # (B,T)
    safe_targets = jnp.where(valid, targets, 0)  # any in-range id; masked below
    nll = -jnp.take_along_axis(logprobs, safe_targets[..., None], axis=-1)[..., 0]  # (B,T)
    count = jnp.maximum(jnp.sum(valid), 1)
    return jnp.sum(jnp.where(valid, nll, 0.0)) / count


def _check_tokens(config: GPT2Config, ids, name, ignore_index=None):
    """Shape, dtype and (when concrete) range checks on a (B,T) id array."""
    if ids.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, seq), got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    T = ids.shape[1]
    if T > config.n_positions:
        raise ValueError(f"{name} has sequence length {T} > n_positions={config.n_positions}")
    if isinstance(ids, jax.core.Tracer):
        return
    values = np.asarray(ids)
    if ignore_index is not None:
        values = values[values != ignore_index]
    if values.size and (values.min() < 0 or values.max() >= config.vocab_size):
        bad = values.min() if values.min() < 0 else values.max()
        allowed = f"[0, {config.vocab_size})"
        if ignore_index is not None:
            allowed += f" or ignore_index={ignore_index}"
        raise ValueError(f"{name} contains token id {bad} outside {allowed} (vocab_size={config.vocab_size})")
