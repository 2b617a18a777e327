"""Fine-tuning datasets: examples (chat, prompt/completion, Alpaca, text) tokenized with loss masks, and their
packed batches.

Formats, one JSON object per example (a `.jsonl` line, or an item of a `.json` array), detected from the keys;
every example of a file has the same format:

    messages                a chat: [{"role": "system" | "user" | "assistant", "content": "..."}, ...]
    prompt, completion      the prompt as a user turn, the completion as the assistant's
    instruction, output     Alpaca (an optional "input" follows the instruction after a blank line): as
                            prompt/completion
    text                    every token trained

Conversations are rendered with the model's chat template (`jnntile.data.chat`); prompt/completion and Alpaca
data without one are the prompt's tokens then the completion's and the end-of-text token. A token is a training
target when it belongs to an assistant turn (its content and the end-of-turn token after it) or a completion
(and its end-of-text token), or always with `train_on_prompt`; an example's first token never is (nothing comes
before it). Examples without a target are dropped and counted.

The dataset directory (meta.json's "kind" is "examples"):

    train.bin / val.bin                     the examples' token ids, concatenated (uint16, uint32 beyond 65536)
    train.mask.bin / val.mask.bin           uint8 per token: 1 where the token is a training target
    train.examples.npy / val.examples.npy   int64 offsets of the examples in the token file (examples + 1)
    tokenizer.json, meta.json               as a text dataset's, meta.json adding the chat template, the formats,
                                            the example counts and those dropped

Validation is the last `val_fraction` of the examples (at least one in each split).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from jnntile.data import text
from jnntile.data.chat import ROLES, ChatTemplate, load_chat_template
from jnntile.data.text import (DEFAULT_VAL_FRACTION, EXAMPLES_KIND, META_FILE, TOKENIZER_FILE, TRAIN_FILE, VAL_FILE,
                               TokenDataset, check_batch_args, token_dtype)

# A format's name: the keys an example must have, and those it may have besides (any other key is ignored).
FORMATS = {
    "messages": ("messages",),
    "prompt/completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
EXAMPLE_SUFFIXES = (".jsonl", ".json")
IGNORE_INDEX = -100


def mask_file(tokens_file: str) -> str:
    """train.bin -> train.mask.bin"""
    return tokens_file.removesuffix(".bin") + ".mask.bin"


def offsets_file(tokens_file: str) -> str:
    """train.bin -> train.examples.npy"""
    return tokens_file.removesuffix(".bin") + ".examples.npy"


# --------------------------------------------------------------------------
# Reading examples
# --------------------------------------------------------------------------


def is_examples_input(files: Sequence[Path]) -> bool:
    """Whether `files` are examples (.jsonl, .json) rather than text; a mix of both is refused."""
    examples = [path for path in files if path.suffix in EXAMPLE_SUFFIXES]
    if examples and len(examples) != len(files):
        other = next(path for path in files if path.suffix not in EXAMPLE_SUFFIXES)
        raise ValueError(f"the input mixes examples ({examples[0]}) and text ({other}); give one kind (--glob picks "
                         "files of a folder)")
    return bool(examples)


def _records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, value) of each example of a .jsonl file (a line) or .json file (an item of its array)."""
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; give JSON Lines or a JSON array of examples") from None
    if path.suffix == ".json":
        try:
            items = json.loads(content)
        except ValueError as error:
            raise ValueError(f"{path} is not JSON ({error}); give a JSON array of examples") from None
        if not isinstance(items, list):
            raise ValueError(f"{path} holds a JSON {type(items).__name__}, not an array of examples; give a list "
                             "of objects, or JSON Lines (.jsonl)")
        for number, item in enumerate(items, 1):
            yield f"{path} item {number}", item
        return
    for number, line in enumerate(content.splitlines(), 1):
        if line.strip():
            try:
                yield f"{path} line {number}", json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path} line {number} is not JSON ({error}); each line holds one example's "
                                 "JSON object") from None


def _expected_keys() -> str:
    return "; ".join(" and ".join(repr(key) for key in keys) + f" ({name})" for name, keys in FORMATS.items())


