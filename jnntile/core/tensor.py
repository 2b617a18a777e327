"""Tiled tensors: JAX pytrees whose data StarPU owns.

A `Tensor` has one leaf, a float32 scalar *token*, and static metadata: shape,
dtype, tile shape and the id of the tile grid in the native registry. Ops take
the tokens of the tensors they touch and return a fresh token, so the token
dataflow orders the FFI calls the way StarPU must see them (DESIGN section 1).

Lifetime: an eager tensor is freed when its last Python reference goes away
(or by `free()`); a tensor created while tracing under `jax.jit` is pinned,
because the compiled program refers to it by id, until `release_traced()`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import typing
import weakref

import jax
import numpy as np

from jnntile import _xla_ffi
from jnntile.core import runtime

# The native registry's dtypes (xla_ffi/tensor.h), name -> enum member.
DTYPES = _xla_ffi.DType.__members__
# The dtypes the kernels compute on (kernels/device.h FloatType), each with a gradient companion of the same
# dtype: bfloat16 activations have bfloat16 gradients.
FLOAT_DTYPES = tuple(_xla_ffi.FloatType.__members__)

# While a recording is active (`recording()`, used by the memory planner), handles get negative ids that
# name no native tensor and ops submit nothing: the op layer records what a step would create instead.
_recording = None
_recorded_ids = None

_pinned: set["_Handle"] = set()  # tensors created during tracing
_live: "weakref.WeakSet[_Handle]" = weakref.WeakSet()


class _Handle:
    """Owns one registry id; the static part of a Tensor pytree."""

    __slots__ = ("id", "shape", "dtype", "tile_shape", "owner", "native", "freed", "last_token", "grad",
                 "grad_zeroed", "is_grad", "copy", "master", "__weakref__")

    def __init__(self, tensor_id, shape, dtype, tile_shape, owner=True, native=True, master=None):
        self.id = tensor_id
        self.shape = shape
        self.dtype = dtype
        self.tile_shape = tile_shape
        self.owner = owner  # gradient companions are freed with their tensor
        self.native = native  # False: recorded by the planner, no native tensor behind it
        self.freed = False
        self.last_token = None  # the latest concrete token, waited on before freeing
        self.grad = None
        self.grad_zeroed = False  # backward ops accumulate only into zeroed gradients
        self.is_grad = not owner and master is None  # a gradient companion
        self.copy = None  # the compute copy (compute_copy_handle)
        self.master = master  # of a compute copy: the tensor it copies, whose lifetime it shares
        _live.add(self)

    def key(self):
        return (self.id, self.shape, self.dtype, self.tile_shape)

    def __eq__(self, other):
        return isinstance(other, _Handle) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def __repr__(self):
        return f"tensor {self.id} {self.dtype} {self.shape} tiles {self.tile_shape}"

    def check_alive(self):
        if self.freed:
            raise ValueError(f"{self!r} was freed; it cannot be used any more")

    def free(self):
        if self.freed or not self.owner or not self.native:
            return
        self.freed = True
        if self.last_token is not None:
            # An eagerly dispatched op on this tensor may not have run yet.
            jax.block_until_ready(self.last_token)
            self.last_token = None
        if runtime.is_running():
            _xla_ffi.tensor_free(self.id)

    def __del__(self):
        # A finalizer may run in the middle of JAX's own code (garbage collection
        # strikes anywhere), so it must not call into JAX: a tensor whose last
        # eager op may still be running is freed at the next safe point instead.
        if self.freed or not self.owner or not self.native:
            return
        self.freed = True
        try:
            if self.last_token is not None:
                _unreachable.append((self.id, self.last_token))
            elif runtime.is_running():
                _xla_ffi.tensor_free(self.id)
        except Exception:  # interpreter shutdown: the runtime frees everything
            pass


# (id, token) of tensors that became unreachable while an eager op on them may
# still run; free_unreachable() frees them.
_unreachable: list = []


def free_unreachable() -> None:
    """Frees the tiles of unreachable tensors once their last eager op has run (called at safe points)."""
    while _unreachable:
        tensor_id, token = _unreachable.pop()
        jax.block_until_ready(token)
        if runtime.is_running():
            _xla_ffi.tensor_free(tensor_id)


def _forget_all():
    """Called by runtime.stop(): every id becomes invalid."""
    for handle in list(_live):
        handle.freed = True
        handle.last_token = None
    _pinned.clear()
    _unreachable.clear()


runtime.before_stop(_forget_all)
runtime.at_safe_point(free_unreachable)


def release_traced() -> int:
    """Unpins tensors created while tracing, and clears JAX's caches that use them.

    Returns the number of tensors released. Compiled functions that used them
    must be traced again, which `jax.clear_caches()` ensures.
    """
    count = len(_pinned)
    jax.clear_caches()
    _pinned.clear()
    return count


def ready_on_host(t: "Tensor", under_jit: str) -> None:
    """Waits until every op on `t` is submitted, so that host reads and writes submitted next follow them."""
    t.handle.check_alive()
    if isinstance(t.token, jax.core.Tracer):
        raise TypeError(f"{t!r} is being traced: use {under_jit} inside jax.jit")
    if t.token is not None:
        jax.block_until_ready(t.token)


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


@jax.tree_util.register_pytree_node_class
class Tensor:
    """A tiled tensor. Create with `jnntile.zeros`, `full`, `from_array`, `random_normal`... (jnntile.ops.values)."""

    __slots__ = ("token", "handle")

    def __init__(self, token, handle: _Handle):
        self.token = token
        self.handle = handle

    def tree_flatten(self):
        return (self.token,), self.handle

    @classmethod
    def tree_unflatten(cls, handle, leaves):
        return cls(leaves[0], handle)

    # ---- metadata
    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def shape(self) -> tuple[int, ...]:
        return self.handle.shape

    @property
    def dtype(self) -> str:
        return self.handle.dtype

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return self.handle.tile_shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def grid(self) -> tuple[int, ...]:
        """Tiles per axis."""
        return tuple(-(-n // t) for n, t in zip(self.shape, self.tile_shape))

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, tile_shape={self.tile_shape}, id={self.id})"

    # ---- data
    def numpy(self) -> np.ndarray:
        """Blocks until the tensor is computed and returns a copy of its values. Eager only (use
        `jnntile.to_array` under jit).

        Raises ValueError when the tiles were invalidated (the native check knows
        what the last executed program did, so it is the one asked here).
        """
        ready_on_host(self, "jnntile.to_array")
        out = np.empty(self.shape, dtype=self.dtype)
        _xla_ffi.tensor_read(self.id, native_view(out))
        return out

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def free(self) -> None:
        """Releases the tiles now (otherwise released when unreachable)."""
        self.handle.free()

    def with_token(self, token) -> "Tensor":
        return Tensor(token, self.handle)


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree whose Tensors cross a `jax.jit` boundary as one token: `pack(tree)`, then `unpack()` inside.

    Each Tensor is a leaf of its own (its token), and jnntile's calls have side effects, which keeps JAX's
    dispatch of a jitted call on its Python path, per leaf: a training step of GPT-2 124M over its parameters
    and AdamW moments (about 450 Tensors) spent 40-50 ms per step there while the workers waited. Between two
    jitted calls every token of the first is complete (its calls have submitted their tasks, which StarPU
    orders by tile), so one token orders every later call on any of those Tensors just as well. Leaves that
    are not Tensors (a step count) stay leaves; the handles are static, as they are in a Tensor.
    """

    def __init__(self, token, others: tuple, treedef, handles: tuple):
        self.token, self.others, self.treedef, self.handles = token, others, treedef, handles

    def tree_flatten(self):
        return (self.token, *self.others), (self.treedef, self.handles)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(leaves[0], tuple(leaves[1:]), *aux)

    def unpack(self):
        """The tree, every Tensor holding the packed token."""
        others = iter(self.others)
        return jax.tree.unflatten(self.treedef, [next(others) if handle is None else Tensor(self.token, handle)
                                                 for handle in self.handles])


