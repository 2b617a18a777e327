"""The JSON files jnntile reads beside tensors (a checkpoint's state, a model's config.json, a PEFT adapter's
config, a dataset's meta.json): each must hold one JSON object, and every error names the file."""

from __future__ import annotations

import json
from pathlib import Path


def read_object(file: Path, *, missing: str, damaged: str) -> dict:
    """The JSON object in `file`.

    FileNotFoundError when there is no such file, saying `missing` (what its absence means); ValueError when
    it does not parse or holds something else than an object, saying `damaged` (what to do about it).
    """
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: {missing}")
    try:
        value = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} does not parse as JSON ({e}): {damaged}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a JSON {type(value).__name__}, not an object: {damaged}")
    return value
