"""Incremental decoding: the key/value cache ops.

* cache_write / cached_attention against softmax attention over the whole
  sequence, fed in chunks whose tiles do not line up with the cache's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import jnntile
from jnntile.ops import attention
from jnntile.ops import data as data_ops

# ---- the cache ops ------------------------------------------------------------------------

B, T, H, D = 2, 12, 3, 8
# (qkv tiles (tb, tq, 1, th, D), cache tile on the sequence, the chunks fed in turn)
CACHE_TILINGS = {
    "one_chunk": ((B, T, 1, H, D), T, [T]),
    "token_by_token": ((B, 1, 1, H, D), 4, [1] * T),
    "unaligned": ((1, 2, 1, 2, D), 5, [5, 1, 1, 3, 2]),  # H = 2 + 1, chunks across cache tiles
    "batch_heads": ((B, 3, 1, 2, D), 4, [3, 3, 3, 3]),
}


def reference_attention(qkv):
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    t = qkv.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(qkv.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _feed(qkv, tiles, cache_tile, chunks, jit):
    """Writes qkv chunk by chunk into a fresh cache and attends; returns the outputs and the cache."""
    b, t, _, h, d = qkv.shape
    cache = attention.kv_cache(b, t, h, d, (tiles[0], cache_tile, 1, tiles[3], d))

    def chunk_step(x, cache, pos):
        cache = attention.cache_write(x, cache, pos)
        return cache, jnntile.to_array(attention.cached_attention(x, cache, pos))

    step = jax.jit(chunk_step) if jit else chunk_step
    outs, pos = [], 0
    for n in chunks:
        cache, out = step(jnntile.from_array(qkv[:, pos:pos + n], tiles), cache, np.int32(pos))
        outs.append(np.asarray(out))
        pos += n
    return np.concatenate(outs, axis=1), cache


@pytest.mark.usefixtures("placement")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", CACHE_TILINGS)
def test_cached_attention_matches_attention_over_the_sequence(tiling, jit):
    qkv = (2.0 * np.random.default_rng(0).standard_normal((B, T, 3, H, D))).astype(np.float32)
    out, cache = _feed(qkv, *CACHE_TILINGS[tiling], jit=jit)
    assert rel_err(out, reference_attention(qkv)) <= 1e-5
    values = cache.numpy()
    np.testing.assert_array_equal(values[:, :, 0], qkv[:, :, 1])
    np.testing.assert_array_equal(values[:, :, 1], qkv[:, :, 2])


@pytest.mark.usefixtures("placement")
def test_cached_attention_with_rows_longer_than_a_warp():
    qkv = np.random.default_rng(3).standard_normal((2, 70, 3, 3, 40)).astype(np.float32)
    out, _ = _feed(qkv, (2, 36, 1, 2, 40), 40, [33, 1, 36], jit=True)
    assert rel_err(out, reference_attention(qkv)) <= 1e-5


@pytest.mark.usefixtures("placement")
def test_invalidated_cache_is_written_again_from_position_zero():
    rng = np.random.default_rng(1)
    first, second = ((2.0 * rng.standard_normal((B, T, 3, H, D))).astype(np.float32) for _ in range(2))
    tiles, cache_tile, chunks = CACHE_TILINGS["unaligned"]
    _, cache = _feed(first, tiles, cache_tile, chunks, jit=False)
    cache = data_ops.invalidate(cache)
    pos = 0
    for n in chunks:
        x = jnntile.from_array(second[:, pos:pos + n], tiles)
        cache = attention.cache_write(x, cache, pos)
        out = attention.cached_attention(x, cache, pos)
        pos += n
    assert rel_err(out.numpy(), reference_attention(second)[:, T - chunks[-1]:]) <= 1e-5


def test_cache_bad_inputs():
    qkv = jnntile.from_array(np.zeros((B, 4, 3, H, D), np.float32), (1, 2, 1, H, D))
    with pytest.raises(ValueError, match=r"must be \(tb, tc, 1, th, 8\)"):
        attention.kv_cache(B, T, H, D, (1, 4, 2, H, D))
    with pytest.raises(ValueError, match=r"\(B, T_max, 2, H, D\) = \(2, T_max, 2, 3, 8\)"):
        attention.cache_write(qkv, attention.kv_cache(B, T, 2, D, (1, 4, 1, 2, D)), 0)
    with pytest.raises(ValueError, match=r"share qkv's batch and head tiles .* use \(1, 4, 1, 3, 8\)"):
        attention.cache_write(qkv, attention.kv_cache(B, T, H, D, (2, 4, 1, H, D)), 0)
    cache = attention.kv_cache(B, T, H, D, (1, 4, 1, H, D))
    with pytest.raises(ValueError, match=r"positions 10 .. 13 lie outside the cache's 12 positions"):
        attention.cache_write(qkv, cache, 10)
    with pytest.raises(TypeError, match="integer scalar"):
        attention.cached_attention(qkv, cache, 1.5)
    submitted = jnntile.runtime.stats()["tasks_submitted"]
    with pytest.raises(Exception, match="position 2 continues a cache tile whose earlier positions hold nothing"):
        jax.block_until_ready(attention.cache_write(qkv, cache, 2).token)
    with pytest.raises(Exception, match="lie outside the cache's 12 positions"):
        jax.block_until_ready(jax.jit(attention.cache_write)(qkv, cache, np.int32(9)).token)
    assert jnntile.runtime.stats()["tasks_submitted"] == submitted
