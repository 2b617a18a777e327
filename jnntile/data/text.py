"""Text datasets (documents trained on every token): preparation, the built-in corpus, and batching.

A prepared dataset is a directory in the layout nanoGPT uses, plus two small
JSON files::

    train.bin       token ids, raw little-endian uint16 (uint32 for a vocabulary
                    of more than 65536 tokens), no header
    val.bin         the same for the validation split
    tokenizer.json  a byte-level BPE tokenizer trained on the data, or a model's
                    own (``--tokenizer DIR``: a Hugging Face checkpoint's)
    meta.json       vocab_size, the token ``dtype``, token counts, source
                    description, val fraction, the end-of-text id, the
                    tokenizer's fingerprint (``tokenizer_fingerprint``)

The token stream is every document's tokens followed by the end-of-text token
(``<|endoftext|>`` of a trained tokenizer; a model's tokenizer's eos token, or
nothing when it has none), in file order. The validation split is the last
``val_fraction`` of that stream (at least one token in each split).

Built-in corpus
---------------
Training needs real text, but the project should run without downloads. The
Python standard library's own ``.py`` sources are real text present wherever
Python is installed, so they are the default corpus: all ``*.py`` files under
``sysconfig.get_paths()["stdlib"]``, skipping ``test``/``tests`` (this also
drops lib2to3's deliberately broken test data), ``idlelib`` and
``site-packages`` directories, read in sorted relative-path order and capped at
``DEFAULT_STDLIB_MAX_BYTES`` bytes. The result depends only on the Python
version, so the prepared dataset is cached per version and vocabulary size
(see ``default_dataset_dir``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from tqdm import tqdm

from jnntile.io import jsonfile

END_OF_TEXT = "<|endoftext|>"
# Token ids are stored as uint16, as nanoGPT's files, where the vocabulary allows; a pretrained tokenizer of
# more than 65536 tokens (Llama 3, Qwen2) gets uint32 files, which meta.json's "dtype" names.
TOKEN_DTYPE = np.uint16
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# uint16 holds ids 0..65535, so at most 65536 distinct tokens.
MAX_VOCAB_SIZE = int(np.iinfo(TOKEN_DTYPE).max) + 1
# Byte-level BPE always contains the 256 byte tokens, plus our special token.
MIN_VOCAB_SIZE = 256 + 1
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_GLOB = "*.txt"
# About 8 MB of source (~2.3M tokens): big enough to train a small GPT-2 on,
# small enough to tokenize in seconds on two cores.
DEFAULT_STDLIB_MAX_BYTES = 8_000_000
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})

TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
# meta.json's "kind" of a dataset of examples with loss masks (jnntile.data.examples); text datasets have none.
EXAMPLES_KIND = "examples"

BATCH_ORDERS = ("sequential", "random")
# Documents tokenized per call, so the progress bar moves while the
# tokenizer still batches work across threads.
_ENCODE_CHUNK_DOCS = 64


# --------------------------------------------------------------------------
# Source selection
# --------------------------------------------------------------------------


def find_text_files(source: str | os.PathLike, glob: str = DEFAULT_GLOB) -> list[Path]:
    """The files to read from `source`: the file itself, or a folder's files matching `glob`.

    Folders are searched recursively; the result is in sorted path order.
    """
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"input path {source} does not exist; give an existing text file or folder")
    if source.is_file():
        return [source]
    files = sorted(path for path in source.rglob(glob) if path.is_file())
    if not files:
        raise ValueError(
            f"folder {source} has no files matching {glob!r} (searched recursively); "
            f"add text files or pass a different glob (--glob)"
        )
    return files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files() -> list[Path]:
    """All `.py` files of the standard library, minus test/idle/site-packages, in sorted order."""
    root = stdlib_root()
    files = []
    for folder, subfolders, file_names in os.walk(root):
        # Prune in place so os.walk never descends into excluded trees
        # (site-packages alone can be far larger than the stdlib).
        subfolders[:] = [name for name in subfolders if name not in STDLIB_EXCLUDED_DIRS]
        files.extend(Path(folder, name) for name in file_names if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def stdlib_source_description(max_bytes: int) -> str:
    return (
        f"Python {platform.python_version()} standard library .py sources under {stdlib_root()} "
        f"(sorted, excluding {'/'.join(sorted(STDLIB_EXCLUDED_DIRS))} dirs), first {max_bytes} bytes"
    )


def read_documents(files: Sequence[Path], max_bytes: int | None = None) -> list[str]:
    """Read `files` in order as UTF-8 documents, stopping after `max_bytes` bytes in total.

    The last document read may be cut short to honour the cap. Undecodable
    bytes become U+FFFD rather than failing a whole corpus over one file.
    """
    documents = []
    bytes_left = max_bytes
    for path in files:
        content = path.read_bytes()
        if bytes_left is not None:
            content = content[:bytes_left]
            bytes_left -= len(content)
        if content:
            documents.append(content.decode("utf-8", errors="replace"))
        if bytes_left == 0:
            break
    return documents


# --------------------------------------------------------------------------
# Preparation
# --------------------------------------------------------------------------


def _check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is out of range: byte-level BPE needs at least {MIN_VOCAB_SIZE} "
            f"(256 bytes + {END_OF_TEXT}), and token ids are stored as uint16, which holds at most "
            f"{MAX_VOCAB_SIZE} tokens (ids 0..{MAX_VOCAB_SIZE - 1}); choose --vocab-size in "
            f"[{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]"
        )


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be strictly between 0 and 1 (e.g. 0.1)")


def _check_max_bytes(max_bytes: int | None) -> None:
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes} must be positive (or None to read everything)")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory; give a new directory (or a dataset's, to "
                         "replace it)")


def _write_dataset(out_dir: Path, writers: dict[str, Callable[[Path], None]]) -> None:
    """Writes each file of `writers` (name: function writing it to a path) under a temporary name in `out_dir`,
    then renames them all, meta.json last.

    A write that fails (a full or read-only disk) leaves no file behind, only the dataset that was there,
    and the folders this call created are removed again; an interrupted run leaves at most hidden
    `.name.*.tmp` files. Failures are ValueErrors naming --out.
    """
    created = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]
    temporaries = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, write in writers.items():
            handle, temporary = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
            os.close(handle)
            temporaries.append(Path(temporary))
            write(temporaries[-1])
    except BaseException as error:
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)
        for folder in created:  # innermost first; each one is empty again (or was never made)
            if folder.is_dir():
                folder.rmdir()
        if isinstance(error, OSError):
            raise ValueError(f"--out {out_dir}: cannot write the dataset there ({error.strerror or error}; no file "
                             "was left): free space there, or choose another --out") from error
        raise
    # meta.json marks a complete dataset: a stale one goes first, so that a run stopped between these renames
    # is not mistaken for complete.
    (out_dir / META_FILE).unlink(missing_ok=True)
    for name, temporary in zip(writers, temporaries):
        os.replace(temporary, out_dir / name)


def _save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    try:
        tokenizer.save(str(path))
    except Exception as error:  # the Rust side raises a bare Exception, for a full disk too
        raise OSError(str(error)) from None


def _train_tokenizer(documents: list[str], vocab_size: int, progress: bool) -> ByteLevelBPETokenizer:
    # The trainer's own progress bar (Rust) writes to stdout, where only a command's output belongs
    # (bench --json output is parsed line by line): tqdm shows progress on stderr instead.
    tokenizer = ByteLevelBPETokenizer()
    with tqdm(total=1, unit="tokenizer", desc=f"training a BPE tokenizer of {vocab_size} tokens",
              disable=not progress) as bar:
        tokenizer.train_from_iterator(
            documents,
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            show_progress=False,
            length=len(documents),
        )
        bar.update(1)
    return tokenizer


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A SHA-256 of what gives token ids their meaning: the vocabulary (added tokens included) and the merges.

    Taken in a canonical form (the vocabulary sorted by id, each merge a pair), so that one tokenizer read
    from any path, or written by another version of `tokenizers` (merges as "a b" or as ["a", "b"]), gives
    one fingerprint.
    """
    merges = json.loads(tokenizer.to_str())["model"].get("merges") or []
    canonical = {
        "vocab": sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: (item[1], item[0])),
        "merges": [merge.split(" ", 1) if isinstance(merge, str) else list(merge) for merge in merges],
    }
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False).encode()).hexdigest()