def pack(tree) -> Packed:
    """`tree` with its Tensors (exactly Tensor, not Gradient) behind one token: inside a jitted function the
    sum of their tokens, outside one of them once all are ready (see Packed)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: type(x) is Tensor)
    handles = tuple(x.handle if type(x) is Tensor else None for x in leaves)
    tokens = list({id(x.token): x.token for x, h in zip(leaves, handles) if h is not None}.values())
    if not tokens:
        raise ValueError("pack: the tree holds no Tensor")
    if any(_is_tracer(t) for t in tokens):
        token = sum(tokens[1:], tokens[0])
    else:
        jax.block_until_ready(tokens)
        token = tokens[0]
    return Packed(token, tuple(x for x, h in zip(leaves, handles) if h is None), treedef, handles)


class Clip(typing.NamedTuple):
    """A global-norm clip of gradient values: scaled by max_norm / norm when norm >= max_norm."""

    norm: Tensor  # scalar, the global norm of the gradients it clips
    max_norm: float


@jax.tree_util.register_pytree_node_class
class Gradient(Tensor):
    """The gradient of a Tensor argument, as returned by `jnntile.grad`.

    Same id as the argument; the values live in the argument's gradient
    companion (`grad_of`). A distinct pytree type so that an optimizer that
    does not know tiles (plain Optax) fails loudly instead of only changing
    tokens (DESIGN invariant 8): use a `jnntile.optim` transformation.

    What a transformation did to the values travels with them, as Optax's
    updates do: `clip`, a global-norm clip not applied to the tiles yet (the
    next update applies it as it reads them, `grad_of` before it reads them),
    and `summed`, True once they are summed over the ranks of a distributed run.
    """

    __slots__ = ("clip", "summed")

    def __init__(self, token, handle: _Handle, clip: Clip | None = None, summed: bool = False):
        super().__init__(token, handle)
        self.clip = clip
        self.summed = summed

    def tree_flatten(self):
        if self.clip is None:
            return (self.token,), (self.handle, None, None, self.summed)
        return (self.token, self.clip.norm.token), (self.handle, self.clip.norm.handle, self.clip.max_norm,
                                                    self.summed)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        handle, norm_handle, max_norm, summed = aux
        clip = None if norm_handle is None else Clip(Tensor(leaves[1], norm_handle), max_norm)
        return cls(leaves[0], handle, clip, summed)

    def with_token(self, token) -> "Gradient":
        return Gradient(token, self.handle, self.clip, self.summed)

    def __repr__(self):
        return (f"Gradient(of tensor {self.id}, shape={self.shape}: update parameters with a jnntile.optim "
                "transformation; Optax's own transformations cannot update tiled tensors)")


def _normalize_tile_shape(shape, tile_shape):
    if tile_shape is None:
        return tuple(shape)
    if isinstance(tile_shape, int):
        tile_shape = (tile_shape,) * len(shape)
    tile_shape = tuple(int(t) for t in tile_shape)
    if len(tile_shape) != len(shape):
        raise ValueError(f"tile_shape {tile_shape} has {len(tile_shape)} axes but shape {tuple(shape)} has {len(shape)}")
    for axis, (n, t) in enumerate(zip(shape, tile_shape)):
        if t <= 0:
            raise ValueError(f"tile_shape {tile_shape}: axis {axis} must be positive")
    # A tile larger than its axis is the whole axis.
    return tuple(min(n, t) for n, t in zip(shape, tile_shape))


@contextlib.contextmanager
def recording(record):
    """Within it, new handles name no native tensor and the op layer fills `record` instead of submitting
    tasks (jnntile.ops._ffi.call, differentiable): the memory planner traces the model the step runs."""
    global _recording, _recorded_ids
    if _recording is not None:
        raise RuntimeError("a recording is already active")
    _recording, _recorded_ids = record, itertools.count(-1, -1)
    try:
        yield record
    finally:
        _recording = _recorded_ids = None


def active_recording():
    """The record of the active recording, or None."""
    return _recording


def native_view(array: np.ndarray) -> np.ndarray:
    """`array` as the native tensor_read/tensor_write take it: a bfloat16 array as its raw 16-bit words
    (nanobind's arrays know no bfloat16), any other as it is."""
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


# Called with every tensor created while set (`on_creation`): jnntile.distributed.sharded_state shards them.
_creation_hook = None


@contextlib.contextmanager
def on_creation(hook):
    """Calls `hook(handle)` with each tensor created inside, before anything writes it."""
    global _creation_hook
    previous, _creation_hook = _creation_hook, hook
    try:
        yield
    finally:
        _creation_hook = previous


def new_handle(shape, dtype, tile_shape) -> _Handle:
    """A handle for a new tensor. Its tiles hold nothing: the first op must write them.

    Handles touched while tracing are pinned by `jnntile.ops._ffi.after`.
    """
    shape = tuple(int(n) for n in shape)
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    for axis, n in enumerate(shape):
        if n <= 0:
            raise ValueError(f"shape {shape}: axis {axis} must be positive")
    tile_shape = _normalize_tile_shape(shape, tile_shape)
    if _recording is not None:
        return _Handle(next(_recorded_ids), shape, dtype, tile_shape, owner=True, native=False)
    free_unreachable()
    runtime.ensure_started()
    tile_mb = math.prod(tile_shape) * np.dtype(dtype).itemsize / 2**20
    limit_mb = runtime.config().memory_limit_mb
    if tile_mb > limit_mb:
        raise ValueError(f"one tile of shape {tile_shape} ({tile_mb:.1f} MB) of a tensor of shape {shape} is "
                         f"larger than the memory limit of {limit_mb} MB: use smaller tiles or raise "
                         "memory_limit_mb")
    gpu_mb = runtime.gpu_memory_in_use_limit_mb()
    if tile_mb > gpu_mb > 0:
        raise ValueError(f"one tile of shape {tile_shape} ({tile_mb:.1f} MB) of a tensor of shape {shape} is "
                         f"larger than the GPU memory limit of {gpu_mb} MB: use smaller tiles or raise "
                         "gpu_memory_limit_mb")
    tensor_id = _xla_ffi.tensor_create(list(shape), list(tile_shape), DTYPES[dtype])
    handle = _Handle(tensor_id, shape, dtype, tile_shape)
    if _creation_hook is not None:
        _creation_hook(handle)
    return handle


def compute_copy_handle(handle: _Handle, dtype: str) -> _Handle:
    """The compute copy of a tensor in `dtype` (a bfloat16 copy of a float32 weight): same layout, freed
    with it, never invalidated, its gradient companion the master's (`grad_handle`). What it holds is kept
    fresh natively: a convert into it skips the tiles already equal to the master's current values, and
    optimizer updates write it with the master."""
    handle.check_alive()
    if handle.copy is None:
        copy_id = _xla_ffi.tensor_compute_copy(handle.id, DTYPES[dtype]) if handle.native else next(_recorded_ids)
        handle.copy = _Handle(copy_id, handle.shape, dtype, handle.tile_shape, owner=False, native=handle.native,
                              master=handle)
    elif handle.copy.dtype != dtype:
        raise ValueError(f"{handle!r} has a compute copy in {handle.copy.dtype}, not {dtype}")
    return handle.copy


def grad_handle(handle: _Handle) -> _Handle:
    """The gradient companion of a tensor: same layout, freed with it. A compute copy's is its master's:
    the backward's products accumulate a bfloat16 weight's gradient straight into the float32 master's."""
    if handle.master is not None:
        return grad_handle(handle.master)
    handle.check_alive()
    if handle.grad is None:
        grad_id = _xla_ffi.tensor_grad(handle.id) if handle.native else next(_recorded_ids)
        handle.grad = _Handle(grad_id, handle.shape, handle.dtype, handle.tile_shape, owner=False,
                              native=handle.native)
    return handle.grad


