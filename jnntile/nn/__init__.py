"""Flax NNX layers whose parameters are tiled jnntile Tensors.

Parameters are `nnx.Param`s holding `jnntile.Tensor` pytrees, so `nnx.split`,
`nnx.merge`, `nnx.state` and `jax.jit` work as usual. Differentiate with
`jnntile.nn.value_and_grad` (or `jnntile.value_and_grad` on the split state),
which starts every parameter gradient at zero; the gradients come back as an
`nnx.State` of Tensors with the parameters' ids (`jnntile.grad_of` reads them).

Initial values are counter-based (`jnntile.random_normal`): a parameter's seed
is derived from the model seed and the parameter's name, so the same seed
gives the same weights for any tiling and any number of workers. Modules
built inside `uninitialized()` get parameters that hold nothing yet, for a
loader that overwrites them all.

Mixed precision follows Flax: parameters are float32 (`param_dtype`), and a
module's `dtype` ("bfloat16") is the dtype it computes and outputs in: its
weight enters the products as its persistent bfloat16 compute copy
(`compute_copy`: converted only where the master changed, and an optimizer
update writes it with the master), whose gradient adds into the master's.

Fine-tuning: `LoRA` wraps a `Linear` with a low-rank adapter whose two factors
are `nnx.LoRAParam`s (a kind of `nnx.Param`); `trainable(...)` is the NNX
filter of the parameters a step differentiates, and `value_and_grad(...,
wrt=filter)` differentiates those alone: the others are frozen (no gradient, no
optimizer state, and the backward skips their weight-gradient products).
Inside `base_dtype("bfloat16")` the weights of `Linear`s and the tables of
`Embedding`s are stored in bfloat16 (a frozen base that is never updated
needs no float32 master);
inside `quantized_base("nf4" | "int8")` they are `jnntile.ops.quant.Quantized`
(frozen: their products give no weight gradient).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import zlib
from typing import Callable

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from jnntile.core import grad as grad_mod
from jnntile.core import runtime
from jnntile.core.tensor import FLOAT_DTYPES
from jnntile.ops import values as values_ops
from jnntile.ops import dropout as dropout_ops
from jnntile.ops import elementwise as elementwise_ops
from jnntile.ops import embedding as embedding_ops
from jnntile.ops import gemm
from jnntile.ops import layernorm as layernorm_ops
from jnntile.ops import quant
from jnntile.core.tensor import Tensor


_initialize = True
_linear_weight_dtype = "float32"
_linear_weight_quant = None
_quantized_frozen = None  # with _linear_weight_quant: the predicate of the frozen parameters it quantizes
_progress = None  # inside `progress`: the bar that parameters advance as their values are drawn or loaded


@contextlib.contextmanager
def uninitialized():
    """Modules built inside hold parameters whose tiles hold nothing yet (`jnntile.empty`).

    For a model about to be overwritten from a file (Hugging Face weights, a
    checkpoint): no initial values are computed, and none are written to swap
    only to be replaced. Every parameter must then be written before use.
    """
    global _initialize
    saved, _initialize = _initialize, False
    try:
        yield
    finally:
        _initialize = saved


@contextlib.contextmanager
def base_dtype(dtype: str):
    """`Linear` weights and `Embedding` tables built inside are stored in `dtype` ("bfloat16" or "float32"):
    for a frozen base (`trainable`), which no optimizer updates, so it needs no float32 master. Initial values
    are the float32 ones rounded (drawn tile by tile); a loader writes the file's values rounded."""
    global _linear_weight_dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"base_dtype: {dtype!r} is not one of {FLOAT_DTYPES}")
    saved, _linear_weight_dtype = _linear_weight_dtype, dtype
    try:
        yield
    finally:
        _linear_weight_dtype = saved


