"""Safetensors files streamed to and from tiled tensors, one chunk of tiles at a time.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
then the raw little-endian data of every tensor at its offsets, back to back.
Every tensor thus sits at a known place, and a block of one is written or read
in place (os.pwrite / os.pread): a tensor larger than RAM passes through one
host buffer of a chunk of its tiles (`jnntile.ops.values.chunks`), never whole.

A row-major reshape keeps the bytes, so a tensor stored in another shape of
the same size (Hugging Face's (C, 3C) for jnntile's (C, 3, H, D)) streams the
same way: `Reshaped` names a tensor in the shape its file holds.

Reading a file starts with `SafetensorsFile(path)`, which checks the whole
header against the file's size before anything is read, so a truncated or
damaged file is refused with the problem and the file named.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from jnntile.ops import values as values_ops
from jnntile.core import distributed, runtime
from jnntile.core.tensor import Tensor

# Bytes per element of every safetensors dtype, and the numpy type that reads
# it where jnntile can read it (bfloat16, which numpy lacks, is widened to float32).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
_NUMPY = {"BOOL": "?", "U8": "u1", "I8": "i1", "I16": "<i2", "U16": "<u2", "F16": "<f2", "I32": "<i4", "U32": "<u4",
          "F32": "<f4", "F64": "<f8", "I64": "<i8", "U64": "<u8"}
_CODES = {np.dtype(v).newbyteorder("="): k for k, v in _NUMPY.items()}
# The safetensors library refuses larger headers; so does this reader, before allocating one.
MAX_HEADER_BYTES = 100_000_000
# Inside `collective_writes` of a sharded run: every rank writes each file together.
_collective = False


@contextlib.contextmanager
def collective_writes():
    """Inside, with sharded state (jnntile.distributed.sharding), every rank calls `write_file` and
    `write_atomically` on the same files in the same order, in a directory every rank sees: each rank writes
    the tiles it owns in place, rank 0 the header and the rest (arrays, tensors every rank holds), so a file
    streams from every rank at once and is the file one process writes. Each call returns once every rank has
    written its part. The reads of the tiles are every rank's (they are collective). Does nothing unless
    sharding."""
    global _collective
    previous, _collective = _collective, distributed.sharding()
    try:
        yield
    finally:
        _collective = previous


def dtype_code(dtype) -> str:
    """The safetensors name of a numpy dtype ("F32" for float32, "BF16" for ml_dtypes' bfloat16)."""
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
        return "BF16"
    code = _CODES.get(np.dtype(dtype).newbyteorder("="))
    if code is None:
        raise TypeError(f"dtype {np.dtype(dtype).name} has no safetensors equivalent")
    return code


class Reshaped:
    """A tiled tensor seen in another row-major shape of the same size (the bytes are the same).

    Nothing is read until asked: np.asarray(view) reads the whole tensor, while
    `write_file` and `load_into` stream it chunk by chunk.
    """

    def __init__(self, tensor: Tensor, shape):
        shape = tuple(int(n) for n in shape)
        if math.prod(shape) != tensor.size:
            raise ValueError(f"{tensor!r} cannot be seen as shape {shape}: the sizes differ")
        self.tensor, self.shape, self.dtype = tensor, shape, np.dtype(tensor.dtype)

    def __array__(self, dtype=None, copy=None):
        out = self.tensor.numpy().reshape(self.shape)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self):
        return f"Reshaped({self.tensor!r}, shape={self.shape})"


class Derived:
    """An array computed from a tiled tensor, read only when `write_file` writes it (one at a time): a Hugging
    Face tensor cut out of a fused jnntile one, `compute(values of tensor)` of shape `shape`."""

    def __init__(self, tensor: Tensor, shape, compute):
        self.tensor, self.shape, self.compute = tensor, tuple(int(n) for n in shape), compute
        self.dtype = np.dtype(tensor.dtype)

    def __array__(self, dtype=None, copy=None):
        out = np.ascontiguousarray(self.compute(self.tensor.numpy())).reshape(self.shape)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self):
        return f"Derived({self.tensor!r}, shape={self.shape})"


