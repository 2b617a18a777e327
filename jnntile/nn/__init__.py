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
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Callable

import jax
from flax import nnx

import jnntile
from jnntile.ops import bias as bias_ops
from jnntile.ops import data as data_ops
from jnntile.ops import dropout as dropout_ops
from jnntile.ops import embedding as embedding_ops
from jnntile.ops import gemm
from jnntile.ops import layernorm as layernorm_ops
from jnntile.tensor import Tensor


_initialize = True


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


def _param(initial: Callable[[], Tensor], shape, tile_shape) -> nnx.Param:
    """A parameter with `initial()`'s values, or an empty one inside `uninitialized()`."""
    return nnx.Param(initial() if _initialize else jnntile.empty(shape, tile_shape=tile_shape))


def compute_copy(weight: Tensor, dtype: str) -> Tensor:
    """`weight` itself when it has `dtype`, else its persistent compute copy in `dtype`
    (`jnntile.ops.data.compute_copy`, differentiable into the master)."""
    return weight if weight.dtype == dtype else data_ops.compute_copy(weight, dtype)


def param_seed(seed: int, name: str) -> int:
    """A per-parameter seed: stable across runs, tilings and Python versions."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class Linear(nnx.Module):
    """y = x @ W + b, contracting the last `in_ndim` axes of x with the first of W.

    W: (*in_shape, *out_shape) tiled (*in_tiles, *out_tiles); b: out_shape. With
    `weight_out_first`, W is (*out_shape, *in_shape), as torch.nn.Linear stores it,
    and y = x @ W^T: Hugging Face's weights then load without a transpose.
    x and y have `dtype`; W and b are float32 (a bfloat16 y adds the float32 b in float32).
    """

    def __init__(self, in_shape, out_shape, *, in_tiles, out_tiles, seed: int, name: str,
                 std: float = 0.02, use_bias: bool = True, weight_out_first: bool = False, dtype: str = "float32"):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.in_ndim = len(in_shape)
        self.dtype = dtype
        self.weight_out_first = weight_out_first
        shape = out_shape + in_shape if weight_out_first else in_shape + out_shape
        weight_tiles = tuple(out_tiles) + tuple(in_tiles) if weight_out_first else tuple(in_tiles) + tuple(out_tiles)
        self.weight = _param(lambda: jnntile.random_normal(shape, param_seed(seed, name + ".weight"), std=std,
                                                           tile_shape=weight_tiles),
                             shape, weight_tiles)
        self.bias = _param(lambda: jnntile.zeros(out_shape, tile_shape=tuple(out_tiles)), out_shape,
                           tuple(out_tiles)) if use_bias else None

    def __call__(self, x: Tensor) -> Tensor:
        y = gemm.matmul(x, compute_copy(self.weight.get_value(), self.dtype), ndim=self.in_ndim,
                        trans_b=self.weight_out_first)
        if self.bias is not None:
            y = bias_ops.add_bias(y, self.bias.get_value())
        return y


class LayerNorm(nnx.Module):
    """Layer norm over the last axis, with weight (ones) and bias (zeros)."""

    def __init__(self, features: int, *, tile: int, eps: float = 1e-5):
        self.eps = float(eps)
        self.weight = _param(lambda: jnntile.full((features,), 1.0, tile_shape=(tile,)), (features,), (tile,))
        self.bias = _param(lambda: jnntile.zeros((features,), tile_shape=(tile,)), (features,), (tile,))

    def __call__(self, x: Tensor) -> Tensor:
        return layernorm_ops.layer_norm(x, self.weight.get_value(), self.bias.get_value(), self.eps)


class RMSNorm(nnx.Module):
    """RMS normalization over the last axis (Llama's RMSNorm), with weight (ones) and no bias."""

    def __init__(self, features: int, *, tile: int, eps: float = 1e-6):
        self.eps = float(eps)
        self.weight = _param(lambda: jnntile.full((features,), 1.0, tile_shape=(tile,)), (features,), (tile,))

    def __call__(self, x: Tensor) -> Tensor:
        return layernorm_ops.rms_norm(x, self.weight.get_value(), self.eps)


class Embedding(nnx.Module):
    """A (num_embeddings, features) float32 table looked up by int32 ids, into rows of `dtype`."""

    def __init__(self, num_embeddings: int, features: int, *, tiles, seed: int, name: str, std: float = 0.02,
                 dtype: str = "float32"):
        self.dtype = dtype
        self.weight = _param(lambda: jnntile.random_normal((num_embeddings, features),
                                                           param_seed(seed, name + ".weight"), std=std,
                                                           tile_shape=tuple(tiles)),
                             (num_embeddings, features), tuple(tiles))

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


def value_and_grad(loss_fn: Callable, has_aux: bool = False, *, keep_activations: bool = False, accumulate=None,
                   scale=1.0):
    """`loss_fn(model, *args)` -> (loss, grads): grads is an nnx.State of Tensors like the params.

    The model's graph is split off, its parameters differentiated with
    `jnntile.value_and_grad`, and merged back for the call. Activations are
    invalidated after their last use in the backward pass unless
    `keep_activations=True`; `accumulate` (the grads of an earlier call) and
    `scale` accumulate gradients over micro-batches (see `jnntile.value_and_grad`).
    """

    def wrapped(model: nnx.Module, *args, **kwargs):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def pure(params, *args, **kwargs):
            return loss_fn(nnx.merge(graphdef, params, rest), *args, **kwargs)

        return jnntile.value_and_grad(pure, has_aux=has_aux, keep_activations=keep_activations,
                                      accumulate=accumulate, scale=scale)(params, *args, **kwargs)

    return wrapped


def recomputed(module: nnx.Module, *args):
    """`module(*args)` (one output Tensor) recomputed in the backward pass (`jnntile.remat`): between the
    forward and the backward only its input and output live, not its activations."""
    graphdef, state = nnx.split(module)
    return jnntile.remat(lambda state, *args: nnx.merge(graphdef, state)(*args))(state, *args)


def tensors(state) -> list[Tensor]:
    """The Tensor leaves of an nnx.State (parameters or gradients), in a fixed order."""
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Tensor))