def detect_format(record: object, where: str) -> str:
    """The format whose keys `record` has; one with the keys of none, or of two, is refused."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object; expected an object with the "
                         f"keys {_expected_keys()}")
    matches = [name for name, keys in FORMATS.items() if all(key in record for key in keys)]
    if len(matches) != 1:
        problem = "match no format" if not matches else f"match several formats ({', '.join(matches)})"
        raise ValueError(f"{where}: its keys {sorted(record)} {problem}; expected the keys of one of "
                         f"{_expected_keys()}")
    return matches[0]


def read_examples(files: Sequence[Path]) -> Iterator[tuple[str, str, dict]]:
    """(where, format, record) of every example of `files`, in order; a file mixing formats is refused at the
    first example whose format differs from the file's first."""
    for path in files:
        first = None
        for where, record in _records(path):
            found = detect_format(record, where)
            if first is None:
                first = (found, where)
            elif found != first[0]:
                raise ValueError(f"{where} is a {found!r} example, but {first[1]} is {first[0]!r}: a file holds "
                                 f"examples of one format; split it, or convert them all to one")
            yield where, found, record


def _string(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} is a JSON {type(value).__name__}, not a string")
    return value


def _messages(record: dict, where: str) -> list[dict]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    checked = []
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                message.get("content"), str):
            raise ValueError(f"{where}: message {number} is {json.dumps(message, ensure_ascii=False)[:200]}; each "
                             f"message is {{'role': {' | '.join(map(repr, ROLES))}, 'content': a string}}")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


# --------------------------------------------------------------------------
# Tokenizing examples
# --------------------------------------------------------------------------


@dataclass
class Encoder:
    """Turns an example of any format into (ids, loss mask)."""

    tokenizer: Tokenizer
    end_of_text: int | None
    template: ChatTemplate | None
    train_on_prompt: bool = False
    template_flag: str = "--chat-template FILE"

    def __call__(self, where: str, found: str, record: dict) -> tuple[list[int], list[int]]:
        if found == "text":
            ids = self._text(_string(record, "text", where)) + self._end()
            mask = [1] * len(ids)
        elif found == "messages":
            if self.template is None:
                raise ValueError(f"{where} is a conversation ('messages'), but the tokenizer has no chat template "
                                 f"(tokenizer_config.json's chat_template, or chat_template.jinja); give one with "
                                 f"{self.template_flag}")
            ids, mask = self.template.encode(self.tokenizer, _messages(record, where))
        else:
            if found == "alpaca":
                prompt = _string(record, "instruction", where)
                extra = _string(record, "input", where) if "input" in record else ""
                prompt += f"\n\n{extra}" if extra else ""
                completion = _string(record, "output", where)
            else:
                prompt, completion = _string(record, "prompt", where), _string(record, "completion", where)
            ids, mask = self.prompt_completion(prompt, completion)
        if self.train_on_prompt:
            mask = [1] * len(ids)
        if mask:
            mask[0] = 0  # nothing before it to predict it from
        return ids, mask

    def _text(self, content: str) -> list[int]:
        return self.tokenizer.encode(content).ids

    def _end(self) -> list[int]:
        return [] if self.end_of_text is None else [self.end_of_text]

    def prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        if self.template is not None:
            return self.template.encode(self.tokenizer, [{"role": "user", "content": prompt},
                                                         {"role": "assistant", "content": completion}])
        prompt_ids = self._text(prompt)
        completion_ids = self.tokenizer.encode(completion, add_special_tokens=False).ids + self._end()
        return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)


# --------------------------------------------------------------------------
# Preparation
# --------------------------------------------------------------------------


def _write_array(array: np.ndarray, path: Path) -> None:
    with open(path, "wb") as handle:  # np.save given a name would add ".npy" to the temporary one
        np.save(handle, array)


def _split_files(name: str, ids: np.ndarray, masks: np.ndarray, offsets: np.ndarray) -> dict:
    return {name: ids.tofile, mask_file(name): masks.tofile, offsets_file(name): lambda path: _write_array(offsets,
                                                                                                          path)}