class FileTensor:
    """One tensor of a safetensors file (header checked); nothing is read until asked."""

    def __init__(self, path: Path, name: str, code: str, shape: tuple, begin: int):
        self.path, self.name, self.code, self.shape, self.begin = path, name, code, shape, begin
        self.nbytes = math.prod(shape) * _ITEMSIZE[code]
        # What `read` returns; None for the 8-bit floats, which jnntile cannot read.
        self.dtype = (np.dtype(np.float32) if code == "BF16" else
                      np.dtype(_NUMPY[code]).newbyteorder("=") if code in _NUMPY else None)

    def __repr__(self):
        return f"tensor {self.name!r} ({self.code}, shape {self.shape}) of {self.path}"

    def __array__(self, dtype=None, copy=None):
        out = self.read()
        return out if dtype is None else out.astype(dtype)

    def read(self, shape=None, start=None, stop=None) -> np.ndarray:
        """The block start:stop of the tensor seen as `shape` (a row-major reshape; default: its own), or all of it."""
        if self.dtype is None:
            raise ValueError(f"{self} has dtype {self.code}, which jnntile cannot read")
        shape = self.shape if shape is None else tuple(shape)
        if math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"{self} cannot be seen as shape {shape}: the sizes differ")
        start = (0,) * len(shape) if start is None else tuple(start)
        stop = shape if stop is None else tuple(stop)
        raw = np.empty(tuple(b - a for a, b in zip(start, stop)), np.dtype("<u2" if self.code == "BF16" else
                                                                          _NUMPY[self.code]))
        flat = raw.reshape(-1).view(np.uint8)
        itemsize = _ITEMSIZE[self.code]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            for offset, length in _runs(shape, start, stop):
                _pread_into(fd, flat[done:done + length * itemsize], self.begin + offset * itemsize, self)
                done += length * itemsize
        finally:
            os.close(fd)
        if self.code == "BF16":  # bfloat16 is the top half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(raw.dtype.newbyteorder("="), copy=False)


class Stacked:
    """Tensors of a file seen as one: `parts` stacked along axis 0, each a FileTensor (or array) seen in a
    row-major `view` shape with its axes permuted by `axes` (as np.transpose's). Hugging Face's q, k and v
    projections become jnntile's fused one this way. Nothing is read until asked: `read` reads a block of
    each part it overlaps, so `load_into` streams it chunk by chunk as it does a FileTensor.
    """

    def __init__(self, parts):
        self.parts = [(source, tuple(view), tuple(axes)) for source, view, axes in parts]
        shapes = [tuple(view[a] for a in axes) for _, view, axes in self.parts]
        for (source, view, _), shape in zip(self.parts, shapes):
            if math.prod(view) != math.prod(np.shape(source)):
                raise ValueError(f"{source!r} cannot be seen as shape {view}: the sizes differ")
            if shape[1:] != shapes[0][1:]:
                raise ValueError(f"parts of shapes {shapes} cannot be stacked along axis 0")
        self.shape = (sum(shape[0] for shape in shapes),) + shapes[0][1:]
        self.dtype = np.result_type(*(source.dtype for source, _, _ in self.parts))

    def __repr__(self):
        return "stacked " + ", ".join(repr(source) for source, _, _ in self.parts)

    def __array__(self, dtype=None, copy=None):
        out = self.read()
        return out if dtype is None else out.astype(dtype)

    def read(self, shape=None, start=None, stop=None) -> np.ndarray:
        """The block start:stop (default: all of it); `shape` must be the stacked shape."""
        if shape is not None and tuple(shape) != self.shape:
            raise ValueError(f"{self} has shape {self.shape}, not {tuple(shape)}")
        start = (0,) * len(self.shape) if start is None else tuple(start)
        stop = self.shape if stop is None else tuple(stop)
        out = np.empty(tuple(b - a for a, b in zip(start, stop)), self.dtype)
        offset = 0
        for source, view, axes in self.parts:
            rows = view[axes[0]]
            lo, hi = max(start[0], offset), min(stop[0], offset + rows)
            if lo < hi:
                # The block in the permuted part's coordinates, then in the view's: axis axes[i] of the view
                # is axis i of the part.
                part_start, part_stop = (lo - offset,) + start[1:], (hi - offset,) + stop[1:]
                view_start, view_stop = [0] * len(view), [0] * len(view)
                for i, a in enumerate(axes):
                    view_start[a], view_stop[a] = part_start[i], part_stop[i]
                if isinstance(source, FileTensor):
                    block = source.read(view, view_start, view_stop)
                else:
                    block = np.asarray(source).reshape(view)[tuple(map(slice, view_start, view_stop))]
                out[lo - start[0]:hi - start[0]] = np.transpose(block, axes)
            offset += rows
        return out


