"""Training checkpoints: weights, optimizer state, step, data position and RNG state.

A checkpoint is a directory `ckpt-<step>` inside the output directory:

    config.json, model.safetensors   a Hugging Face GPT-2 checkpoint (loadable with --init-from-hf)
    optimizer.safetensors            every optimizer-state leaf, in tree order
    state.json                       step, data position, RNG seed, model config and run settings

It is written under a temporary name and renamed into place, then the file
`latest` (itself replaced atomically) points at it, so an interrupted save never
leaves a checkpoint that looks complete. Older checkpoints beyond `keep` are removed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from jnntile.ops import data as data_ops
from jnntile.tensor import Tensor

LATEST = "latest"


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def _optimizer_arrays(opt_state) -> dict[str, np.ndarray]:
    leaves = jax.tree.leaves(opt_state, is_leaf=_is_tensor)
    return {f"leaf.{i:05d}": (leaf.numpy() if _is_tensor(leaf) else np.asarray(leaf)) for i, leaf in enumerate(leaves)}


def save(out_dir: str | os.PathLike, *, model, opt_state, step: int, state: dict, keep: int = 2) -> Path:
    """Writes checkpoint `ckpt-<step>` atomically and returns its path."""
    from jnntile.models.gpt2 import save_hf

    out_dir = Path(out_dir)
    final = out_dir / f"ckpt-{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=out_dir))
    try:
        save_hf(model, tmp)
        safetensors.numpy.save_file(_optimizer_arrays(opt_state), tmp / "optimizer.safetensors")
        record = {"step": step, "config": dataclasses.asdict(model.config), **state}
        (tmp / "state.json").write_text(json.dumps(record, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = out_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, out_dir / LATEST)
    checkpoints = sorted(p for p in out_dir.glob("ckpt-*") if p.is_dir() and ".tmp-" not in p.name)
    for old in checkpoints[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of `out_dir`, or None."""
    pointer = Path(out_dir) / LATEST
    if not pointer.exists():
        return None
    path = Path(out_dir) / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def read_state(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / "state.json").read_text())


def restore(path: str | os.PathLike, *, model, opt_state):
    """Loads weights into `model` and returns (opt_state with the saved values, state dict).

    `opt_state` is a freshly initialised state of the same optimizer; a checkpoint
    of another model or optimizer raises ValueError naming what differs.
    """
    from jnntile.models.hf_checkpoint import load_hf

    path = Path(path)
    record = read_state(path)
    mine = dataclasses.asdict(model.config)
    saved = record["config"]
    differing = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v and not k.startswith("tile_")}
    if differing:
        raise ValueError(f"checkpoint {path} is of another model: (saved, requested) differ in {differing}")
    _, params = load_hf(path)
    model.load_hf_params(params)

    arrays = safetensors.numpy.load_file(path / "optimizer.safetensors")
    leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_is_tensor)
    if len(arrays) != len(leaves):
        raise ValueError(f"checkpoint {path} holds {len(arrays)} optimizer values, this optimizer has "
                         f"{len(leaves)}: was it saved with another --optimizer or --grad-clip?")
    restored = []
    for i, leaf in enumerate(leaves):
        value = arrays[f"leaf.{i:05d}"]
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(f"checkpoint {path}: optimizer value {i} has shape {value.shape}, expected {leaf.shape}")
        restored.append(data_ops.write(leaf, value) if _is_tensor(leaf) else jnp.asarray(value, leaf.dtype))
    return jax.tree.unflatten(treedef, restored), record
