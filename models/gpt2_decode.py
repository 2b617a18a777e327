"""Incremental decoding of the tiled GPT-2: a key/value cache in tiled tensors, one token per step.

`Decoder(model, batch_size=B, max_len=T_max)` shares the parameters of a
`gpt2.GPT2` (no copy) and adds a key/value cache per layer, (B, T_max, 2, H, D)
tiled (tb, tile_seq, 1, th, D) like the activations
(`jnntile.ops.attention.kv_cache`). Parameters, caches and activations are all
StarPU tiles, under the runtime's memory limit and swap like training.

A forward over the positions pos .. pos + T - 1 runs the model's own blocks with
an attention that writes the layer's keys and values into its cache and attends
over the cache (`cache_write`, `cached_attention`), so a new token costs one
pass over the weights and O(pos) attention, not a forward over the sequence.
Two programs are compiled once per decoder and reused, with the position as a
per-step value: the prefill over `prefill_chunk` positions (no logits; the last
layer only fills its cache) and the step over one position, whose logits are
read to the host. The activations of a block are invalidated once it is done
(DESIGN invariant 7), so nothing dead is evicted to disk between tokens.

Prompts of different lengths share one batch without padding or masks: all
sequences are at the same position at every step. The common prefix is
prefilled in whole chunks, keeping at least the shortest prompt's last token
for the steps; then each step feeds every sequence its token at the current
position (its prompt's while the prompt lasts, else its latest sample) and
samples a sequence's next token only once its prompt is consumed. Sequence b
thus sees exactly its own tokens at positions 0, 1, ...: the arithmetic is that
of decoding it alone. A sequence that has all its tokens is fed its last token
again until the longest is done; those results are dropped.

Sampling runs on the host from the logits of the step: greedy at temperature 0,
else softmax(logits / temperature) over the top_k most likely tokens, drawn by
a numpy generator seeded with (seed, index of the prompt), so that a prompt's
continuation does not depend on the other prompts of the batch.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jnntile
from jnntile import nn
from jnntile.ops import _ffi
from jnntile.ops import attention as attention_ops
from jnntile.ops import data as data_ops
from jnntile.ops import embedding as embedding_ops
from jnntile.tensor import Tensor

from .gpt2 import GPT2

DEFAULT_PREFILL_CHUNK = 32


class Decoder:
    """Generates continuations of `batch_size` prompts with a GPT2's weights, up to `max_len` positions each."""

    def __init__(self, model: GPT2, *, batch_size: int, max_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        config = model.config
        for name, value in (("batch_size", batch_size), ("max_len", max_len), ("prefill_chunk", prefill_chunk)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        if max_len > config.n_positions:
            raise ValueError(f"max_len={max_len} is longer than the model's n_positions={config.n_positions}")
        self.model = model
        self.batch_size, self.max_len = batch_size, max_len
        self.prefill_chunk = min(prefill_chunk, max_len)
        # The batch in one tile unless the config sets one: a step's activations are a
        # row per sequence, and more batch tiles would only add tasks (2.6x slower
        # steps with four one-row tiles of the tiny preset). Sequence tiles are the model's.
        self.tile_batch = min(config.tile_batch or batch_size, batch_size)
        self.tile_seq = min(model.tiles.seq, max_len)
        H, D = config.n_head, config.head_dim
        self.caches = [attention_ops.kv_cache(batch_size, max_len, H, D,
                                              (self.tile_batch, self.tile_seq, 1, model.tiles.heads, D))
                       for _ in range(config.n_layer)]
        self._graphdef = nnx.split(model)[0]
        self._prefill = jax.jit(self._prefill_program)
        self._step = jax.jit(self._step_program)

    # ---- the compiled programs

    def _embed(self, model: GPT2, ids, pos) -> Tensor:
        B, T = ids.shape
        tiles = (self.tile_batch, min(self.tile_seq, T))
        positions = jnp.broadcast_to(pos + jnp.arange(T, dtype=jnp.int32), (B, T))
        return model.embed(jnntile.from_array(ids, tiles), jnntile.from_array(positions, tiles))

    def _blocks(self, model: GPT2, x: Tensor, caches: list[Tensor], pos, step: _ffi.Step, keep: set, *,
                last_fills_cache_only: bool):
        """Runs the blocks over x (positions pos ..); returns (output or None, new caches)."""
        caches = list(caches)
        for i, block in enumerate(model.h):
            def attention(qkv, i=i):
                caches[i] = attention_ops.cache_write(qkv, caches[i], pos)
                return attention_ops.cached_attention(qkv, caches[i], pos)

            if last_fills_cache_only and i == len(model.h) - 1:
                # Nothing reads the last layer's output at these positions: only its keys and values matter.
                attention(block.attn.c_attn(block.ln_1(x)))
                x = None
                _release_all_but(step, keep, [caches[i].token])
            else:
                x = block(x, None, attention)
                _release_all_but(step, keep | {x.handle}, [x.token, caches[i].token])
        return x, caches

    def _persistent(self, model: GPT2) -> set:
        """Handles of the tensors that outlive a program: parameters and caches."""
        return {t.handle for t in nn.tensors(nnx.state(model))} | {c.handle for c in self.caches}

    def _prefill_program(self, state, caches, ids, pos):
        model = nnx.merge(self._graphdef, state)
        with _ffi.step_scope() as step:
            _, caches = self._blocks(model, self._embed(model, ids, pos), caches, pos, step, self._persistent(model),
                                     last_fills_cache_only=True)
        return caches

    def _step_program(self, state, caches, ids, pos):
        model = nnx.merge(self._graphdef, state)
        with _ffi.step_scope() as step:
            keep = self._persistent(model)
            x, caches = self._blocks(model, self._embed(model, ids, pos), caches, pos, step, keep,
                                     last_fills_cache_only=False)
            logits = jnntile.to_array(model.head(x))     # (B, 1, V)
            _release_all_but(step, keep, [_ffi.read_token(logits)])
        return caches, logits[:, -1]

    # ---- generation

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0,
                 progress: Callable[[int], None] | None = None) -> list[list[int]]:
        """The `max_new_tokens` tokens that follow each of the `batch_size` prompts (lists of token ids).

        temperature 0 is greedy decoding; otherwise tokens are drawn from
        softmax(logits / temperature) restricted to the top_k most likely ones
        (all when top_k is None), reproducibly for a given seed. `progress` is
        called with the number of positions done after each prefill chunk and step.
        """
        prompts = [[int(t) for t in p] for p in prompts]
        self._check(prompts, max_new_tokens, temperature, top_k)
        lengths = [len(p) for p in prompts]
        end = max(lengths) + max_new_tokens - 1  # positions the model reads: the last sample is not fed back
        tokens = [list(p) for p in prompts]
        generators = [np.random.default_rng([seed, b]) for b in range(len(prompts))]
        state = nnx.state(self.model)
        caches = self.caches
        chunk = self.prefill_chunk
        for pos in range(0, self.prefill_length(lengths), chunk):
            ids = np.asarray([t[pos:pos + chunk] for t in tokens], np.int32)
            caches = self._prefill(state, caches, ids, np.int32(pos))
            if progress:
                progress(pos + chunk)
        for pos in range(self.prefill_length(lengths), end):
            # A sequence whose tokens are all there is fed its last one again; its results are dropped.
            ids = np.asarray([[t[min(pos, len(t) - 1)]] for t in tokens], np.int32)
            caches, logits = self._step(state, caches, ids, np.int32(pos))
            logits = np.asarray(logits)  # the one blocking read of the step
            for b, t in enumerate(tokens):
                if len(t) == pos + 1 and len(t) < lengths[b] + max_new_tokens:
                    t.append(sample(logits[b], temperature, top_k, generators[b]))
            if progress:
                progress(pos + 1)
        # The caches are dead until the next call writes them from position 0.
        self.caches = [data_ops.invalidate(c) for c in caches]
        return [t[n:] for t, n in zip(tokens, lengths)]

    def prefill_length(self, lengths: Sequence[int]) -> int:
        """Positions the prefill covers for prompts of these lengths: whole chunks before the shortest
        prompt's last token, which a step feeds (its logits give that prompt's first sample)."""
        return (min(lengths) - 1) // self.prefill_chunk * self.prefill_chunk

    def _check(self, prompts, max_new_tokens, temperature, top_k) -> None:
        if len(prompts) != self.batch_size:
            raise ValueError(f"{len(prompts)} prompts; this decoder was built for batch_size={self.batch_size}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            embedding_ops.check_ids(np.asarray(p), self.model.config.vocab_size)
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"a prompt of {longest} tokens and {max_new_tokens} new tokens need "
                             f"{longest + max_new_tokens - 1} positions, more than this decoder's max_len="
                             f"{self.max_len}: generate at most {self.max_len - longest + 1} tokens")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be 0 (greedy) or positive")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k={top_k} must be positive (or None for the whole vocabulary)")


def _release_all_but(step: _ffi.Step, keep: set, after: list) -> None:
    """Invalidates every tensor touched in `step` except `keep`, after the tokens `after` (DESIGN invariant 7).

    The step scope serves only to name the tensors the ops touched: the tokens it
    recorded belong to the traces of the ops' custom_vjp functions and must not
    leave them. `after` are the tokens of what the block produced (its output
    and cache), which depend on every call that read its activations. The
    invalidation is a side-effecting call: XLA keeps it though nothing consumes its token.
    """
    dead = [h for h in step.touched if h not in keep and not h.invalidated]
    step.touched.clear()
    if dead:
        _ffi.call("invalidate", dead, [_ffi.join(*after)], writes=dead)


def sample(logits: np.ndarray, temperature: float, top_k: int | None, generator: np.random.Generator) -> int:
    """One token id from a row of logits: the most likely at temperature 0, else drawn from
    softmax(logits / temperature) over the top_k largest logits (ties with the k-th kept)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = np.asarray(logits, np.float64) / temperature
    if top_k is not None and top_k < z.size:
        z = np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    return int(generator.choice(z.size, p=p / p.sum()))