class SafetensorsFile(Mapping):
    """The tensors of a safetensors file by name, after checking its header against its size.

    Raises ValueError naming the file and what is wrong: shorter than its
    header says (truncated), a header that does not parse, a tensor whose
    offsets do not match its dtype and shape or overlap another's.
    """

    def __init__(self, path):
        self.path = path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found")
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path} is truncated: {size} bytes, not even the 8-byte header length of a "
                                 "safetensors file")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ValueError(f"{path} is truncated or not a safetensors file: its header length field says "
                                 f"{n} bytes, the file holds {size}")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"the header of {path} does not parse as JSON ({e}): the file is damaged or not a "
                             "safetensors file") from None
        if not isinstance(header, dict):
            raise ValueError(f"the header of {path} is not a JSON object: the file is damaged")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start, data_bytes = 8 + n, size - 8 - n
        self._tensors = {}
        for name, entry in header.items():
            code, shape, offsets = _parse_entry(path, name, entry)
            self._tensors[name] = FileTensor(path, name, code, shape, data_start + offsets[0])
        # Back to back from the start of the data to its end, as the safetensors library requires.
        position = 0
        for tensor in sorted(self._tensors.values(), key=lambda t: (t.begin, t.nbytes)):
            begin = tensor.begin - data_start
            if begin != position:
                what = "overlaps the previous tensor" if begin < position else f"leaves a gap of {begin - position} bytes"
                raise ValueError(f"the header of {path} is damaged: tensor {tensor.name!r} starts at byte {begin} "
                                 f"of the data and {what}")
            position += tensor.nbytes
        if position > data_bytes:
            raise ValueError(f"{path} is truncated: its tensors need {position} bytes of data after the header, the "
                             f"file holds {data_bytes} ({size} bytes in all); it was probably not written completely")
        if position < data_bytes:
            raise ValueError(f"{path} has {data_bytes - position} bytes after its last tensor: the file is damaged")

    def __getitem__(self, name) -> FileTensor:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self):
        return len(self._tensors)


def _parse_entry(path, name, entry):
    def bad(what):
        return ValueError(f"the header of {path} is damaged: tensor {name!r} {what}")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise bad("lacks dtype, shape or data_offsets")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in _ITEMSIZE:
        raise bad(f"has the unknown dtype {code!r}")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise bad(f"has the shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has the data_offsets {offsets!r}, not [begin, end]")
    expected = math.prod(shape) * _ITEMSIZE[code]
    if offsets[1] - offsets[0] != expected:
        raise bad(f"spans {offsets[1] - offsets[0]} bytes, but {code} {tuple(shape)} needs {expected}")
    return code, tuple(shape), offsets


def _runs(shape, start, stop):
    """(element offset, length) of each contiguous run of the block start:stop of a row-major array of `shape`."""
    ndim = len(shape)
    if ndim == 0:
        return [(0, 1)]
    # Trailing axes the block covers whole belong to every run.
    axis = ndim - 1
    while axis > 0 and start[axis] == 0 and stop[axis] == shape[axis]:
        axis -= 1
    strides = [math.prod(shape[a + 1:]) for a in range(ndim)]
    length = (stop[axis] - start[axis]) * strides[axis]
    offsets = np.asarray(start[axis] * strides[axis], np.int64)
    for a in range(axis - 1, -1, -1):  # outer axes vary slowest
        offsets = (np.arange(start[a], stop[a], dtype=np.int64) * strides[a])[:, None] + offsets.reshape(1, -1)
    return [(int(o), length) for o in offsets.reshape(-1)]


