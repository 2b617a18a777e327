"""Model families, one package each (`gpt2/`, `llama/`): config, the model on jnntile's modules, Hugging
Face files, and a pure-JAX reference that only tests and benchmarks use as an oracle."""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jnntile import nn
from jnntile.core import runtime
from jnntile.io import tensorfile
from jnntile.models.decoding import KVCache
from jnntile.ops import attention as attention_ops
from jnntile.ops import embedding as embedding_ops
from jnntile.ops import loss as loss_ops
from jnntile.ops import quant
from jnntile.ops import values as values_ops
from jnntile.models import hf
from jnntile.core.tensor import FLOAT_DTYPES, Tensor

# The logical axes a model cuts into tiles, each with a tile_<axis> field on its config (None: automatic).
# tile_heads counts heads per tile; tile_hidden is the MLP's hidden axis.
TILE_AXES = ("batch", "seq", "embd", "heads", "hidden", "vocab")


# Activation recomputation: "none" keeps every activation for the backward; "block" makes each transformer
# block keep only its input and recompute its forward in the backward (jnntile.remat); "auto" lets the
# memory planner choose before the model is built (jnntile.planning.choose_remat).
REMAT_CHOICES = ("none", "block", "auto")
COMPUTE_DTYPES = FLOAT_DTYPES  # of activations and weight copies; parameters are float32


@dataclasses.dataclass(frozen=True)
class ExecutionFields:
    """How a model is executed, fields every model config has: the tile_<axis> sizes (None lets jnntile choose;
    see TILE_AXES), `remat` and `dtype`. They change neither the model nor its parameters, so a checkpoint
    resumes under other ones; tiles and recomputation do not change its results either, `dtype` rounds them.

    `dtype` is the compute dtype (Flax's `dtype`): with "bfloat16" the activations, their gradients and the
    compute copies of the weights are bfloat16 tiles, while the parameters (masters), their gradients and
    the optimizer state stay float32 (Flax's `param_dtype`); products, normalisation statistics, softmax and
    the loss run in float32 inside the ops."""

    tile_batch: Optional[int] = None
    tile_seq: Optional[int] = None
    tile_embd: Optional[int] = None
    tile_heads: Optional[int] = None
    tile_hidden: Optional[int] = None
    tile_vocab: Optional[int] = None
    remat: str = "none"
    # With remat="block": how many blocks are recomputed, from the first (None: all). At the end of the
    # forward every block's activations are alive, so any k blocks lower that peak alike.
    remat_blocks: Optional[int] = None
    dtype: str = "float32"

    @classmethod
    def execution_field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(ExecutionFields))

    def axis_sizes(self) -> dict[str, int]:
        """The size of the embd, heads (key/value heads where queries share them), hidden and vocab axes."""
        raise NotImplementedError

    def check_execution_fields(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(COMPUTE_DTYPES)}")
        if self.remat not in REMAT_CHOICES:
            raise ValueError(f"remat={self.remat!r}: use one of {', '.join(REMAT_CHOICES)}")
        if self.remat_blocks is not None and (not is_int(self.remat_blocks) or self.remat_blocks < 0):
            raise ValueError(f"remat_blocks={self.remat_blocks!r} must be a non-negative integer, or None for all")
        for axis in TILE_AXES:
            value = getattr(self, f"tile_{axis}")
            if value is not None and (not is_int(value) or value <= 0):
                raise ValueError(f"tile_{axis}={value!r} must be a positive integer, or None to let jnntile choose")


def is_int(value) -> bool:
    """An integer (numpy's too) that is not a bool (True would pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile size per logical axis (TILE_AXES), resolved from the config and the batch shape."""

    batch: int
    seq: int
    embd: int
    heads: int
    hidden: int
    vocab: int