@contextlib.contextmanager
def quantized_base(kind: str | None, frozen: Callable | None = None):
    """`Linear` weights built inside are stored quantized as `kind` ("nf4" or "int8", `jnntile.ops.quant`; None:
    as `base_dtype` says), for a frozen base. Initial values are drawn in float, then quantized; a loader
    quantizes the file's values (`load_into`). With `frozen`, a predicate of (path, variable) as NNX filters
    take them, only the weights it names are (--freeze): a Linear, which does not know its path, is built in
    float, and `quantize_frozen(model)` quantizes those of the built model."""
    global _linear_weight_quant, _quantized_frozen
    if kind is not None and kind not in quant.QUANTIZATIONS:
        raise ValueError(f"quantized_base: {kind!r} is not one of {quant.QUANTIZATIONS}")
    saved = _linear_weight_quant, _quantized_frozen
    _linear_weight_quant, _quantized_frozen = kind, frozen
    try:
        yield
    finally:
        _linear_weight_quant, _quantized_frozen = saved


@contextlib.contextmanager
def progress(total: int, desc: str, enabled: bool = True):
    """Parameters drawn or loaded (`load_into`) inside advance a bar of `total` parameters on stderr, shown once
    it has run a second (a 70B base takes tens of minutes to draw and quantize on a few cores); yields the bar
    (None where not `enabled`: a bar around it, if any, counts them). A quantized weight advances it once
    quantized; a float one as its draw is submitted (the draws run later)."""
    global _progress
    if not enabled:
        yield None
        return
    with tqdm(total=total, desc=desc, unit="param", unit_scale=True, delay=1) as bar:
        saved, _progress = _progress, bar
        try:
            yield bar
        finally:
            _progress = saved


def _advance(value) -> None:
    """Counts a parameter whose values were just drawn or loaded in `progress`'s bar."""
    if _progress is not None:
        _progress.update(math.prod(value.shape))


def _check_quantizable(name: str, shape, tile_shape, kind: str) -> None:
    try:
        quant.layouts(shape, tile_shape, kind)
    except ValueError as e:
        raise ValueError(f"{name}: {e} (int8, --quantize-base int8, has no such constraint)") from None


def quantize_frozen(model: nnx.Module, *, loading: bool = False) -> list[str]:
    """Inside `quantized_base(kind, frozen)`: stores the weight of each `Linear` of `model` that `frozen` names
    quantized, its float tensor dropped; with `loading` (a model built `uninitialized()`, about to be loaded) as
    an empty `Quantized` that `load_into` fills one weight at a time. Returns the paths of the model's
    quantized weights."""
    kind, frozen = _linear_weight_quant, _quantized_frozen
    quantized = []
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, Linear):
            continue
        name, weight = ".".join(str(p) for p in (*path, "weight")), module.weight.get_value()
        if kind is not None and frozen is not None and not isinstance(weight, quant.Quantized) \
                and frozen((*path, "weight"), module.weight):
            _check_quantizable(name, weight.shape, weight.tile_shape, kind)
            weight = (quant.empty(weight.shape, weight.tile_shape, kind) if loading
                      else quant.quantize(weight, kind))
            module.weight.set_value(weight)
        if isinstance(weight, quant.Quantized):
            quantized.append(name)
    return quantized


def load_into(value, write: Callable[[Tensor], Tensor]):
    """`write(value)` (a loader filling every tile of a Tensor); for a quantized `value`, `write` fills a float32
    tensor of its shape, which is quantized and then dropped: one weight in float at a time, never the model."""
    if isinstance(value, quant.Quantized):
        loaded = quant.quantize(write(values_ops.empty(value.shape, "float32", tile_shape=value.tile_shape)),
                                value.quant)
    else:
        loaded = write(value)
    _advance(loaded)
    return loaded


def _quantize_drawn(weight: Tensor, kind: str) -> quant.Quantized:
    """A drawn float32 `weight` quantized, returned once the quantization has run: one weight at a time exists
    in float32 (each is freed before the next is drawn). Without the wait the next weights' draws, which depend
    on nothing, run ahead of the quantizations waiting for them, and every weight of the model exists in float32
    at once (8x an NF4 base)."""
    quantized = quant.quantize(weight, kind)
    runtime.wait_all()
    _advance(quantized)
    return quantized


def _param(initial: Callable[[], Tensor], shape, tile_shape, dtype: str = "float32",
           kind: type = nnx.Param) -> nnx.Param:
    """A `kind` parameter holding `initial()` (of `dtype`), or an empty one inside `uninitialized()`."""
    if not _initialize:
        return kind(values_ops.empty(shape, dtype, tile_shape=tile_shape))
    value = initial()
    _advance(value)
    return kind(value)


