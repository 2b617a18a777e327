"""Datasets for training (GPT-2 and Llama-family models): text, whose every token is trained, and fine-tuning
examples with loss masks; their preparation, a built-in corpus and instruction set, and batching.

    text.py          text datasets: train.bin/val.bin token streams, the built-in corpus, TokenDataset
    chat.py          chat templates rendered as transformers' apply_chat_template, with assistant masks
    examples.py      examples (chat, prompt/completion, Alpaca, text) with loss masks, ExampleDataset, Batch
    instructions.py  the built-in instruction examples (standard library functions)
    cli.py           the command

Command line::

    python -m jnntile.data [INPUT] [--out DIR] [--vocab-size N] [--tokenizer MODEL_DIR]
                           [--val-fraction F] [--glob PATTERN] [--max-bytes N]
                           [--chat-template FILE] [--train-on-prompt]
    python -m jnntile.data --builtin-instructions --tokenizer MODEL_DIR --out DIR
    python -m jnntile.data --show DIR [--json] [--example N]

`open_dataset(path)` opens either kind: an ExampleDataset (meta.json's "kind" is "examples"), whose `batch`
returns a Batch of idx, targets, segments and positions; else a TokenDataset, whose `batch` returns (idx,
targets) as before.
"""

from tokenizers import Tokenizer

from jnntile.data.chat import ChatTemplate, load_chat_template
from jnntile.data.cli import main
from jnntile.data.examples import (FORMATS, IGNORE_INDEX, Batch, ExampleDataset, detect_format, open_dataset,
                                   prepare_examples, read_examples, show)
from jnntile.data.instructions import builtin_instruction_examples
from jnntile.data.text import (BATCH_ORDERS, DEFAULT_GLOB, DEFAULT_STDLIB_MAX_BYTES, DEFAULT_VAL_FRACTION,
                               DEFAULT_VOCAB_SIZE, END_OF_TEXT, EXAMPLES_KIND, MAX_VOCAB_SIZE, META_FILE,
                               MIN_VOCAB_SIZE, TOKEN_DTYPE, TOKEN_DTYPES, TOKENIZER_FILE, TRAIN_FILE, VAL_FILE,
                               TokenDataset, default_dataset_dir, ensure_default_dataset, find_text_files,
                               load_pretrained_tokenizer, prepare_dataset, prepare_stdlib_dataset, read_documents,
                               stdlib_root, stdlib_source_description, stdlib_source_files, token_dtype,
                               tokenizer_fingerprint)

__all__ = [
    "BATCH_ORDERS", "DEFAULT_GLOB", "DEFAULT_STDLIB_MAX_BYTES", "DEFAULT_VAL_FRACTION", "DEFAULT_VOCAB_SIZE",
    "END_OF_TEXT", "EXAMPLES_KIND", "FORMATS", "IGNORE_INDEX", "MAX_VOCAB_SIZE", "META_FILE", "MIN_VOCAB_SIZE",
    "TOKENIZER_FILE", "TOKEN_DTYPE", "TOKEN_DTYPES", "TRAIN_FILE", "VAL_FILE", "Batch", "ChatTemplate",
    "ExampleDataset", "TokenDataset", "Tokenizer", "builtin_instruction_examples", "default_dataset_dir",
    "detect_format", "ensure_default_dataset", "find_text_files", "load_chat_template", "load_pretrained_tokenizer",
    "main", "open_dataset", "prepare_dataset", "prepare_examples", "prepare_stdlib_dataset", "read_documents",
    "read_examples", "show", "stdlib_root", "stdlib_source_description", "stdlib_source_files", "token_dtype",
    "tokenizer_fingerprint",
]