# Automatic tiles: token rows per tile (tile_batch x tile_seq) and the largest
# tile on the other axes. On CPU workers a 512-row tile keeps a task near a
# millisecond or more (measured on GPT-2's tiny preset, 8 x 128 tokens: 1-row
# batch tiles gave 10.6K tokens/s in 1666 tasks per step, 4-row tiles 15.2K in
# 531); a GPU wants far larger tasks to hide a launch and a transfer: on an
# H200 a bfloat16 GPT-2 124M step at 8 x 1024 left the GPU idle 40 ms between
# its 1,114 tasks, and 8192-row tiles make them 648 (4096-row tiles 1,120,
# counted on the CPU with the GPU's tiles). The rows go to the batch axis before
# the sequence beyond "seq": an attention step's scratch grows as the square of
# the sequence tile (about 10 bytes per score and head in a bfloat16 backward on
# a GPU: 21 GB for 32 heads at 8192 tokens, a quarter of it at 4096).
CPU_TILES = {"rows": 512, "seq": 512, "embd": 1024, "hidden": 2048, "vocab": 8192}
GPU_TILES = {"rows": 8192, "seq": 4096, "embd": 4096, "hidden": 8192, "vocab": 16384}
# On a GPU the feature axes' tiles are the products' leading dimensions, and tensor cores run at full speed only
# when a matrix's rows start 16 bytes apart (cuBLAS's rule; XLA pads its bfloat16 products to multiples of 8
# elements for it on Ampere and later). So every tile of those axes but the last is a multiple of
# GPU_TILE_MULTIPLE, and an axis that no split can align (not a multiple of 8, as GPT-2's 50257-token
# vocabulary) takes the largest tiles, so that its one misaligned tile, the last, is the smallest:
# 16384 x 3 + 1105 rather than 12565 x 3 + 12562, every one misaligned.
GPU_TILE_MULTIPLE = 64


