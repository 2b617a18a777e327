"""Incremental decoding of any jnntile language model whose attention takes a key/value cache.

A model that decodes provides `kv_cache(batch_size, max_len)` (an empty `KVCache`
tiled like its activations) and takes `cache=` in its `__call__`: each attention
layer then writes its keys and values at the cache's positions and attends over
the cache (`KVCache.attend`), positions come from the cache (`KVCache.positions`),
and the model calls `KVCache.block_done` after each block. The training forward
and the decoding forward are the same modules (`jnntile/models/<family>/model.py`).

`Decoder(model, batch_size=B, max_len=T_max)` shares the model's parameters (no
copy) and owns the cache: (B, T_max, 2, H, D) per layer, tiles like the
activations. Parameters, cache and activations are all StarPU tiles, under the
runtime's memory limit and swap like training. A new token costs one pass over
the weights and O(pos) attention, not a forward over the sequence. Two programs
are compiled once per decoder and reused, with the position as a per-step value:
the prefill over `prefill_chunk` positions (no logits: the head is skipped) and
the step over one position, whose logits are read to the host. A block's dead
activations are invalidated once it is done (DESIGN invariant 7), so nothing
dead is evicted to disk between tokens.

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

import dataclasses
import functools
from typing import Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jnntile import nn
from jnntile.core.ledger import LEDGER
from jnntile.ops import _ffi
from jnntile.ops import attention as attention_ops
from jnntile.ops import values as values_ops
from jnntile.ops import embedding as embedding_ops
from jnntile.core.tensor import Tensor, pack

DEFAULT_PREFILL_CHUNK = 32


@dataclasses.dataclass
class KVCache:
    """The keys and values of every layer, and what one decoding program needs to use them.

    `layers[i]` is layer i's cache (batch, max_len, 2, heads, head_dim); `tile_batch`
    and `tile_seq` tile the token ids and activations that meet it. Inside a
    decoding program (`bind`), `pos` is the position of the first token fed,
    `logits` whether the program reads the model's logits (the prefill does not),
    and `step` names the tensors the ops touch, so that `block_done` releases
    all but `keep` (parameters and caches) after each block.
    """

    layers: list
    tile_batch: int
    tile_seq: int
    pos: object = None
    logits: bool = True
    step: _ffi.Step | None = None
    keep: frozenset = frozenset()

    @classmethod
    def empty(cls, n_layers: int, batch_size: int, max_len: int, heads: int, head_dim: int, *, tile_batch: int,
              tile_seq: int, tile_heads: int) -> "KVCache":
        tile_seq = min(tile_seq, max_len)
        tiles = (tile_batch, tile_seq, 1, tile_heads, head_dim)
        layers = [attention_ops.kv_cache(batch_size, max_len, heads, head_dim, tiles) for _ in range(n_layers)]
        return cls(layers, tile_batch, tile_seq)

    def bind(self, layers: list, pos, step: _ffi.Step, keep: set, logits: bool) -> "KVCache":
        """This cache inside one decoding program (see the class docstring)."""
        return dataclasses.replace(self, layers=list(layers), pos=pos, step=step, keep=frozenset(keep), logits=logits)

    def ids_tensor(self, ids) -> Tensor:
        """Token ids (B, T) tiled like the activations that meet the cache."""
        return values_ops.from_array(ids, (self.tile_batch, min(self.tile_seq, ids.shape[1])))

    def positions(self, ids: Tensor) -> Tensor:
        """The positions pos .. pos + T - 1 of every sequence, tiled like `ids` (B, T)."""
        B, T = ids.shape
        return values_ops.from_array(jnp.broadcast_to(self.pos + jnp.arange(T, dtype=jnp.int32), (B, T)), ids.tile_shape)

    def attend(self, layer: int, qkv: Tensor) -> Tensor:
        """Writes qkv's keys and values into layer `layer`'s cache and attends over it: (B, T, H, D)."""
        self.layers[layer] = attention_ops.cache_write(qkv, self.layers[layer], self.pos)
        return attention_ops.cached_attention(qkv, self.layers[layer], self.pos)

    def block_done(self, layer: int, x: Tensor) -> None:
        """Releases what block `layer` left dead; its output `x` lives on unless nothing reads it (the last
        block of a program that reads no logits)."""
        last_unread = layer == len(self.layers) - 1 and not self.logits
        self.release(after=[x.token, self.layers[layer].token], also_keep=() if last_unread else (x.handle,))

    def release(self, after: list, also_keep=()) -> None:
        """Invalidates every tensor touched in this program but the parameters, caches and `also_keep`,
        after the tokens `after` (DESIGN invariant 7).

        The step scope serves only to name the tensors the ops touched: the tokens it
        recorded belong to the traces of the ops' custom_vjp functions and must not
        leave them. `after` are the tokens of what was produced last, which depend on
        every call that read the dead tensors. The invalidation is a side-effecting
        call: XLA keeps it though nothing consumes its token.
        """
        keep = self.keep | set(also_keep)
        dead = [h for h in self.step.touched
                if h not in keep and h.master is None and not LEDGER.invalidated(h)]  # compute copies persist
        self.step.touched.clear()
        if dead:
            _ffi.call("invalidate", dead, [_ffi.join(*after)], writes=dead)


class Decoder:
    """Generates continuations of `batch_size` prompts with a model's weights, up to `max_len` positions each."""

    def __init__(self, model, *, batch_size: int, max_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        for name, value in (("batch_size", batch_size), ("max_len", max_len), ("prefill_chunk", prefill_chunk)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        if max_len > model.max_positions:
            raise ValueError(f"max_len={max_len} is longer than the {model.max_positions} positions the model has")
        self.model = model
        self.batch_size, self.max_len = batch_size, max_len
        self.prefill_chunk = min(prefill_chunk, max_len)
        self.cache = model.kv_cache(batch_size, max_len)
        self._graphdef = nnx.split(model)[0]
        self._prefill = jax.jit(functools.partial(self._program, logits=False))
        self._step = jax.jit(functools.partial(self._program, logits=True))

    def _program(self, packed_state, layers, ids, pos, *, logits: bool):
        """The model over positions pos .. of `ids`: new caches, and the last position's logits if asked.
        packed_state: the model's state behind one token (jnntile.tensor.Packed: a call per token would
        otherwise dispatch each weight's token)."""
        state = packed_state.unpack()
        model = nnx.merge(self._graphdef, state)
        with _ffi.step_scope() as step:
            keep = {t.handle for t in nn.tensors(state)} | {c.handle for c in layers}
            cache = self.cache.bind(layers, pos, step, keep, logits)
            out, _ = model(cache.ids_tensor(ids), cache=cache)
            if not logits:
                return cache.layers
            values = values_ops.to_array(out)     # (B, T, V)
            cache.release(after=[_ffi.read_token(values)])
        return cache.layers, values[:, -1]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0, stop: Collection[int] = (),
                 progress: Callable[[int], None] | None = None) -> list[list[int]]:
        """The `max_new_tokens` tokens that follow each of the `batch_size` prompts (lists of token ids).

        temperature 0 is greedy decoding; otherwise tokens are drawn from
        softmax(logits / temperature) restricted to the top_k most likely ones
        (all when top_k is None), reproducibly for a given seed. A continuation
        ends early with the first token it samples of `stop` (an end-of-turn
        token; it is kept, last), and decoding ends once every one has ended.
        `progress` is called with the number of positions done after each
        prefill chunk and step.
        """
        prompts = [[int(t) for t in p] for p in prompts]
        self._check(prompts, max_new_tokens, temperature, top_k)
        lengths = [len(p) for p in prompts]
        end = max(lengths) + max_new_tokens - 1  # positions the model reads: the last sample is not fed back
        tokens = [list(p) for p in prompts]
        stop = frozenset(int(t) for t in stop)
        ends = [n + max_new_tokens for n in lengths]  # a continuation that samples a stop token ends there
        generators = [np.random.default_rng([seed, b]) for b in range(len(prompts))]
        state = pack(nnx.state(self.model))
        layers = self.cache.layers
        chunk = self.prefill_chunk
        for pos in range(0, self.prefill_length(lengths), chunk):
            ids = np.asarray([t[pos:pos + chunk] for t in tokens], np.int32)
            layers = self._prefill(state, layers, ids, np.int32(pos))
            if progress:
                progress(pos + chunk)
        for pos in range(self.prefill_length(lengths), end):
            if all(len(t) == e for t, e in zip(tokens, ends)):
                break
            # A sequence whose tokens are all there is fed its last one again; its results are dropped.
            ids = np.asarray([[t[min(pos, len(t) - 1)]] for t in tokens], np.int32)
            layers, logits = self._step(state, layers, ids, np.int32(pos))
            logits = np.asarray(logits)  # the one blocking read of the step
            for b, t in enumerate(tokens):
                if len(t) == pos + 1 and len(t) < ends[b]:
                    t.append(sample(logits[b], temperature, top_k, generators[b]))
                    if t[-1] in stop:
                        ends[b] = len(t)
            if progress:
                progress(pos + 1)
        # The caches are dead until the next call writes them from position 0.
        self.cache.layers = [values_ops.invalidate(c) for c in layers]
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
        if not np.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature={temperature} must be 0 (greedy) or positive")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k={top_k} must be positive (or None for the whole vocabulary)")


def sample(logits: np.ndarray, temperature: float, top_k: int | None, generator: np.random.Generator) -> int:
    """One token id from a row of logits: the most likely at temperature 0, else drawn from
    softmax(logits / temperature) over the top_k largest logits (ties with the k-th kept)."""
    if temperature == 0:
        return int(np.argmax(logits))
    # The largest logit is subtracted before dividing: a tiny temperature then sends the others to -inf (their
    # probability 0) instead of every logit to +-inf, whose difference was NaN (temperature 1e-310).
    z = np.asarray(logits, np.float64)
    z = z - z.max()
    if top_k is not None and top_k < z.size:
        z = np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)
    with np.errstate(over="ignore"):  # a logit below the largest overflowing to -inf is probability 0
        p = np.exp(z / temperature)
    return int(generator.choice(z.size, p=p / p.sum()))