def prepare_examples(
    examples: Iterable[tuple[str, str, dict]],
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike,
    source_description: str,
    chat_template: str | os.PathLike | None = None,
    train_on_prompt: bool = False,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = True,
) -> Path:
    """Tokenize `examples` ((where, format, record), as `read_examples` gives) with the tokenizer of the model
    directory `tokenizer_dir` and its chat template (or the file `chat_template`) into a dataset in `out_dir`."""
    out_dir = Path(out_dir)
    text._check_val_fraction(val_fraction)
    text._check_out_dir(out_dir)
    tokenizer, end_of_text = text.load_pretrained_tokenizer(tokenizer_dir)
    template = load_chat_template(tokenizer_dir, chat_template)
    encode = Encoder(tokenizer, end_of_text, template, train_on_prompt)
    dtype = token_dtype(tokenizer.get_vocab_size())
    kept, formats, dropped = [], Counter(), 0
    for where, found, record in tqdm(examples, unit="example", desc="tokenizing", disable=not progress):
        ids, mask = encode(where, found, record)
        formats[found] += 1
        if any(mask):
            kept.append((np.asarray(ids, dtype=dtype), np.asarray(mask, dtype=np.uint8)))
        else:
            dropped += 1
    if len(kept) < 2:
        raise ValueError(f"{len(kept)} of the {sum(formats.values())} examples have a token to train on "
                         f"({dropped} dropped: no assistant turn or completion); a dataset needs at least two, one "
                         "for validation")
    val_examples = min(max(1, int(len(kept) * val_fraction)), len(kept) - 1)
    splits = {TRAIN_FILE: kept[: len(kept) - val_examples], VAL_FILE: kept[len(kept) - val_examples:]}
    writers, counts = {}, {}
    for name, split in splits.items():
        lengths = np.array([len(ids) for ids, _ in split], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate([ids for ids, _ in split])
        masks = np.concatenate([mask for _, mask in split])
        writers.update(_split_files(name, ids, masks, offsets))
        stem = name.removesuffix(".bin")
        counts.update({f"{stem}_examples": len(split), f"{stem}_tokens": int(len(ids)),
                       f"{stem}_targets": int(masks.sum())})
    meta = {
        "kind": EXAMPLES_KIND,
        "vocab_size": tokenizer.get_vocab_size(),
        "dtype": np.dtype(dtype).name,
        **counts,
        "dropped_no_target": dropped,
        "formats": dict(formats),
        "source": source_description,
        "val_fraction": val_fraction,
        "train_on_prompt": train_on_prompt,
        "chat_template": None if template is None else template.source,
        "chat_template_origin": None if template is None else template.origin,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": text.tokenizer_fingerprint(tokenizer),
        "end_of_text_id": end_of_text,
    }
    writers[TOKENIZER_FILE] = lambda path: text._save_tokenizer(tokenizer, path)
    writers[META_FILE] = lambda path: path.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    text._write_dataset(out_dir, writers)
    return out_dir


def find_example_files(source: str | os.PathLike, glob: str | None) -> list[Path]:
    """The example files of `source`: the file itself, or a folder's files matching `glob` (default: its .jsonl
    and .json files), recursively in sorted order."""
    source = Path(source)
    if source.is_file() or glob is not None:
        return text.find_text_files(source, glob or "*")
    files = sorted(path for suffix in EXAMPLE_SUFFIXES for path in source.rglob(f"*{suffix}") if path.is_file())
    if not files:
        raise ValueError(f"folder {source} has no .jsonl or .json files (searched recursively); add examples or "
                         "pick files with --glob")
    return files


# --------------------------------------------------------------------------
# Loading and batching
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """A training step's sequences, int32 (batch_size, seq_len) each.

    idx        input token ids (0 at padding)
    targets    the next token of the same example where it is a training target, else IGNORE_INDEX (-100): a
               masked token, padding, an example's last position (targets never cross examples)
    segments   the example each position belongs to within its row, 1, 2, 3, ... in packing order; 0 at padding
    positions  0 at each example's first token, counting up; 0 at padding
    """

    idx: np.ndarray
    targets: np.ndarray
    segments: np.ndarray
    positions: np.ndarray


class ExampleDataset(TokenDataset):
    """A dataset of examples with loss masks (see the module docstring): `path` is its directory (its
    train.bin) or one of its token files. Its tokens, tokenizer, vocabulary and decoding are TokenDataset's;
    `batch` packs examples into rows and returns a Batch."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        if self.meta.get("kind") != EXAMPLES_KIND:
            raise ValueError(f"{self.path.parent} is not a dataset of examples (its meta.json has no kind "
                             f"{EXAMPLES_KIND!r}); prepare one from .jsonl examples with `python -m jnntile.data`")
        mask_path = self.path.parent / mask_file(self.path.name)
        offsets_path = self.path.parent / offsets_file(self.path.name)
        for needed in (mask_path, offsets_path):
            if not needed.is_file():
                raise FileNotFoundError(f"{needed} does not exist: the dataset {self.path.parent} is incomplete; "
                                        "prepare it again with `python -m jnntile.data`")
        self.mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
        try:
            self.offsets = np.load(offsets_path)
        except ValueError as error:
            raise ValueError(f"{offsets_path} is not a NumPy file ({error}); prepare the dataset again with "
                             "`python -m jnntile.data`") from None
        offsets = self.offsets
        if (len(self.mask) != len(self.tokens) or offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0
                or offsets[-1] != len(self.tokens) or np.any(np.diff(offsets) <= 0)):
            raise ValueError(f"{self.path}, {mask_path.name} and {offsets_path.name} do not agree (token, mask and "
                             "example counts); prepare the dataset again with `python -m jnntile.data`")
        self.lengths = np.diff(offsets)
        self._epochs: dict[tuple, list] = {}

    def examples(self) -> int:
        return len(self.lengths)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss mask) of example `index`, in file order."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return np.asarray(self.tokens[start:end], dtype=np.int64), np.asarray(self.mask[start:end], dtype=np.uint8)

    def validation(self) -> ExampleDataset | None:
        val_path = self.path.parent / VAL_FILE
        if self.path.name == VAL_FILE or not val_path.is_file():
            return None
        return ExampleDataset(val_path)

    def _check_lengths(self, seq_len: int, truncate: bool) -> None:
        if not truncate and self.lengths.max() > seq_len:
            index = int(np.argmax(self.lengths > seq_len))
            raise ValueError(f"example {index} of {self.path} has {int(self.lengths[index])} tokens, more than "
                             f"--seq-len {seq_len} ({int(np.sum(self.lengths > seq_len))} examples do); raise "
                             "--seq-len, or leave out --no-truncate to cut them")

    def _rows(self, order: np.ndarray, seq_len: int, packing: bool) -> np.ndarray:
        """Start indices into `order` of each row: greedily, a row takes examples in order until the next
        (truncated to seq_len) would not fit; without packing, one example a row."""
        if not packing:
            return np.arange(len(order), dtype=np.int64)
        lengths = np.minimum(self.lengths[order], seq_len)
        starts, used = [0], 0
        for position, length in enumerate(lengths.tolist()):
            if used + length > seq_len:
                starts.append(position)
                used = 0
            used += length
        return np.asarray(starts, dtype=np.int64)

    def _epoch(self, key: tuple, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order of the examples, row starts) of `epoch` for key (order, seed, seq_len, packing), cached."""
        epochs = self._epochs.setdefault(key, [])
        order_name, seed, seq_len, packing = key
        while len(epochs) <= epoch:
            if order_name == "random":
                order = np.random.default_rng([seed, len(epochs)]).permutation(self.examples())
            else:
                order = np.arange(self.examples())
            epochs.append((order, self._rows(order, seq_len, packing)))
            if order_name == "sequential":  # every epoch alike: one is enough
                break
        return epochs[0] if order_name == "sequential" else epochs[epoch]

    def _row(self, key: tuple, row: int) -> np.ndarray:
        """The examples (file indices) of global row `row`: rows of epoch 0, then of epoch 1, ..."""
        epoch = 0
        while True:
            order, starts = self._epoch(key, epoch)
            if row < len(starts):
                end = starts[row + 1] if row + 1 < len(starts) else len(order)
                return order[starts[row]:end]
            row -= len(starts)
            epoch += 1

    def batch(self, step: int, batch_size: int, seq_len: int, order: str = "sequential", seed: int = 0,
              packing: bool = True, truncate: bool = True) -> Batch:
        """The Batch of training step `step`: rows step*batch_size ... of the sequence of rows that epoch after
        epoch packs. order="sequential" takes the examples in file order every epoch; order="random" in a
        permutation drawn for each epoch from (seed, epoch). The same arguments give the same batch in every
        run. Examples longer than seq_len are cut to their first seq_len tokens (refused with truncate=False)."""
        check_batch_args(step, batch_size, seq_len, order)
        self._check_lengths(seq_len, truncate)
        key = (order, seed if order == "random" else 0, int(seq_len), bool(packing))
        shape = (batch_size, seq_len)
        idx = np.zeros(shape, dtype=np.int32)
        targets = np.full(shape, IGNORE_INDEX, dtype=np.int32)
        segments = np.zeros(shape, dtype=np.int32)
        positions = np.zeros(shape, dtype=np.int32)
        for row in range(batch_size):
            used = 0
            for segment, index in enumerate(self._row(key, step * batch_size + row), 1):
                ids, mask = self.example(int(index))
                length = min(len(ids), seq_len)
                span = slice(used, used + length)
                idx[row, span] = ids[:length]
                segments[row, span] = segment
                positions[row, span] = np.arange(length)
                following = ids[1:length]
                targets[row, used:used + length - 1] = np.where(mask[1:length] == 1, following, IGNORE_INDEX)
                used += length
        return Batch(idx, targets, segments, positions)

    def stats(self, seq_len: int, packing: bool = True) -> dict:
        """What training at `seq_len` gets from the examples (in file order): examples; dropped_no_target (at
        preparation); truncated (longer than seq_len); no_target_after_truncation (whose targets all lie
        beyond it); tokens and targets within seq_len; rows per epoch; padding_fraction of the rows."""
        kept = np.minimum(self.lengths, seq_len)
        before = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])
        starts = self.offsets[:-1]
        targets = before[starts + kept] - before[starts + 1]
        rows = len(self._rows(np.arange(self.examples()), seq_len, packing))
        return {
            "examples": self.examples(),
            "dropped_no_target": int(self.meta.get("dropped_no_target", 0)),
            "truncated": int(np.sum(self.lengths > seq_len)),
            "no_target_after_truncation": int(np.sum(targets == 0)),
            "tokens": int(kept.sum()),
            "targets": int(targets.sum()),
            "rows": rows,
            "padding_fraction": float(1 - kept.sum() / (rows * seq_len)),
        }