def _pread_into(fd, buffer: np.ndarray, offset: int, what) -> None:
    view = memoryview(buffer)
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise ValueError(f"{what}: the file ended at byte {offset} while reading it (truncated since it was "
                             "opened?)")
        view, offset = view[n:], offset + n


def _pwrite(fd, buffer: np.ndarray, offset: int) -> None:
    view = memoryview(buffer.reshape(-1).view(np.uint8))
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_file(path, tensors: Mapping, metadata: dict | None = None, float_dtype=None) -> None:
    """Writes a new safetensors file holding `tensors` (name -> numpy or JAX array, Tensor, Reshaped or Derived).

    Arrays are written whole; tiled tensors chunk by chunk, straight from their
    tiles to their place in the file; a Derived is computed when its turn comes. The file is complete only when this
    returns: callers write under a temporary name and rename. With `float_dtype` ("float32" or "bfloat16"), every
    floating tensor is written in that dtype (rounded to nearest even), chunk by chunk.
    """
    entries, position = {}, 0
    for name, value in tensors.items():
        if isinstance(value, Tensor):
            value = Reshaped(value, value.shape)
        elif not isinstance(value, (Reshaped, Derived)):
            value = np.asarray(value, order="C")  # (ascontiguousarray would make scalars 1-d)
        dtype = value.dtype
        if float_dtype is not None and (np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16):
            dtype = np.dtype(float_dtype)
        nbytes = math.prod(value.shape) * dtype.itemsize
        entries[name] = (value, dtype, {"dtype": dtype_code(dtype), "shape": list(value.shape),
                                        "data_offsets": [position, position + nbytes]})
        position += nbytes
    header = {name: entry for name, (_, _, entry) in entries.items()}
    if metadata:
        header = {"__metadata__": metadata, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    data_start = 8 + len(raw)
    lead = not _collective or runtime.rank() == 0
    if lead:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if _collective:  # rank 0 made it empty before anyone writes
        distributed.wait_for_every_rank(f"the creation of {path}")
    if not lead:
        fd = _open_shared(path)
    try:
        if lead:
            _pwrite(fd, np.frombuffer(len(raw).to_bytes(8, "little") + raw, np.uint8), 0)
        for block, runs in _blocks(entries.values(), data_start, lead):
            done = 0
            for offset, length in runs:
                _pwrite(fd, block[done:done + length], offset)
                done += length
            del block  # before the next one is read
    finally:
        os.close(fd)
    if _collective:
        distributed.wait_for_every_rank(f"the writes into {path}")


def _open_shared(path):
    """The file rank 0 created, for another rank's writes; refused where this rank does not see it."""
    try:
        return os.open(path, os.O_WRONLY)  # not created here: its tiles would be written where nobody reads them
    except FileNotFoundError:
        raise ValueError(f"rank {runtime.rank()} does not see {path}, which rank 0 created: with --shard-state every "
                         "rank writes its tiles into the same files, so --out (and --export-hf, --export-lora) must "
                         "name one directory every rank sees, on a shared file system") from None


def _blocks(entries, data_start, lead: bool):
    """(flat array, [(file offset, elements)] of its runs) for the data of `entries` (value, dtype written,
    header entry) this rank writes, in file order: arrays whole, tiled tensors a chunk at a time (in
    `collective_writes`, the tiles of the chunk it owns). Every rank reads all of it: the reads are collective."""
    for value, dtype, entry in entries:
        begin = data_start + entry["data_offsets"][0]
        if isinstance(value, (np.ndarray, Derived)):
            array = np.asarray(value).reshape(-1).astype(dtype, copy=False)
            if lead:
                yield array, [(begin, array.size)]
            continue
        itemsize = dtype.itemsize
        for start, stop, block in _written_parts(value.tensor, lead):
            yield block.reshape(-1).astype(dtype, copy=False), [
                (begin + offset * itemsize, length) for offset, length in _runs(value.tensor.shape, start, stop)]
            del block  # one chunk in memory at a time


def _written_parts(t: Tensor, lead: bool):
    """(start, stop, values) of the blocks of `t` this rank writes, chunk by chunk: each whole chunk on rank 0
    (or one process), or, in `collective_writes` of a sharded `t`, each tile of the chunk this rank owns."""
    owners = distributed.owners(t.handle) if _collective else []
    grid = [-(-n // s) for n, s in zip(t.shape, t.tile_shape)]
    for chunk, block in values_ops.read_chunks(t):
        if not owners:
            if lead:
                yield chunk.start, chunk.stop, block
            continue
        for index in itertools.product(*map(range, chunk.tile_lo, chunk.tile_hi)):
            if owners[int(np.ravel_multi_index(index, grid))] != runtime.rank():
                continue
            start = tuple(i * s for i, s in zip(index, t.tile_shape))
            stop = tuple(min(a + s, n) for a, s, n in zip(start, t.tile_shape, t.shape))
            yield start, stop, np.ascontiguousarray(block[tuple(slice(a - c, b - c) for a, b, c in
                                                                zip(start, stop, chunk.start))])


def checked_parameters(tensors: Mapping, config, source, model: str) -> dict:
    """`tensors` (name -> FileTensor, array or tiled view) if they are exactly `config.param_shapes()`, shaped so
    and floating point, in that order; else ValueError naming the first problem, the tensor and `source`.
    `model` says what holds that many tensors ("a GPT-2 with n_layer=12")."""
    expected = config.param_shapes()
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"tensor {name!r} (expected shape {shape}) is missing from {source}")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ValueError(f"tensor {name!r} has shape {found} in {source}, expected {shape} for {config}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise ValueError(f"unexpected tensor {name!r} with shape {tuple(tensors[name].shape)} in {source} "
                         f"({len(unexpected)} unexpected in all); {model} has only {len(expected)} parameter tensors")
    for name in expected:
        dtype = tensors[name].dtype
        if dtype is None or not np.issubdtype(dtype, np.floating):
            shown = tensors[name].code if isinstance(tensors[name], FileTensor) else dtype
            raise ValueError(f"tensor {name!r} in {source} has dtype {shown}, expected floating point (float32, "
                             "bfloat16 and float16 load)")
    return {name: tensors[name] for name in expected}


def _finite(source: FileTensor | Stacked, block: np.ndarray) -> np.ndarray:
    """`block` of `source`, refused when it holds NaN or infinities: training or sampling from them would
    only produce NaN, far from the file that caused it."""
    if block.dtype.kind == "f" and not np.isfinite(block).all():
        raise ValueError(f"{source} holds NaN or infinite values: the file is damaged, or was written by a run "
                         "that diverged; use another checkpoint")
    return block


def load_into(t: Tensor, source) -> Tensor:
    """Overwrites every tile of `t` from `source` of the same size (any row-major shape): a FileTensor, read
    chunk by chunk, a Stacked of t's shape, read so too, or an array; returns `t` with the token of the write.
    Blocks."""
    if math.prod(np.shape(source)) != t.size:
        raise ValueError(f"{source!r} cannot fill {t!r}: the sizes differ")
    if isinstance(source, (FileTensor, Stacked)):
        return values_ops.write_chunks(t, lambda chunk: _finite(source, source.read(t.shape, chunk.start, chunk.stop)))
    array = np.asarray(source).reshape(t.shape)
    return values_ops.write_chunks(t, lambda chunk: array[chunk.slices])


def write_atomically(path: Path, write) -> None:
    """Calls write(temporary path) and renames the result to `path`: a crash never leaves a half-written file."""
    if _collective:
        _write_atomically_together(path, write)
        return
    # The temporary file lives in the same directory so os.replace is a rename
    # within one file system, which is atomic.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # Temporary files are owner-only; a checkpoint is meant to be shared.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_atomically_together(path: Path, write) -> None:
    """`write_atomically` in `collective_writes`: every rank calls write(the same temporary path), then rank 0
    renames it once every rank has written. A text file is written by every rank alike: the same bytes."""
    tmp = path.parent / f".{path.name}.shared.tmp"
    write(tmp)
    distributed.wait_for_every_rank(f"the writes into {tmp}")
    if runtime.rank() == 0:
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
