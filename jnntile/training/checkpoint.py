"""Training checkpoints: weights, optimizer state, step, data position and RNG state.

A checkpoint is a directory `ckpt-<step>` inside the output directory:

    config.json, model.safetensors   a Hugging Face checkpoint of the model's family (loadable with --init-from-hf)
    optimizer.safetensors            every optimizer-state leaf, in tree order; its metadata "trained" names
                                     the trained parameters
    state.json                       step, data position, RNG seed, model config, run settings and the base

The base is where the run's first weights came from: a Hugging Face directory (its path and
`hf_fingerprint`) or a preset and seed. A LoRA checkpoint's frozen base is built again from it, so a
resume on other weights is refused (jnntile.train).

A run that trains LoRA adapters writes them as a PEFT directory (adapter_config.json,
adapter_model.safetensors; jnntile.lora) in place of config.json and model.safetensors: its frozen base
is where it came from (a Hugging Face directory, or the preset and seed), and resuming builds it again
from there. Parameters frozen otherwise (--freeze, --train-only) stay in model.safetensors, once, without
optimizer state. LoRA checkpoints of the layout before adapters were one per Hugging Face module (a fused
q/k/v or gate/up product's adapter with one A) resume: their optimizer state is converted (`_fused_a_sources`).

It is written under a temporary name and renamed into place, then the file
`latest` (itself replaced atomically) points at it, so an interrupted save never
leaves a checkpoint that looks complete. Older checkpoints beyond `keep` are removed, never the one
just written (which `latest` names).

Tiled tensors stream between their tiles and the files one chunk of tiles at a
time (jnntile.tensorfile), so saving and restoring need no more RAM than the
memory limit and a chunk, whatever the model's size. `restore` checks every
file (JSON, safetensors headers against file sizes, names, shapes, dtypes)
before it overwrites anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jnntile.core import distributed, runtime
from jnntile.io import jsonfile, tensorfile
from jnntile.training import lora
from jnntile.models import families
from jnntile.core.tensor import Tensor

LATEST = "latest"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
# The optimizer file's metadata: the trained parameters' paths, whose state its leaves hold (a JSON list).
TRAINED_KEY = "trained"


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def _leaf_name(i: int) -> str:
    return f"leaf.{i:05d}"


def _optimizer_values(opt_state) -> dict:
    """Optimizer-state leaves in tree order: tiled tensors (moments) as they are, scalars as arrays."""
    leaves = jax.tree.leaves(opt_state, is_leaf=_is_tensor)
    return {_leaf_name(i): (leaf if _is_tensor(leaf) else np.asarray(leaf)) for i, leaf in enumerate(leaves)}


def _trained_names(model, finetune) -> list[str]:
    """The paths of the parameters `finetune` trains ("layers.0.self_attn.qkv_proj.adapters.q_proj.lora_a")."""
    state = nnx.state(model, (finetune or lora.FineTune()).filter())
    return [".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(state)]


def _key_name(key) -> str:
    """One step of a pytree path as a name: a dict key, a sequence index or an attribute."""
    for field in ("key", "idx", "name"):
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def _fused_a_sources(opt_state, model) -> tuple[list, int]:
    """Where each optimizer leaf of `opt_state` was in a LoRA checkpoint written before adapters were one per
    Hugging Face module (before commit d346d3a): a fused product (Llama's q/k/v, gate/up) had one adapter there,
    `qkv_proj.lora_a`, its A shared by the parts and its B over all their rows, where each part now has its own
    (`qkv_proj.adapters.q_proj.lora_a`). Returns ([(old leaf index, index of this leaf's values in it)], the
    number of old leaves): a part's B (and its moments) is its rows of the old B; its A, the shared A whole."""
    fused = {tuple(path.split(".")): module for path, module in lora.adapters(model).items()
             if any(adapter.spec.rows is not None for adapter in module.adapters.values())}
    old_index, sources = {}, []
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_tensor)[0]:
        names, index = tuple(_key_name(k) for k in path), ()
        at, module = next(((i, fused[names[j:i]]) for i, name in enumerate(names) if name == "adapters"
                           for j in range(i) if names[j:i] in fused), (None, None))
        if at is not None:
            part, factor = names[at + 1], names[at + 2]
            rows = module.adapters[part].spec.rows
            if factor == "lora_b" and rows is not None:
                axis = 0 if module.base.weight_out_first else 1  # B is (*out, rank) or (rank, *out)
                index = (slice(None),) * axis + (slice(*rows),)
            names = names[:at] + names[at + 2:]
        # Both layouts flatten in the order of their sorted names, so the old leaves come in the order their
        # names first appear here.
        sources.append((old_index.setdefault(names, len(old_index)), index))
    return sources, len(old_index)


def _differing_leaves(file, saved_leaves, n_leaves: int, model, finetune) -> str:
    """Why `file`'s optimizer values are not this run's: the trained parameters that differ, where it names its
    own (checkpoints written since it does), else the counts."""
    mine = _trained_names(model, finetune)
    if TRAINED_KEY not in saved_leaves.metadata:
        return (f"{file} holds {len(saved_leaves)} optimizer values, this run has {n_leaves} for its {len(mine)} "
                f"trained parameters ({', '.join(mine[:3])}, ...): was it saved with another --optimizer, "
                "--grad-clip, --freeze, --train-only or --lora-targets?")
    theirs = json.loads(saved_leaves.metadata[TRAINED_KEY])
    only_theirs, only_mine = [n for n in theirs if n not in mine], [n for n in mine if n not in theirs]
    if not only_theirs and not only_mine:
        return (f"{file} holds {len(saved_leaves)} optimizer values for the same trained parameters, this run has "
                f"{n_leaves}: was it saved with another --optimizer or --grad-clip?")
    return (f"{file} is the optimizer state of other trained parameters: the checkpoint trained "
            f"{', '.join(only_theirs[:3]) or 'none'} ({len(only_theirs)} in all) that this run does not, this run "
            f"trains {', '.join(only_mine[:3]) or 'none'} ({len(only_mine)} in all) that it did not; give the flags "
            "it was trained with (--freeze, --train-only, --lora-*), or start afresh in another --out")


def save(out_dir: str | os.PathLike, *, model, opt_state, step: int, state: dict, keep: int = 2,
         finetune=None) -> Path:
    """Writes checkpoint `ckpt-<step>` atomically and returns its path. `finetune` (jnntile.lora.FineTune)
    says what trains: with LoRA adapters only they are written, not the base.

    With sharded state (jnntile.distributed.sharding) every rank calls it at the same point and writes the
    tiles it owns into the same files (`tensorfile.collective_writes`), which are those one process writes;
    rank 0 then writes state.json and points `latest` at it, once every rank's tiles are written."""
    out_dir = Path(out_dir)
    final = out_dir / f"ckpt-{step:07d}"
    together = distributed.sharding()
    lead = runtime.rank() == 0 or not together
    if together:  # one name every rank knows; rank 0 makes it empty before anyone writes
        tmp = out_dir / f".{final.name}.tmp-shared"
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        distributed.wait_for_every_rank(f"the creation of {tmp}")
    else:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=out_dir))
    try:
        record = {"step": step, "config": dataclasses.asdict(model.config),
                  "finetune": (finetune or lora.FineTune()).record(), **state}
        with tensorfile.collective_writes():  # each returns once every rank has written its part
            if finetune is not None and finetune.lora is not None:
                lora.save_peft(model, lora.applied_settings(model), tmp)
            else:
                families.save_hf(model, tmp)
            tensorfile.write_file(tmp / OPTIMIZER_FILE, _optimizer_values(opt_state),
                                  metadata={TRAINED_KEY: json.dumps(_trained_names(model, finetune))})
        if not lead:
            return final
        (tmp / STATE_FILE).write_text(json.dumps(record, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as e:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not e.filename:  # a full disk: say where (writes go through descriptors)
            e.filename = str(final)
        raise
    pointer = out_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, out_dir / LATEST)
    # The older ones only: one of a later step is not this run's to remove (nor, when resuming from an older
    # checkpoint, its successor, which the run writes again when it gets there).
    older = [p for p in checkpoints(out_dir) if p.name < final.name]
    for old in older[:len(older) - (keep - 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Every checkpoint directory of `out_dir`, complete or not, oldest first (not the temporaries)."""
    return sorted(p for p in Path(out_dir).glob("ckpt-*") if p.is_dir())


def remove_all(out_dir: str | os.PathLike) -> None:
    """Removes every checkpoint of `out_dir` and `latest` (a run started afresh there)."""
    for path in checkpoints(out_dir):
        shutil.rmtree(path)
    Path(out_dir, LATEST).unlink(missing_ok=True)


# Blocks of each safetensors file's data that hf_fingerprint reads.
_SAMPLED_BLOCKS, _BLOCK_BYTES = 16, 4096


def hf_fingerprint(directory: str | os.PathLike) -> str:
    """A hash of the weights of a Hugging Face checkpoint directory that costs no full read of them.

    It takes each safetensors file's name and size, its header (tensor names, dtypes, shapes, offsets) and 16
    blocks of 4 KiB spread evenly over its data: about 64 KiB a file, where reading a model of many GB whole
    would add minutes to every resume. Headers alone do not tell a model from its fine-tune (one layout, other
    values); the sampled blocks do, as two weight sets trained apart differ in nearly every block.
    """
    digest = hashlib.sha256()
    for file in sorted(Path(directory).glob("*.safetensors")):
        size = file.stat().st_size
        with file.open("rb") as f:
            header = f.read(8)
            data_start = 8 + int.from_bytes(header.ljust(8, b"\0"), "little")
            header += f.read(max(0, min(data_start, size) - 8))
            digest.update(f"{file.name}\0{size}\0".encode() + header)
            span = max(0, size - data_start - _BLOCK_BYTES)
            for i in range(_SAMPLED_BLOCKS):
                f.seek(data_start + span * i // max(1, _SAMPLED_BLOCKS - 1))
                digest.update(f.read(_BLOCK_BYTES))
    return digest.hexdigest()


def _complete(out_dir: Path) -> list[Path]:
    """The complete checkpoints of `out_dir` (those with their state file), oldest first."""
    return sorted(p for p in out_dir.glob("ckpt-*") if (p / STATE_FILE).is_file())


def latest(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points at, or None when `out_dir` holds no checkpoint at all.

    When that checkpoint is incomplete (its state file lost) or `latest` is missing, the newest
    complete checkpoint is taken instead, and stderr says so. ValueError when `out_dir` holds
    checkpoints but none is complete (saying "no checkpoint" there would send the user looking in
    the wrong place).
    """
    out_dir = Path(out_dir)
    pointer = out_dir / LATEST
    named = out_dir / pointer.read_text().strip() if pointer.is_file() else None
    if named is not None and (named / STATE_FILE).is_file():
        return named
    complete = _complete(out_dir)
    if not complete:
        incomplete = named or max(out_dir.glob("ckpt-*"), default=None)
        if incomplete is None:
            return None
        raise ValueError(f"{out_dir} holds no complete checkpoint: {incomplete / STATE_FILE} is missing (lost, or "
                         "its write was cut short); restore it, or train again without --resume")
    why = f"{named / STATE_FILE} is missing" if named is not None else f"{pointer} is missing"
    print(f"note: {why}; using the newest complete checkpoint, {complete[-1]}", file=sys.stderr)
    return complete[-1]


def remove_stale_temporaries(out_dir: str | os.PathLike) -> list[Path]:
    """Removes what checkpoint writes killed mid-way left in `out_dir`; call it while holding the directory's
    lock (`train._prepare_out_dir`), so that no live run is writing them. Returns what was removed."""
    stale = [p for p in Path(out_dir).glob(".ckpt-*.tmp-*") if p.is_dir()]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def read_state(path: str | os.PathLike) -> dict:
    """The record of state.json in checkpoint `path`; ValueError naming the file when it is damaged."""
    file = Path(path) / STATE_FILE
    record = jsonfile.read_object(file, missing=f"{path} is not a complete checkpoint",
                                  damaged=f"the checkpoint is damaged; remove it (and point {LATEST} at an older "
                                          "one) or start afresh")
    for key, kind in (("step", int), ("config", dict)):
        if not isinstance(record.get(key), kind):
            raise ValueError(f"{file} lacks {key!r} (or it is not a{'n integer' if kind is int else ' JSON object'}): "
                             "the checkpoint is damaged")
    return record


def _resolved_targets(finetune: dict, model) -> dict:
    """A FineTune record with its LoRA targets resolved for `model`'s family (every projection for none, in the
    family's order): the same adapters, named in another order or with the defaults spelled out, compare equal."""
    settings = finetune.get("lora")
    if not settings:
        return finetune
    targets = settings["targets"] if isinstance(settings["targets"], str) else tuple(settings["targets"]) or None
    resolved = lora.LoRASettings(settings["rank"], settings["alpha"], targets).resolved(model)
    return {**finetune, "lora": {**settings, "targets": lora._targets_record(resolved.targets)}}


def restore(path: str | os.PathLike, *, model, opt_state, finetune=None):
    """Loads weights into `model` and returns (opt_state with the saved values, state dict).

    `finetune` (jnntile.lora.FineTune) must be what the checkpoint was trained with; under LoRA the model's
    base is built already and only the adapters are loaded.

    `opt_state` is a freshly initialised state of the same optimizer; a checkpoint
    of another model or optimizer, or a damaged one, raises ValueError naming
    the file and what differs, before any tile is overwritten.
    """
    path = Path(path)
    record = read_state(path)
    mine = json.loads(json.dumps(dataclasses.asdict(model.config)))  # as state.json holds it (tuples are lists)
    saved = record["config"]
    execution = model.config.execution_field_names()  # tiles and recomputation may change between runs
    differing = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v and k not in execution}
    if differing:
        raise ValueError(f"checkpoint {path} is of another model: (saved, requested) differ in {differing}")
    wanted = _resolved_targets((finetune or lora.FineTune()).record(), model)
    saved_finetune = _resolved_targets(record.get("finetune", lora.FineTune().record()), model)
    if saved_finetune != wanted:
        raise ValueError(f"checkpoint {path} trained {saved_finetune}, this run asks for {wanted} "
                         "(--freeze, --train-only, --lora-*): give the same, or start afresh in another --out")
    adapters_only = finetune is not None and finetune.lora is not None
    params = {}
    if not adapters_only:
        _, params = families.open_hf(path)
    for name, value in params.items():
        if value.code != "F32":  # anything else would not resume bit-identically
            raise ValueError(f"{value.path}: tensor {name!r} is {value.code}, a training checkpoint holds F32")

    file = path / OPTIMIZER_FILE
    saved_leaves = tensorfile.SafetensorsFile(file)
    leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_is_tensor)
    sources = [(i, ()) for i in range(len(leaves))]
    if len(saved_leaves) != len(leaves):
        fused_a, n_old = _fused_a_sources(opt_state, model) if adapters_only else (sources, len(leaves))
        if n_old != len(saved_leaves) or TRAINED_KEY in saved_leaves.metadata:  # that layout predates the names
            raise ValueError(_differing_leaves(file, saved_leaves, len(leaves), model, finetune))
        # The shared A's value and moments go to each part's A: the state the shared A had, from which each part
        # continues, so training goes on from the same point while the parts' A's now diverge.
        sources = fused_a
    for leaf, (i, index) in zip(leaves, sources):
        name = _leaf_name(i)
        if name not in saved_leaves:
            raise ValueError(f"{file} lacks the optimizer value {name!r}: the checkpoint is damaged")
        value, dtype = saved_leaves[name], np.dtype(leaf.dtype)
        if np.broadcast_to(0, value.shape)[index].shape != tuple(leaf.shape) or value.dtype != dtype:
            raise ValueError(f"{file}: optimizer value {name!r} is {value.code} {value.shape}, expected "
                             f"{tensorfile.dtype_code(dtype)} {tuple(leaf.shape)}")

    if adapters_only:
        lora.load_peft(model, path)
    else:  # quantized frozen weights were built from the base, as they were at the start (rebuilds_base)
        model.load_hf_params(params, keep_quantized=True)

    def saved_value(i, index):  # an old fused A's part is read whole and cut (adapters are small); the rest streams
        saved = saved_leaves[_leaf_name(i)]
        return saved.read()[index] if index else saved

    restored = [tensorfile.load_into(leaf, saved_value(*source)) if _is_tensor(leaf) else
                jnp.asarray(saved_value(*source).read(), leaf.dtype) for leaf, source in zip(leaves, sources)]
    return jax.tree.unflatten(treedef, restored), record