def open_dataset(path: str | os.PathLike) -> TokenDataset:
    """The dataset at `path` (a directory or a token file in one): an ExampleDataset where meta.json's kind is
    "examples", else a TokenDataset."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    meta_path = folder / META_FILE
    if meta_path.is_file() and text._read_meta(meta_path).get("kind") == EXAMPLES_KIND:
        return ExampleDataset(path)
    return TokenDataset(path)


# --------------------------------------------------------------------------
# Inspection
# --------------------------------------------------------------------------

TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"


def marked_text(dataset: ExampleDataset, index: int) -> str:
    """Example `index` decoded, its training targets between [[ and ]]."""
    ids, mask = dataset.example(index)
    pieces, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            piece = dataset.decode(ids[start:end])
            pieces.append(f"{TRAINED_OPEN}{piece}{TRAINED_CLOSE}" if mask[start] else piece)
            start = end
    return "".join(pieces)


def show(directory: str | os.PathLike, *, as_json: bool = False, example: int | None = None, count: int = 3,
         out=None) -> None:
    """Prints the training examples of the dataset `directory`: the first `count` (or number `example`) decoded
    with their targets marked, or as_json every one (or number `example`) as {"ids": [...], "loss_mask": [...]},
    a line each, in file order."""
    out = out or sys.stdout
    dataset = open_dataset(directory)
    if not isinstance(dataset, ExampleDataset):
        raise ValueError(f"{directory} is a text dataset (every token trained); --show reads a dataset of examples, "
                         "prepared from .jsonl or .json files")
    total = dataset.examples()
    if example is not None and not 0 <= example < total:
        raise ValueError(f"--example {example}: the dataset's training split has examples 0..{total - 1}")
    chosen = [example] if example is not None else range(total if as_json else min(count, total))
    if not as_json:
        print(f"{directory}: {total} training examples; training targets are marked "
              f"{TRAINED_OPEN}like this{TRAINED_CLOSE}", file=out)
    for index in chosen:
        ids, mask = dataset.example(index)
        if as_json:
            print(json.dumps({"ids": ids.tolist(), "loss_mask": mask.tolist()}), file=out)
        else:
            print(f"\n--- example {index}: {len(ids)} tokens, {int(mask.sum())} trained ---", file=out)
            print(marked_text(dataset, index), file=out)
