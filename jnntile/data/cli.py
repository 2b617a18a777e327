"""`python -m jnntile.data`: prepare a text dataset or a dataset of examples, or show one."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

from jnntile.data import chat, examples, instructions
from jnntile.data.text import (DEFAULT_GLOB, DEFAULT_STDLIB_MAX_BYTES, DEFAULT_VAL_FRACTION, DEFAULT_VOCAB_SIZE,
                               MAX_VOCAB_SIZE, META_FILE, MIN_VOCAB_SIZE, TOKENIZER_FILE, TRAIN_FILE, VAL_FILE,
                               ensure_default_dataset, find_text_files, prepare_dataset)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jnntile.data",
        description=(
            "Tokenize text into a nanoGPT-style dataset (train.bin, val.bin, tokenizer.json, meta.json), or "
            "fine-tuning examples (.jsonl lines or .json arrays of objects with 'messages', 'prompt'/'completion', "
            "Alpaca's 'instruction'/'input'/'output', or 'text') into a dataset with loss masks. "
            "With no INPUT, prepare the built-in corpus (the Python standard library's .py sources) "
            "into the default cache directory, or reuse it if it is already there."
        ),
    )
    parser.add_argument("input", nargs="?", metavar="INPUT",
                        help="a text file, a .jsonl or .json file of examples, or a folder searched recursively")
    parser.add_argument("--out", metavar="DIR", help="output directory (required with INPUT)")
    parser.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, metavar="N",
        help=f"BPE vocabulary size, {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE} (default {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR",
        help="a model directory whose tokenizer.json to use (e.g. a Hugging Face Llama checkpoint) instead of "
             "training a BPE tokenizer; --vocab-size is then the tokenizer's. Required for examples",
    )
    parser.add_argument(
        "--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
        help=f"fraction of tokens (of examples, for examples), taken from the end, held out for validation "
             f"(default {DEFAULT_VAL_FRACTION})",
    )
    parser.add_argument(
        "--glob", metavar="PATTERN",
        help=f"which files of an INPUT folder to read (default {DEFAULT_GLOB!r}; where it matches nothing, the "
             "folder's .jsonl and .json examples)",
    )
    parser.add_argument(
        "--max-bytes", type=int, metavar="N",
        help=(
            "read at most N bytes of text "
            f"(default: all of INPUT; {DEFAULT_STDLIB_MAX_BYTES} for the built-in corpus)"
        ),
    )
    examples_group = parser.add_argument_group("examples (fine-tuning data)")
    chat.add_chat_template_flag(examples_group)
    examples_group.add_argument(
        "--train-on-prompt", action="store_true",
        help="train on every token of an example, not only on assistant turns and completions",
    )
    examples_group.add_argument(
        "--builtin-instructions", action="store_true",
        help="prepare the built-in instruction examples (Python standard library functions: the prompt is the "
             "signature and docstring, the completion the body) with --tokenizer into --out",
    )
    examples_group.add_argument("--show", metavar="DIR",
                                help="print the first training examples of a dataset of examples, targets marked")
    examples_group.add_argument("--json", action="store_true",
                                help="with --show: every training example as a JSON line {\"ids\", \"loss_mask\"}")
    examples_group.add_argument("--example", type=int, metavar="N", help="with --show: only example N (from 0)")
    args = parser.parse_args(argv)
    if args.show is not None:
        if args.input is not None or args.builtin_instructions:
            parser.error("--show DIR reads a prepared dataset: give no INPUT or --builtin-instructions with it")
    elif args.json or args.example is not None:
        parser.error("--json and --example apply only to --show DIR")
    if args.input is None and args.glob is not None:
        parser.error("--glob applies only to an INPUT folder")
    if args.builtin_instructions:
        if args.input is not None:
            parser.error("--builtin-instructions prepares its own examples: give no INPUT with it")
        if args.out is None or args.tokenizer is None:
            parser.error("--builtin-instructions needs --tokenizer MODEL_DIR and --out DIR")
    if args.input is not None and args.out is None:
        parser.error("--out DIR is required when INPUT is given")
    return args


def _example_files(args: argparse.Namespace) -> list[Path] | None:
    """INPUT's example files, or None where INPUT is text."""
    source = Path(args.input)
    if not source.exists():
        return None  # prepare_dataset names it
    if source.is_file():
        return [source] if examples.is_examples_input([source]) else None
    if args.glob is not None:
        files = find_text_files(source, args.glob)
        return files if examples.is_examples_input(files) else None
    if any(path.is_file() for path in source.rglob(DEFAULT_GLOB)):
        return None
    return examples.find_example_files(source, None)


