"""A training run's output directory (--out): its lock, the checkpoints and metrics it holds, and the exports the
run writes elsewhere (each marked, so that only the run that wrote one replaces it)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

from jnntile.training import checkpoint


LOCK_FILE = ".lock"


def lock(path: Path):
    """Creates --out and locks it for this run; returns the open lock file (held until it is closed).

    Two runs writing one directory would interleave their metrics and replace each other's
    checkpoints. The lock is advisory (flock): the system drops it when the process ends, however it
    ends, so a crashed run leaves no stale lock behind.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = open(path / LOCK_FILE, "a+")
    except OSError as e:
        raise ValueError(f"output directory {path} is not writable ({e.strerror}); choose another --out") from e
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ValueError(f"output directory {path} is in use by another training run (PID {holder}); wait for it "
                         "to finish, or choose another --out") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


EXPORT_MARK = "jnntile-export.json"  # in every export: {"run": the --out that wrote it, "step": its step}
# What an --export-hf folder takes from the base beside the weights, where the base has it, so that
# transformers and `generate --hf` load the export as a whole model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def check_outputs(out: Path, *, resume: bool, overwrite: bool, exports: dict, sources: dict) -> None:
    """Refuses, before anything runs, outputs that would mix two runs or that cannot be written.

    A fresh run in an --out holding another run's checkpoints would interleave with them: the rotation would
    remove the newer run's, whose `latest` then named a removed one. An export may not land on the weights the
    run starts from, nor among files that are not an earlier export of this --out, nor where no folder can be.
    `exports` and `sources` map a flag (--export-hf; --init-from-hf) to the folder it names, or None.
    """
    found = checkpoint.checkpoints(out)
    if found and not resume and not overwrite:
        raise ValueError(f"{out} holds the checkpoints of another run (the last: {found[-1].name}): continue it with "
                         "--resume, start afresh with --overwrite (which removes its checkpoints, metrics.jsonl and "
                         "loss.png), or choose another --out")
    for flag, directory in exports.items():
        if not directory:
            continue
        path = Path(directory)
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"{flag} {path}: {'it is a file' if existing == path else f'{existing} is a file'}, "
                             "where the export needs a folder; choose another")
        for source_flag, source in sources.items():
            if source and path.exists() and path.resolve() == Path(source).resolve():
                raise ValueError(f"{flag} {path} is the {source_flag} folder: the export would replace the weights "
                                 "this run starts from; choose another folder")
        if path.exists() and any(path.iterdir()) and exported_by(path) != str(out.resolve()):
            raise ValueError(f"{flag} {path} holds files that are not an earlier export of this run's --out (no "
                             f"{EXPORT_MARK} naming {out}): the export would mix with them or replace them; choose "
                             "a new or empty folder")


def exported_by(directory: Path) -> str | None:
    """The --out (resolved) of the run whose export `directory` is, or None for anything else."""
    try:
        return json.loads((directory / EXPORT_MARK).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def export(directory, out: Path, step: int, write, copy_from: Path | None = None) -> None:
    """Writes an export into `directory` (created): its mark first, so that a later export of this run may
    replace even one cut short, then `write(directory)`, then the TOKENIZER_FILES that `copy_from` has."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / EXPORT_MARK).write_text(json.dumps({"run": str(out.resolve()), "step": step}) + "\n")
    write(directory)
    for name in TOKENIZER_FILES if copy_from is not None else ():
        if (copy_from / name).is_file():
            shutil.copyfile(copy_from / name, directory / name)


def remove_run(out: Path) -> None:
    """Removes what an earlier run left in --out: checkpoints, metrics and plot."""
    checkpoint.remove_all(out)
    for name in ("metrics.jsonl", "loss.png"):
        (out / name).unlink(missing_ok=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Keeps the metrics of steps before `step` (a resumed run rewrites the rest).

    A line that does not parse (what a kill in the middle of its write leaves, always the last) is
    dropped with a warning: the resumed run writes that step again.
    """
    if not path.exists():
        return
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            print(f"warning: dropped line {number} of {path}, which is cut short: {line[:60]!r}", file=sys.stderr)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
            rows.append(line)
    path.write_text("".join(r + "\n" for r in rows))


def standing_checkpoint(out: Path) -> str:
    """What a run that failed mid-step leaves to continue from."""
    latest = checkpoint.latest(out)
    if latest is None:
        return f"{out} holds no checkpoint, so the run starts over"
    return f"{latest} (step {checkpoint.read_state(latest)['step']}) stands; continue from it with --resume"