def even_tile(n: int, largest: int, multiple: int = 1) -> int:
    """The tile that cuts n into the fewest parts of at most `largest`, as equal as tiles that are multiples of
    `multiple` allow (3072, 2048 -> 1536, not 2048 + 1024; with multiple=64, 50000, 16384 -> 12544 x 3 + 12368)."""
    largest = max(multiple, largest // multiple * multiple)  # rounding a tile up must not pass it
    parts = -(-n // max(1, min(largest, n)))
    tile = -(-n // parts)
    return min(n, -(-tile // multiple) * multiple)


def gpu_aligned_tile(n: int, largest: int) -> int:
    """A GPU feature axis's tile (GPU_TILE_MULTIPLE above): aligned even splits, or the largest tile where n
    cannot be split into aligned tiles."""
    if n % 8:
        return min(n, largest)
    return even_tile(n, largest, GPU_TILE_MULTIPLE)


def resolve_tiles(config, batch_size: int, seq_len: int, gpu_mb: float | None = None) -> Tiles:
    """Tile sizes for a model config (`axis_sizes`, `head_dim`): the config's where given, else automatic
    ones: even splits of every axis, about CPU_TILES["rows"] token rows per tile (GPU_TILES with GPU memory
    to use, the feature axes aligned for tensor cores). `gpu_mb` is that memory (default: the runtime's,
    `runtime.gpu_memory_mb()`; the planner passes the one its flags give). Raises naming the field that does
    not fit."""
    sizes = {"batch": batch_size, "seq": seq_len, **config.axis_sizes()}
    on_gpu = bool(runtime.gpu_memory_mb() if gpu_mb is None else gpu_mb)
    largest = GPU_TILES if on_gpu else CPU_TILES
    feature_tile = gpu_aligned_tile if on_gpu else even_tile
    seq = even_tile(seq_len, largest["seq"])
    auto = Tiles(
        batch=even_tile(batch_size, max(1, largest["rows"] // seq)),
        seq=seq,
        embd=feature_tile(sizes["embd"], largest["embd"]),
        heads=even_tile(sizes["heads"], max(1, largest["embd"] // config.head_dim)),
        hidden=feature_tile(sizes["hidden"], largest["hidden"]),
        vocab=feature_tile(sizes["vocab"], largest["vocab"]),
    )
    tiles = Tiles(**{
        axis: getattr(config, f"tile_{axis}") if getattr(config, f"tile_{axis}") is not None else getattr(auto, axis)
        for axis in TILE_AXES
    })
    for axis, limit in sizes.items():
        value = getattr(tiles, axis)
        if value > limit:
            raise ValueError(f"tile_{axis}={value} is larger than its axis ({limit}); use at most {limit}")
    return tiles


def recomputed_blocks(config) -> int:
    """How many of a model's blocks, from the first, recompute their forward in the backward (remat="block",
    remat_blocks); "auto" must be resolved first."""
    if config.remat == "auto":
        raise ValueError("remat='auto' is chosen by the memory planner (jnntile.planning.choose_remat) before the "
                         "model is built; build it with remat='none' or 'block'")
    if config.remat == "none":
        return 0
    return config.n_blocks if config.remat_blocks is None else min(config.remat_blocks, config.n_blocks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packing:
    """A packed batch's layout as tensors (`LanguageModel.packing_tensors`): `documents` for the attention's
    document masking, `positions` int32 (B, T), the position of every token within its example."""

    documents: attention_ops.Documents
    positions: Tensor


class LanguageModel(nnx.Module):
    """What every family's causal LM shares (`families.Model`): built for (batch_size, seq_len) token ids with
    `tiles`; its `config` is a `families.ModelConfig`, its class's `hf_layout` its family's `families.HFLayout`."""

    hf_layout: ClassVar

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    def token_tensor(self, ids, *, allow_ignore: bool = False, ignore_index: int = -100) -> Tensor:
        """An int32 (B, T) Tensor of token ids tiled like the activations. Under jit, writes each call.

        Concrete ids are checked against the vocabulary before anything is submitted
        (targets may also hold `ignore_index` when `allow_ignore`).
        """
        if tuple(ids.shape) != (self.batch_size, self.seq_len):
            raise ValueError(f"token ids of shape {tuple(ids.shape)}; this model was built for "
                             f"(batch_size, seq_len) = ({self.batch_size}, {self.seq_len})")
        if not isinstance(ids, jax.core.Tracer):
            checked = np.asarray(ids)
            if allow_ignore:
                checked = checked[checked != ignore_index]
            embedding_ops.check_ids(checked, self.config.vocab_size)
        return values_ops.from_array(jnp.asarray(ids, jnp.int32) if isinstance(ids, jax.Array) else
                                  np.asarray(ids, np.int32), (self.tiles.batch, self.tiles.seq))

    def packing_tensors(self, segments, positions) -> Packing:
        """The Packing of a packed batch's int32 (B, T) arrays: `segments`, the example of each token in its row
        (1, 2, ...; 0 for padding), and `positions`, each token's position in its example (0 at its first
        token). Under jit, writes each call."""
        for name, array in (("segments", segments), ("positions", positions)):
            if tuple(np.shape(array)) != (self.batch_size, self.seq_len):
                raise ValueError(f"{name} of shape {tuple(np.shape(array))}; this model was built for "
                                 f"(batch_size, seq_len) = ({self.batch_size}, {self.seq_len})")
        if not isinstance(positions, jax.core.Tracer) and not 0 <= np.min(positions) <= np.max(positions) < \
                self.max_positions:
            raise ValueError(f"positions must lie in [0, {self.max_positions}) (the model's max_positions), got "
                             f"{int(np.min(positions))} .. {int(np.max(positions))}")
        rows = (self.tiles.batch, self.tiles.seq)
        return Packing(attention_ops.documents(jnp.asarray(segments, jnp.int32), rows),
                       values_ops.from_array(jnp.asarray(positions, jnp.int32), rows))

    @staticmethod
    def check_packing(packing: Packing | None, cache) -> None:
        if packing is not None and cache is not None:
            raise ValueError("a packed batch (packing) cannot be decoded with a key/value cache: decode one "
                             "sequence per row, without packing")

    def loss(self, idx, targets, dropout_seed=None, segments=None, positions=None) -> Tensor:
        """The mean cross-entropy (a scalar Tensor) of token arrays idx, targets (B, T) (targets may hold -100,
        ignored), with dropout where the config has some and `dropout_seed` is given. A packed batch also gives
        its `segments` and `positions` (packing_tensors)."""
        packing = None if segments is None else self.packing_tensors(segments, positions)
        _, loss = self(self.token_tensor(idx), self.token_tensor(targets, allow_ignore=True),
                       dropout_seed=dropout_seed, packing=packing)
        return loss

    def kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty key/value cache (of the key/value heads) for decoding `batch_size` sequences of up to
        `max_len` positions."""
        config = self.config
        # The batch in one tile unless the config sets one: a step's activations are a row per sequence,
        # and more batch tiles would only add tasks (2.6x slower steps with four one-row tiles of GPT-2's
        # tiny preset). Sequence and head tiles are the model's.
        return KVCache.empty(config.n_blocks, batch_size, max_len, config.axis_sizes()["heads"], config.head_dim,
                             tile_batch=min(config.tile_batch or batch_size, batch_size), tile_seq=self.tiles.seq,
                             tile_heads=self.tiles.heads)

    def logits_and_loss(self, x: Tensor, targets: Tensor | None, ignore_index: int, cache=None):
        """(logits, loss or None) of the last block's output x through the model's `head`; (None, None) for a
        decoding program that reads no logits (a prefill)."""
        if cache is not None and not cache.logits:
            return None, None
        logits = self.head(x)
        loss = None if targets is None else loss_ops.cross_entropy(logits, targets, ignore_index)
        return logits, loss

    def named_params(self) -> dict[str, nnx.Param]:
        """Parameter variables by their path in the module ("h.0.attn.c_attn.weight", "layers.0.mlp...")."""
        return {".".join(str(p) for p in path): variable for path, variable in nnx.iter_graph(self)
                if isinstance(variable, nnx.Param)}

    def to_hf_params(self) -> dict:
        """Every parameter in Hugging Face names and layouts, unread (`hf_layout.from_model`): np.asarray(value)
        reads one whole, `save_hf` and checkpoints stream them from the tiles chunk by chunk."""
        return self.hf_layout.from_model(self.config, {name: _float(p.get_value())
                                                       for name, p in self.named_params().items()})

    def load_hf_params(self, params: dict, keep_quantized: bool = False) -> None:
        """Overwrites every parameter from Hugging Face tensors by name (arrays, or the unread tensors of
        `families.open_hf`, streamed into the tiles chunk by chunk). Checks every shape before writing. Inside
        `nn.quantized_base` a frozen weight is quantized as it is loaded; with `keep_quantized`, a quantized
        weight keeps its values (a frozen base built again from where it came from: a checkpoint holds it
        dequantized, and int8's scales do not survive quantizing that again bit for bit)."""
        sources = self.hf_layout.to_model(self.config, hf.checked(params, self.config, "the params to load"))
        mine = self.named_params()
        if set(sources) != set(mine):
            raise ValueError(f"parameters do not match the model: missing {sorted(set(mine) - set(sources))[:5]}, "
                             f"unexpected {sorted(set(sources) - set(mine))[:5]}")
        for name, variable in mine.items():
            if tuple(np.shape(sources[name])) != variable.get_value().shape:
                raise ValueError(f"parameter {name} comes as shape {tuple(np.shape(sources[name]))}, expected "
                                 f"{variable.get_value().shape}")
        if not keep_quantized:
            nn.quantize_frozen(self, loading=True)
        for name, variable in mine.items():
            if not (keep_quantized and isinstance(variable.get_value(), quant.Quantized)):
                variable.set_value(nn.load_into(variable.get_value(),
                                                lambda t: tensorfile.load_into(t, sources[name])))


def _float(value):
    """A parameter's value as a file holds it: a quantized weight dequantized to float32, the values it stands for."""
    return quant.dequantize(value) if isinstance(value, quant.Quantized) else value


def loss_and_grads(model: LanguageModel, idx, targets, *, dropout_seed=None, segments=None, positions=None):
    """Loss (a JAX scalar) and gradients (nnx.State of Tensors) of `model.loss` for token arrays idx, targets
    (and a packed batch's segments and positions)."""
    return nn.value_and_grad(lambda m, idx, targets, seed: m.loss(idx, targets, seed, segments, positions))(
        model, idx, targets, dropout_seed)