def token_dtype(vocab_size: int):
    """uint16 where the vocabulary fits (nanoGPT's files), else uint32."""
    return np.uint16 if vocab_size <= MAX_VOCAB_SIZE else np.uint32


def _tokenize(tokenizer: Tokenizer, documents: list[str], end_of_text: int | None, progress: bool) -> np.ndarray:
    """The token stream: each document's ids followed by the end-of-text id (when the tokenizer has one)."""
    dtype = token_dtype(tokenizer.get_vocab_size())
    pieces = []
    with tqdm(total=len(documents), unit="doc", desc="tokenizing", disable=not progress) as bar:
        for start in range(0, len(documents), _ENCODE_CHUNK_DOCS):
            chunk = documents[start : start + _ENCODE_CHUNK_DOCS]
            for encoding in tokenizer.encode_batch(chunk):
                pieces.append(np.asarray(encoding.ids, dtype=dtype))
                if end_of_text is not None:
                    pieces.append(np.asarray([end_of_text], dtype=dtype))
            bar.update(len(chunk))
    return np.concatenate(pieces)


def load_pretrained_tokenizer(directory: str | os.PathLike) -> tuple[Tokenizer, int | None]:
    """(tokenizer, end-of-text id or None) of a model directory's tokenizer.json (a Hugging Face checkpoint's:
    Llama 3, SmolLM, Qwen2 byte-level BPE, Llama 2's SentencePiece-derived files). The end of a document is
    tokenizer_config.json's eos_token, else config.json's eos_token_id, else none."""
    directory = Path(directory)
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {directory}: no {TOKENIZER_FILE} there (a Hugging Face model "
                                "directory holds one)")
    tokenizer = _read_tokenizer(path)
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        try:
            value = json.loads((directory / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            value = tokenizer.token_to_id(value)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < tokenizer.get_vocab_size():
            return tokenizer, value
    return tokenizer, None


def _prepare_documents(
    documents: list[str],
    out_dir: Path,
    *,
    source_description: str,
    max_bytes: int | None,
    vocab_size: int,
    val_fraction: float,
    progress: bool,
    pretrained: tuple[Tokenizer, int | None] | None = None,
) -> Path:
    if pretrained is None:
        tokenizer = _train_tokenizer(documents, vocab_size, progress)
        end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    else:
        tokenizer, end_of_text = pretrained
    tokens = _tokenize(tokenizer, documents, end_of_text, progress)
    val_tokens = min(max(1, int(len(tokens) * val_fraction)), len(tokens) - 1)
    train_tokens = len(tokens) - val_tokens

    meta = {
        # The trained size can fall short of the request on a small corpus.
        "vocab_size": tokenizer.get_vocab_size(),
        "requested_vocab_size": vocab_size,
        "train_tokens": int(train_tokens),
        "val_tokens": int(val_tokens),
        "source": source_description,
        "documents": len(documents),
        "max_bytes": max_bytes,
        "val_fraction": val_fraction,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "end_of_text_id": end_of_text,
        "dtype": tokens.dtype.name,
    }
    _write_dataset(out_dir, {
        TRAIN_FILE: tokens[:train_tokens].tofile,
        VAL_FILE: tokens[train_tokens:].tofile,
        TOKENIZER_FILE: lambda path: _save_tokenizer(tokenizer, path),
        META_FILE: lambda path: path.write_text(json.dumps(meta, indent=2) + "\n"),
    })
    return out_dir


def _text_only(source: Path, files: list[Path], glob: str) -> list[Path]:
    """`files` less those that are not text (an image, a token file: they would tokenize into garbage without
    an error). A file given as INPUT is refused; a folder's are skipped with a note on stderr, and refused if
    none is text."""
    binary = [path for path in files if not _looks_like_text(path)]
    if source.is_file() and binary:
        raise ValueError(f"input file {source} is not text (it holds NUL or other control bytes); give a UTF-8 "
                         "text file")
    if binary and len(binary) == len(files):
        raise ValueError(f"none of the {len(files)} files matching {glob!r} in {source} is text (each holds NUL or "
                         f"other control bytes), e.g. {binary[0]}; pick text files with --glob")
    if binary:
        shown = ", ".join(str(path) for path in binary[:5]) + (", ..." if len(binary) > 5 else "")
        print(f"note: skipped {len(binary)} of the {len(files)} files matching {glob!r} in {source}, which are "
              f"not text (NUL or other control bytes): {shown}", file=sys.stderr)
    skipped = set(binary)
    return [path for path in files if path not in skipped]


def prepare_dataset(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    glob: str = DEFAULT_GLOB,
    max_bytes: int | None = None,
    progress: bool = True,
    tokenizer: str | os.PathLike | None = None,
) -> Path:
    """Tokenize a text file, or a folder's files matching `glob`, into a dataset in `out_dir`.

    Each file is one document. `max_bytes` caps how much source text is read.
    `tokenizer`, a model directory, gives a pretrained tokenizer (its tokenizer.json) instead of
    training a BPE of `vocab_size` tokens. Returns `out_dir`.
    """
    pretrained = None if tokenizer is None else load_pretrained_tokenizer(tokenizer)
    if pretrained is None:
        _check_vocab_size(vocab_size)
    _check_val_fraction(val_fraction)
    _check_max_bytes(max_bytes)
    _check_out_dir(Path(out_dir))
    source = Path(source)
    files = _text_only(source, find_text_files(source, glob), glob)
    documents = read_documents(files, max_bytes)
    if not documents:
        what = f"file {source} is" if source.is_file() else f"all {len(files)} files matching {glob!r} in {source} are"
        raise ValueError(f"{what} empty (0 bytes); give input that contains text")
    description = str(source) if source.is_file() else f"{source} ({glob!r}, recursive)"
    return _prepare_documents(
        documents,
        Path(out_dir),
        source_description=description,
        max_bytes=max_bytes,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        progress=progress,
        pretrained=pretrained,
    )


def prepare_stdlib_dataset(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_bytes: int = DEFAULT_STDLIB_MAX_BYTES,
    progress: bool = True,
) -> Path:
    """Prepare the built-in corpus (see the module docstring) into `out_dir`."""
    _check_vocab_size(vocab_size)
    _check_val_fraction(val_fraction)
    _check_max_bytes(max_bytes)
    _check_out_dir(Path(out_dir))
    documents = read_documents(stdlib_source_files(), max_bytes)
    return _prepare_documents(
        documents,
        Path(out_dir),
        source_description=stdlib_source_description(max_bytes),
        max_bytes=max_bytes,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        progress=progress,
    )


def default_dataset_dir(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Where the built-in dataset lives: `$JNNTILE_DATA_DIR` if set (used as is), else
    `~/.cache/jnntile/data/stdlib-<python version>-v<vocab_size>`."""
    override = os.environ.get("JNNTILE_DATA_DIR")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "jnntile" / "data" / f"stdlib-{platform.python_version()}-v{vocab_size}"


def _is_prepared(out_dir: Path, expected: dict) -> bool:
    """Whether `out_dir` holds a complete dataset whose meta.json matches `expected`."""
    try:
        meta = json.loads((out_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    if any(meta.get(key) != value for key, value in expected.items()):
        return False
    itemsize = np.dtype(TOKEN_DTYPES.get(meta.get("dtype"), TOKEN_DTYPE)).itemsize
    sizes_match = [
        (out_dir / TRAIN_FILE, meta.get("train_tokens", -1) * itemsize),
        (out_dir / VAL_FILE, meta.get("val_tokens", -1) * itemsize),
    ]
    return (out_dir / TOKENIZER_FILE).is_file() and all(
        path.is_file() and path.stat().st_size == size for path, size in sizes_match
    )


def ensure_default_dataset(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    max_bytes: int = DEFAULT_STDLIB_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    out_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> Path:
    """The built-in dataset's directory, preparing it first unless a matching one is there."""
    out_dir = Path(out_dir) if out_dir is not None else default_dataset_dir(vocab_size)
    expected = {
        "requested_vocab_size": vocab_size,
        "source": stdlib_source_description(max_bytes),
        "val_fraction": val_fraction,
    }
    if not _is_prepared(out_dir, expected):
        prepare_stdlib_dataset(
            out_dir, vocab_size=vocab_size, val_fraction=val_fraction, max_bytes=max_bytes, progress=progress
        )
    return out_dir


# --------------------------------------------------------------------------
# Loading and batching
# --------------------------------------------------------------------------


# How much of a file `_looks_like_text` reads.
_TEXT_SNIFF_BYTES = 1 << 16


def _looks_like_text(path: Path) -> bool:
    """Whether the start of `path` is text: no NUL and hardly any other control bytes.

    Read as uint16 token ids, text would train on garbage without any error, and
    a binary file tokenized as text would too. A token file is full of such
    bytes: every id below 8192 (the most frequent tokens of any BPE vocabulary)
    has a high byte of 0..31.
    """
    with open(path, "rb") as f:
        head = f.read(_TEXT_SNIFF_BYTES)
    controls = sum(1 for byte in head if byte < 32 and byte not in b"\t\n\r\f")
    return b"\x00" not in head and controls <= len(head) // 100


# Token ids checked against the vocabulary per step when a file is opened (8 MB of uint16 at a time).
_ID_CHECK_CHUNK = 1 << 22


def _read_tokenizer(tokenizer_path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # the Rust side raises a bare Exception
        raise ValueError(f"{tokenizer_path} is not a tokenizers file ({error}); put the tokenizer.json that made "
                         "the token file there, or remove it to train on ids alone") from None


def _read_meta(meta_path: Path) -> dict:
    return jsonfile.read_object(meta_path, missing="it describes the token file beside it",
                                damaged="prepare the dataset again with `python -m jnntile.data`, or remove the file")


def check_batch_args(step: int, batch_size: int, seq_len: int, order: str) -> None:
    """Refuses what no batch can be drawn with (both kinds of dataset)."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer")
    if order not in BATCH_ORDERS:
        raise ValueError(f"order={order!r} is not one of {', '.join(map(repr, BATCH_ORDERS))}")


class TokenDataset:
    """A uint16 token file (memory-mapped) and, if one is beside it, its tokenizer.

    `path` is a `.bin` file or a dataset directory (meaning its `train.bin`).
    `tokenizer.json` and `meta.json` beside the file are optional, so a bare
    nanoGPT `.bin` loads too; then `tokenizer` is None and `decode` shows ids.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if path.is_dir():
            path = path / TRAIN_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"token file {path} does not exist; prepare one with `python -m jnntile.data` "
                f"or pass the path of a .bin file"
            )
        meta_path = path.parent / META_FILE
        self.meta = _read_meta(meta_path) if meta_path.is_file() else {}
        if self.meta.get("kind") == EXAMPLES_KIND and type(self) is TokenDataset:
            raise ValueError(f"{path.parent} holds fine-tuning examples (meta.json's kind is {EXAMPLES_KIND!r}), whose "
                             "tokens train only where their loss mask says; open it with data.open_dataset or "
                             "data.ExampleDataset")
        dtype_name = self.meta.get("dtype", "uint16")
        if dtype_name not in TOKEN_DTYPES:
            raise ValueError(f"{meta_path} gives dtype={dtype_name!r}; token files are {' or '.join(TOKEN_DTYPES)}; "
                             "prepare the dataset again with `python -m jnntile.data`")
        dtype = np.dtype(TOKEN_DTYPES[dtype_name])
        itemsize = dtype.itemsize
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"token file {path} is empty (0 bytes); prepare it again with `python -m jnntile.data`")
        if _looks_like_text(path):
            raise ValueError(
                f"{path} looks like text, not a token file (raw uint16 token ids): tokenize it first with "
                f"`python -m jnntile.data {path} --out DIR`, then pass the directory DIR (or DIR/{TRAIN_FILE})"
            )
        if size % itemsize:
            raise ValueError(
                f"token file {path} has {size} bytes, not a multiple of {itemsize}: it is not a raw {dtype_name} "
                f"token file or was cut short; prepare it again with `python -m jnntile.data`"
            )
        self.path = path
        self.tokens = np.memmap(path, dtype=dtype, mode="r")

        tokenizer_path = path.parent / TOKENIZER_FILE
        self.tokenizer = _read_tokenizer(tokenizer_path) if tokenizer_path.is_file() else None

        if "vocab_size" in self.meta:
            self.vocab_size = self.meta["vocab_size"]
            if type(self.vocab_size) is not int or self.vocab_size <= 0:  # bool is an int subclass: refused too
                raise ValueError(f"{meta_path} gives vocab_size={self.vocab_size!r}, not a positive integer; "
                                 "prepare the dataset again with `python -m jnntile.data`")
        elif self.tokenizer is not None:
            self.vocab_size = self.tokenizer.get_vocab_size()
        else:  # a bare file: the vocabulary must hold its ids and those of the validation file beside it
            validation = self.validation()
            self.vocab_size = max(int(self.tokens.max()) + 1, validation.vocab_size if validation else 0)
        if self.vocab_size > np.iinfo(dtype).max + 1:
            raise ValueError(
                f"{meta_path if 'vocab_size' in self.meta else tokenizer_path} gives vocab_size="
                f"{self.vocab_size}, but {dtype_name} token files hold at most {np.iinfo(dtype).max + 1} tokens; "
                f"prepare the dataset again with --vocab-size <= {MAX_VOCAB_SIZE}"
            )
        if "vocab_size" in self.meta or self.tokenizer is not None:
            self._check_ids_below_vocab(meta_path if "vocab_size" in self.meta else tokenizer_path)

    def _check_ids_below_vocab(self, vocab_source: Path) -> None:
        """Refuses ids at or beyond the vocabulary: the embedding would read rows that do not exist."""
        for start in range(0, len(self.tokens), _ID_CHECK_CHUNK):
            chunk = self.tokens[start : start + _ID_CHECK_CHUNK]
            bad = np.flatnonzero(chunk >= self.vocab_size)
            if bad.size:
                position = start + int(bad[0])
                raise ValueError(
                    f"{self.path} holds token id {int(self.tokens[position])} at position {position} (the first "
                    f"of {self.vocab_size} or more), but {vocab_source} gives a vocabulary of {self.vocab_size}: "
                    "the file was made by another tokenizer; prepare it again with `python -m jnntile.data`, or "
                    "put the meta.json and tokenizer.json that made it beside it"
                )

    def __len__(self) -> int:
        return len(self.tokens)

    def tokenizer_fingerprint(self) -> str | None:
        """`tokenizer_fingerprint` of the tokenizer that made the file: meta.json's, else computed from the
        tokenizer.json beside it (a dataset prepared before meta.json recorded it); None without either."""
        recorded = self.meta.get("tokenizer_sha256")
        if isinstance(recorded, str):
            return recorded
        return None if self.tokenizer is None else tokenizer_fingerprint(self.tokenizer)

    def validation(self) -> TokenDataset | None:
        """The `val.bin` beside this file, if there is one (and this is not it)."""
        val_path = self.path.parent / VAL_FILE
        if self.path.name == VAL_FILE or not val_path.is_file():
            return None
        return TokenDataset(val_path)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"no {TOKENIZER_FILE} beside {self.path}, so text cannot be encoded; "
                f"put the tokenizer that made this file there"
            )
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text for `ids`, or without a tokenizer the ids themselves as "[12, 7, ...]"."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        if self.tokenizer is None:
            return str(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def batch(
        self, step: int, batch_size: int, seq_len: int, order: str = "sequential", seed: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and next-token targets for training step `step`, both int32 (batch_size, seq_len).

        order="sequential": sequence j of step i starts at token (i*batch_size + j) * seq_len
        and spans seq_len + 1 tokens (inputs are its first seq_len, targets its last
        seq_len). The sequence index wraps around modulo the number of whole sequences
        that fit, (len(self) - 1) // seq_len, so steps past the end start a new epoch.

        order="random": start offsets are drawn uniformly from a numpy Generator seeded
        with (seed, step), so the batch for a step is the same in every run, which
        makes resumed runs see exactly the batches they would have seen.
        """
        check_batch_args(step, batch_size, seq_len, order)

        needed = batch_size * seq_len + 1 if order == "sequential" else seq_len + 1
        if len(self) < needed:
            rule = "batch_size*seq_len+1" if order == "sequential" else "seq_len+1"
            raise ValueError(
                f"token file {self.path} has {len(self)} tokens, too few for one batch: order={order!r} "
                f"with batch_size={batch_size}, seq_len={seq_len} needs {rule} = {needed} tokens; "
                f"use a smaller batch_size/seq_len or more data"
            )

        if order == "sequential":
            whole_sequences = (len(self) - 1) // seq_len
            sequence_ids = (step * batch_size + np.arange(batch_size, dtype=np.int64)) % whole_sequences
            starts = sequence_ids * seq_len
        else:
            generator = np.random.default_rng([seed, step])
            starts = generator.integers(0, len(self) - seq_len, size=batch_size, dtype=np.int64)

        windows = np.asarray(self.tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
        return windows[:, :-1], windows[:, 1:]