def compute_copy(weight: Tensor, dtype: str) -> Tensor:
    """`weight` itself when it has `dtype`, else its persistent compute copy in `dtype`
    (`jnntile.ops.values.compute_copy`, differentiable into the master)."""
    return weight if weight.dtype == dtype else values_ops.compute_copy(weight, dtype)


def param_seed(seed: int, name: str) -> int:
    """A per-parameter seed: stable across runs, tilings and Python versions."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class Linear(nnx.Module):
    """y = x @ W + b, contracting the last `in_ndim` axes of x with the first of W.

    W: (*in_shape, *out_shape) tiled (*in_tiles, *out_tiles); b: out_shape. With
    `weight_out_first`, W is (*out_shape, *in_shape), as torch.nn.Linear stores it,
    and y = x @ W^T: Hugging Face's weights then load without a transpose.
    x and y have `dtype`; W and b are float32 (a bfloat16 y adds the float32 b in float32); inside
    `quantized_base` W is a frozen `quant.Quantized`, dequantized tile by tile inside the product's tasks.
    """

    def __init__(self, in_shape, out_shape, *, in_tiles, out_tiles, seed: int, name: str,
                 std: float = 0.02, use_bias: bool = True, weight_out_first: bool = False, dtype: str = "float32"):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.in_ndim = len(in_shape)
        self.dtype = dtype
        self.weight_out_first = weight_out_first
        shape = out_shape + in_shape if weight_out_first else in_shape + out_shape
        weight_tiles = tuple(out_tiles) + tuple(in_tiles) if weight_out_first else tuple(in_tiles) + tuple(out_tiles)
        def draw(dtype):
            return values_ops.random_normal(shape, param_seed(seed, name + ".weight"), std=std,
                                            tile_shape=weight_tiles, dtype=dtype)

        kind = _linear_weight_quant if _quantized_frozen is None else None  # else quantize_frozen decides
        if kind is None:
            self.weight = _param(lambda: draw(_linear_weight_dtype), shape, weight_tiles, _linear_weight_dtype)
        else:  # drawn in float32, kept quantized alone
            _check_quantizable(name + ".weight", shape, weight_tiles, kind)
            self.weight = nnx.Param(_quantize_drawn(draw("float32"), kind) if _initialize
                                    else quant.empty(shape, weight_tiles, kind))
        self.bias = _param(lambda: values_ops.zeros(out_shape, tile_shape=tuple(out_tiles)), out_shape,
                           tuple(out_tiles)) if use_bias else None

    def __call__(self, x: Tensor, residual: Tensor | None = None, dropout_seed=None) -> Tensor:
        """x @ W + b, plus `residual` (a residual connection, of the output's layout) where given: added by the
        product's own tasks. `dropout_seed` is the step's, which the models pass to every projection for a
        `LoRA` in its place: a Linear has no dropout."""
        weight = self.weight.get_value()
        if isinstance(weight, quant.Quantized):
            return quant.linear(x, weight, None if self.bias is None else self.bias.get_value(), ndim=self.in_ndim,
                                trans_b=self.weight_out_first, residual=residual)
        return gemm.linear(x, compute_copy(weight, self.dtype),
                               None if self.bias is None else self.bias.get_value(), ndim=self.in_ndim,
                               trans_b=self.weight_out_first, residual=residual)


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter of a `LoRA` module: its name (PEFT's module, "q_proj"), rank, alpha, whether the scale
    is alpha / sqrt(rank) (rsLoRA) rather than alpha / rank, `rows`: the part (start, stop) of the first
    output axis it adapts, in whole tiles (q_proj's part of a fused q/k/v product), or None for all of it, and
    `dropout`: PEFT's lora_dropout, the rate of the dropout on the adapter's input in training (it changes no
    factor, so adapters that differ in it alone are equal)."""

    name: str
    rank: int
    alpha: float
    rows: tuple[int, int] | None = None
    rslora: bool = False
    dropout: float = dataclasses.field(default=0.0, compare=False)

    @property
    def scale(self) -> float:
        return self.alpha / (float(np.sqrt(self.rank)) if self.rslora else self.rank)


class Adapter(nnx.Module):
    """The factors of one LoRA adapter, `nnx.LoRAParam`s stored as the base's weight is: with `weight_out_first`
    A is (rank, *in_shape) and B (*out_shape, rank), PEFT's lora_A / lora_B layout; else A is (*in_shape, rank)
    and B (rank, *out_shape), out_shape being the adapted part's. As PEFT initialises them, A is uniform in
    +-1/sqrt(fan_in) (Kaiming-uniform with a = sqrt(5)) and B is zero. A's tiles follow the base's input tiles,
    B's its output tiles, and the rank is one tile. Its input dropout (`spec.dropout`, PEFT's lora_dropout) draws
    its mask at dropout site `site`, its own."""

    def __init__(self, base: Linear, spec: AdapterSpec, *, seed: int, name: str, site: int):
        if spec.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {spec.rank}")
        self.spec = spec
        self.dropout = Dropout(spec.dropout, site)
        rank = spec.rank
        weight = base.weight.get_value()
        n_in = base.in_ndim
        if base.weight_out_first:
            out_shape, in_shape = weight.shape[:-n_in], weight.shape[-n_in:]
            out_tiles, in_tiles = weight.tile_shape[:-n_in], weight.tile_shape[-n_in:]
        else:
            in_shape, out_shape = weight.shape[:n_in], weight.shape[n_in:]
            in_tiles, out_tiles = weight.tile_shape[:n_in], weight.tile_shape[n_in:]
        if spec.rows is not None:
            out_shape = (spec.rows[1] - spec.rows[0], *out_shape[1:])
        if base.weight_out_first:
            a_shape, a_tiles = (rank, *in_shape), (rank, *in_tiles)
            b_shape, b_tiles = (*out_shape, rank), (*out_tiles, rank)
        else:
            a_shape, a_tiles = (*in_shape, rank), (*in_tiles, rank)
            b_shape, b_tiles = (rank, *out_shape), (rank, *out_tiles)
        bound = 1.0 / float(np.sqrt(np.prod(in_shape)))
        self.lora_a = _param(lambda: values_ops.random_uniform(a_shape, param_seed(seed, name + ".lora_A"), -bound,
                                                            bound, tile_shape=a_tiles),
                             a_shape, a_tiles, kind=nnx.LoRAParam)
        self.lora_b = _param(lambda: values_ops.zeros(b_shape, tile_shape=b_tiles), b_shape, b_tiles,
                             kind=nnx.LoRAParam)


class LoRA(nnx.Module):
    """A frozen `Linear` plus trainable low-rank updates (LoRA), one `Adapter` per adapted module as PEFT has
    them: y = base(x) + sum over adapters of scale x A B, each adapter's update added into its part of the
    output (a fused q/k/v product's q_proj adapter into the q rows alone; parts without an adapter get none).
    `adapters` (an nnx.Dict by AdapterSpec name) start as the base: B is zero. Both factors are float32
    parameters; in bfloat16 they enter the products as compute copies, as every weight does. With a dropout
    seed (training), each adapter's input is its own dropout of x (PEFT's lora_B(lora_A(dropout(x)))): adapter
    k draws at dropout site `first_site + k`, so adapters sharing x draw different masks."""

    def __init__(self, base: Linear, specs, *, seed: int, name: str, first_site: int = 0):
        specs = list(specs)
        if not specs:
            raise ValueError(f"LoRA {name}: no adapter given")
        self.base = base
        self.adapters = nnx.Dict({spec.name: Adapter(base, spec, seed=seed, name=name if len(specs) == 1 and
                                                     spec.rows is None else f"{name}.{spec.name}",
                                                     site=first_site + k)
                                  for k, spec in enumerate(specs)})

    def _out_axis(self, ndim: int) -> int:
        """The first output axis of a tensor of `ndim` axes: the product's, or the weight's when it is input-first."""
        weight = self.base.weight.get_value()
        return ndim - (weight.ndim - self.base.in_ndim)

    def delta(self, adapter: Adapter, x: Tensor) -> Tensor:
        """scale x A B of one adapter: x (..., *in_shape) -> (..., rank) -> (..., *its part of out_shape)."""
        dtype, out_first = self.base.dtype, self.base.weight_out_first
        low = gemm.matmul(x, compute_copy(adapter.lora_a.get_value(), dtype), ndim=self.base.in_ndim,
                          trans_b=out_first)
        return gemm.matmul(low, compute_copy(adapter.lora_b.get_value(), dtype), trans_b=out_first,
                           alpha=adapter.spec.scale)

    def _added(self, y: Tensor, update: Tensor, spec: AdapterSpec, axis: int) -> Tensor:
        if spec.rows is None:
            return elementwise_ops.add(y, update)
        return elementwise_ops.add_part(y, update, axis, spec.rows[0])

    def __call__(self, x: Tensor, residual: Tensor | None = None, dropout_seed=None) -> Tensor:
        y = self.base(x, residual)
        for adapter in self.adapters.values():
            update = self.delta(adapter, adapter.dropout(x, dropout_seed))
            y = self._added(y, update, adapter.spec, self._out_axis(y.ndim))
        return y

    def merged_weight(self) -> Tensor:
        """The base weight plus every adapter's scaled update in its part, as one new float32 tensor tiled as the
        base's: what PEFT's merge writes."""
        weight = self.base.weight.get_value()
        if isinstance(weight, quant.Quantized):
            weight = quant.dequantize(weight)
        elif weight.dtype != "float32":
            weight = values_ops.convert(weight, "float32")
        for adapter in self.adapters.values():
            a, b, spec = adapter.lora_a.get_value(), adapter.lora_b.get_value(), adapter.spec
            if self.base.weight_out_first:
                weight = self._added(weight, gemm.matmul(b, a, alpha=spec.scale), spec, 0)
            else:
                weight = self._added(weight, gemm.matmul(a, b, alpha=spec.scale), spec, self.base.in_ndim)
        return weight


def trainable(freeze: str | None = None, train_only: str | None = None, adapters_only: bool = False):
    """The NNX filter of the parameters a fine-tuning step trains, by their path ("layers.3.mlp.down_proj.weight",
    as `LanguageModel.named_params` names them): with `adapters_only`, the `nnx.LoRAParam`s alone; else every
    parameter whose path matches `train_only` (a regular expression, searched; every one when None) and not
    `freeze`."""
    if adapters_only:
        if freeze or train_only:
            raise ValueError("with LoRA adapters the base is frozen and the adapters train: --freeze and "
                             "--train-only do not apply")
        return nnx.LoRAParam
    patterns = {}
    for flag, pattern in (("--freeze", freeze), ("--train-only", train_only)):
        if pattern:
            try:
                patterns[flag] = re.compile(pattern)
            except re.error as error:
                raise ValueError(f"{flag} {pattern!r} is not a regular expression: {error}") from None

    def selected(path, variable) -> bool:
        if not isinstance(variable, nnx.Param):
            return False
        name = ".".join(str(p) for p in path)
        if "--train-only" in patterns and not patterns["--train-only"].search(name):
            return False
        return not ("--freeze" in patterns and patterns["--freeze"].search(name))

    return selected


class LayerNorm(nnx.Module):
    """Layer norm over the last axis, with weight (ones) and bias (zeros)."""

    def __init__(self, features: int, *, tile: int, eps: float = 1e-5):
        self.eps = float(eps)
        self.weight = _param(lambda: values_ops.full((features,), 1.0, tile_shape=(tile,)), (features,), (tile,))
        self.bias = _param(lambda: values_ops.zeros((features,), tile_shape=(tile,)), (features,), (tile,))

    def __call__(self, x: Tensor) -> Tensor:
        return layernorm_ops.layer_norm(x, self.weight.get_value(), self.bias.get_value(), self.eps)


class RMSNorm(nnx.Module):
    """RMS normalization over the last axis (Llama's RMSNorm), with weight (ones) and no bias."""

    def __init__(self, features: int, *, tile: int, eps: float = 1e-6):
        self.eps = float(eps)
        self.weight = _param(lambda: values_ops.full((features,), 1.0, tile_shape=(tile,)), (features,), (tile,))

    def __call__(self, x: Tensor) -> Tensor:
        return layernorm_ops.rms_norm(x, self.weight.get_value(), self.eps)


class Embedding(nnx.Module):
    """A (num_embeddings, features) table looked up by int32 ids, into rows of `dtype`: float32, or as
    `base_dtype` says (a frozen base's bfloat16 table, read as it is by the lookup and by `attend`)."""

    def __init__(self, num_embeddings: int, features: int, *, tiles, seed: int, name: str, std: float = 0.02,
                 dtype: str = "float32"):
        self.dtype = dtype
        self.weight = _param(lambda: values_ops.random_normal((num_embeddings, features),
                                                           param_seed(seed, name + ".weight"), std=std,
                                                           tile_shape=tuple(tiles), dtype=_linear_weight_dtype),
                             (num_embeddings, features), tuple(tiles), _linear_weight_dtype)

    def __call__(self, ids: Tensor) -> Tensor:
        return embedding_ops.embedding(ids, self.weight.get_value(), dtype=self.dtype)

    def attend(self, x: Tensor) -> Tensor:
        """x @ table^T in `dtype` (a head tied to the embeddings, or a head stored like them): (..., V)."""
        return gemm.matmul(x, compute_copy(self.weight.get_value(), self.dtype), trans_b=True)


class Dropout(nnx.Module):
    """Dropout with a per-call seed (a JAX int32 scalar, so it never recompiles)."""

    def __init__(self, rate: float, site: int):
        self.rate = float(rate)
        self.site = int(site)  # distinguishes the masks of different layers under one seed

    def __call__(self, x: Tensor, seed) -> Tensor:
        if self.rate == 0.0 or seed is None:
            return x
        return dropout_ops.dropout(x, self.rate, seed * 7919 + self.site)

    def residual(self, x: Tensor, branch: Callable[[Tensor | None], Tensor], seed) -> Tensor:
        """x + dropout(branch): `branch(residual)` returns the branch's output plus `residual` where that is
        given, added by its last product's tasks (`Linear(..., residual)`); with dropout on, the branch gets
        None and the sum comes after the mask."""
        if self.rate == 0.0 or seed is None:
            return branch(x)
        return elementwise_ops.add(x, self(branch(None), seed))


def value_and_grad(loss_fn: Callable, has_aux: bool = False, *, keep_activations: bool = False, accumulate=None,
                   scale=1.0, wrt=nnx.Param):
    """`loss_fn(model, *args)` -> (loss, grads): grads is an nnx.State of Tensors like the params.

    The model's graph is split off, its `wrt` parameters (an NNX filter: every `nnx.Param` by default,
    `trainable(...)` to fine-tune) differentiated with
    `jnntile.value_and_grad`, and merged back for the call. Activations are
    invalidated after their last use in the backward pass unless
    `keep_activations=True`; `accumulate` (the grads of an earlier call) and
    `scale` accumulate gradients over micro-batches (see `jnntile.value_and_grad`).
    """

    def wrapped(model: nnx.Module, *args, **kwargs):
        graphdef, params, rest = nnx.split(model, wrt, ...)

        def pure(params, *args, **kwargs):  # the rest (frozen parameters) gets no gradient companion at all
            return loss_fn(nnx.merge(graphdef, params, rest), *args, **kwargs)

        return grad_mod.value_and_grad(pure, has_aux=has_aux, keep_activations=keep_activations,
                                      accumulate=accumulate, scale=scale)(params, *args, **kwargs)

    return wrapped


def recomputed(module: nnx.Module, *args):
    """`module(*args)` (one output Tensor) recomputed in the backward pass (`jnntile.remat`): between the
    forward and the backward only its input and output live, not its activations."""
    graphdef, state = nnx.split(module)
    return grad_mod.remat(lambda state, *args: nnx.merge(graphdef, state)(*args))(state, *args)


def tensors(state) -> list[Tensor]:
    """The Tensor leaves of an nnx.State (parameters or gradients), in a fixed order."""
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Tensor))