def _prepare_examples(args: argparse.Namespace, files: list[Path] | None) -> Path:
    if args.tokenizer is None:
        raise ValueError(f"{args.input} holds examples (fine-tuning data): give the model's tokenizer with "
                         "--tokenizer MODEL_DIR")
    if files is None:
        found = instructions.builtin_instruction_examples()
        description = instructions.builtin_instructions_description(len(found))
    else:
        found = examples.read_examples(files)
        description = str(args.input) if len(files) == 1 and Path(args.input).is_file() else (
            f"{args.input} ({len(files)} files of examples, recursive)")
    return examples.prepare_examples(
        found, args.out, tokenizer_dir=args.tokenizer, source_description=description,
        chat_template=args.chat_template, train_on_prompt=args.train_on_prompt, val_fraction=args.val_fraction)


def _print_summary(out_dir: Path, elapsed: float) -> None:
    meta = json.loads((out_dir / META_FILE).read_text())
    print(f"source:     {meta['source']}")
    files = [TRAIN_FILE, VAL_FILE, TOKENIZER_FILE, META_FILE]
    if meta.get("kind") == "examples":
        formats = ", ".join(f"{count} {name}" for name, count in meta["formats"].items())
        print(f"examples:   {meta['train_examples']} train, {meta['val_examples']} val ({formats}); "
              f"{meta['dropped_no_target']} dropped (no token to train on)")
        print(f"tokens:     {meta['train_tokens']} train ({meta['train_targets']} trained), {meta['val_tokens']} val "
              f"({meta['val_targets']} trained)")
        print(f"template:   {meta['chat_template_origin'] or 'none (prompt and completion concatenated)'}")
        files[2:2] = [examples.mask_file(name) for name in (TRAIN_FILE, VAL_FILE)] + [
            examples.offsets_file(name) for name in (TRAIN_FILE, VAL_FILE)]
    else:
        print(f"tokens:     {meta['train_tokens']} train, {meta['val_tokens']} val")
    print(f"vocab size: {meta['vocab_size']}")
    for name in files:
        print(f"file:       {out_dir / name}")
    print(f"time:       {elapsed:.1f} s")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    started = time.perf_counter()
    try:
        if args.show is not None:
            examples.show(args.show, as_json=args.json, example=args.example)
            return
        if args.builtin_instructions:
            out_dir = _prepare_examples(args, None)
        elif args.input is None:
            out_dir = ensure_default_dataset(
                args.vocab_size,
                max_bytes=args.max_bytes if args.max_bytes is not None else DEFAULT_STDLIB_MAX_BYTES,
                val_fraction=args.val_fraction,
                out_dir=args.out,
            )
        elif (files := _example_files(args)) is not None:
            out_dir = _prepare_examples(args, files)
        else:
            if args.chat_template is not None or args.train_on_prompt:
                raise ValueError(f"{args.input} is text, every token of which trains: --chat-template and "
                                 "--train-on-prompt apply to examples (.jsonl or .json files)")
            out_dir = prepare_dataset(
                args.input,
                args.out,
                vocab_size=args.vocab_size,
                val_fraction=args.val_fraction,
                glob=args.glob or DEFAULT_GLOB,
                max_bytes=args.max_bytes,
                tokenizer=args.tokenizer,
            )
    except (FileNotFoundError, ValueError) as error:
        # These carry a message meant for the user; a traceback would bury it.
        raise SystemExit(f"python -m jnntile.data: error: {error}") from error
    _print_summary(out_dir, time.perf_counter() - started)
