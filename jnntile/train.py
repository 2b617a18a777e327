"""Train a GPT-2 or a Llama-family model on tiled tensors: `python -m jnntile.train`.

With no arguments it trains the `tiny` preset on the built-in corpus (the
Python standard library's sources, tokenized on first use) for a few minutes
and prints samples. Every run writes to --out: metrics.jsonl (one JSON object
per step), loss.png, and checkpoints (see jnntile/training/checkpoint.py). --resume
continues from the latest checkpoint bit-identically: batches and dropout
masks are pure functions of (seed, step). --model picks a preset of any
family (jnntile.models.families); --init-from-hf starts from a Hugging Face
checkpoint of one (both list them below); --data reads a dataset `python -m jnntile.data`
prepared (whose --tokenizer uses a model's own tokenizer): text, every token trained, or fine-tuning
examples, their targets alone, packed into the --seq-len rows (--packing; docs/train.md).

Under an MPI launcher (`mpirun -n N --bind-to none python -m jnntile.train ...`)
the N processes train one model, each on 1/N of every batch; only rank 0
prints and writes (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import traceback
import zlib
from pathlib import Path

import jax
import numpy as np
import optax
from tqdm import tqdm

import jnntile
from jnntile.training import checkpoint, lora, optim
from jnntile.models import decoding
from jnntile.core import distributed
from jnntile import flags, nn, planning
from jnntile.training import run_dir
from jnntile.training import step as step_mod
from jnntile import data as data_mod
from jnntile.io import tensorfile
from jnntile.models import families

DEFAULTS = dict(model="tiny", batch_size=8, seq_len=128, steps=1500, lr=3e-3, warmup_steps=50,
                weight_decay=0.1, optimizer="adamw", seed=0, eval_interval=100, eval_batches=4,
                checkpoint_interval=200, data_order="random", out="out", samples=3, sample_tokens=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jnntile.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(families.PRESETS), default=DEFAULTS["model"],
                   help=f"size preset: {families.PRESETS_HELP}")
    p.add_argument("--n-layer", type=int, help="override the preset's layer count")
    p.add_argument("--n-head", type=int, help="override the preset's head count")
    p.add_argument("--n-embd", type=int, help="override the preset's width")
    p.add_argument("--dropout", type=float, help="override the preset's dropout rate")
    flags.add_execution_flags(p)
    p.add_argument("--data", help="a dataset `python -m jnntile.data` prepared: text (a directory or its nanoGPT-style "
                   ".bin token file), every token trained, or fine-tuning examples, only their targets trained "
                   "(default: the built-in corpus)")
    flags.add_example_flags(p)
    p.add_argument("--allow-tokenizer-mismatch", action="store_true", help="train an --init-from-hf model on data "
                   "made by another tokenizer than the model's own (refused by default: its ids mean other tokens)")
    flags.add_batch_flags(p, batch_size=DEFAULTS["batch_size"])
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="total steps, also when resuming")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=DEFAULTS["warmup_steps"])
    p.add_argument("--weight-decay", type=float, default=DEFAULTS["weight_decay"])
    flags.add_update_flags(p)
    p.add_argument("--optimizer", choices=sorted(optim.OPTIMIZER_STATES), default=DEFAULTS["optimizer"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--eval-interval", type=int, default=DEFAULTS["eval_interval"], help="0 disables evaluation")
    p.add_argument("--eval-batches", type=int, default=DEFAULTS["eval_batches"])
    p.add_argument("--checkpoint-interval", type=int, default=DEFAULTS["checkpoint_interval"],
                   help="0: only at the end")
    p.add_argument("--data-order", choices=list(data_mod.BATCH_ORDERS), default=DEFAULTS["data_order"])
    p.add_argument("--out", default=DEFAULTS["out"], help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="start afresh in an --out that holds another run: "
                   "its checkpoints, metrics.jsonl and loss.png are removed once the set-up checks passed")
    p.add_argument("--init-from-hf", metavar="DIR", help="start from a Hugging Face checkpoint directory of "
                   f"{families.TITLES}: its config.json's model_type tells which")
    p.add_argument("--export-hf", metavar="DIR", help="write the final weights as a Hugging Face checkpoint")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the --export-hf weights (bfloat16: rounded to nearest even from the float32 "
                        "parameters; checkpoints stay float32)")
    flags.add_finetune_flags(p)
    p.add_argument("--export-lora", metavar="DIR", help="write the trained LoRA adapters as a PEFT directory "
                   "(adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--merge-lora", action="store_true", help="with --export-hf and LoRA adapters: write the base "
                   "with the adapters merged into its weights")
    flags.add_runtime_flags(p)
    p.add_argument("--samples", type=int, default=DEFAULTS["samples"], help="text samples printed at the end")
    p.add_argument("--sample-tokens", type=int, default=DEFAULTS["sample_tokens"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


# ---- set-up ------------------------------------------------------------------------

def _check_args(args) -> None:
    flags.check_step_flags(args)  # what `python -m jnntile.memory` refuses too
    flags.check_values(args, finite=("lr", "weight_decay"), positive=("steps", "eval_batches", "sample_tokens", "lr"),
                       non_negative=("warmup_steps", "eval_interval", "checkpoint_interval", "weight_decay", "samples"),
                       hints={"eval_batches": " (--eval-interval 0 turns evaluation off)",
                              "sample_tokens": " (--samples 0 turns samples off)"})
    adapters = args.lora_rank is not None or args.init_lora
    if (args.export_lora or args.merge_lora) and not adapters:
        raise ValueError(f"{'--export-lora' if args.export_lora else '--merge-lora'} needs LoRA adapters: give "
                         "--lora-rank (or --init-lora)")
    if args.merge_lora and not args.export_hf:
        raise ValueError("--merge-lora writes merged weights with --export-hf DIR; give it")
    if adapters and args.export_hf and not args.merge_lora:
        raise ValueError("--export-hf with LoRA adapters: add --merge-lora to write the merged weights, or write the "
                         "adapters alone with --export-lora DIR")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out, --overwrite removes it: give one of them")
    if args.export_hf and args.export_lora and Path(args.export_hf).resolve() == Path(args.export_lora).resolve():
        raise ValueError(f"--export-hf and --export-lora both name {args.export_hf}: give each its own folder")


def _tokenizer_dir(args) -> Path | None:
    """Where this run's tokenizer files are: the --init-from-hf folder, or the training data's (beside its file)."""
    if args.init_from_hf:
        return Path(args.init_from_hf) if Path(args.init_from_hf).is_dir() else None
    if args.data is None:
        return data_mod.default_dataset_dir()
    return Path(args.data) if Path(args.data).is_dir() else Path(args.data).parent


def _load_data(args) -> tuple[data_mod.TokenDataset, data_mod.TokenDataset | None]:
    path = args.data or data_mod.ensure_default_dataset(progress=not args.quiet) / "train.bin"
    train = data_mod.open_dataset(path)
    examples = isinstance(train, data_mod.ExampleDataset)
    flags.check_example_flags(args, examples, f"--data {path}")
    if examples:  # rows are filled epoch after epoch: every example count makes batches
        validation = train.validation()
        for dataset in (train, validation) if args.no_truncate else ():
            if dataset is not None:
                _refuse_long_examples(dataset, args.seq_len)
        _check_tokenizer(args, train)
        return train, validation
    rows = args.batch_size * args.grad_accum_steps
    need = rows * args.seq_len + 1 if args.data_order == "sequential" else args.seq_len + 1
    if len(train) < need:
        raise ValueError(f"data file {path} holds {len(train)} tokens, fewer than one batch needs ({need}); "
                         "use more data or a smaller --batch-size/--grad-accum-steps/--seq-len")
    validation = train.validation()
    # Evaluation draws windows of seq_len + 1 tokens at random offsets: found at the first evaluation,
    # a short file would end the run before any checkpoint.
    if args.eval_interval and validation is not None and len(validation) < args.seq_len + 1:
        raise ValueError(
            f"validation file {validation.path} holds {len(validation)} tokens, fewer than one evaluation batch "
            f"needs (--seq-len {args.seq_len} + 1 = {args.seq_len + 1}): prepare the data from more text or with a "
            "larger --val-fraction (`python -m jnntile.data FILES --val-fraction 0.1 --out DIR`), give a smaller "
            "--seq-len, or turn evaluation off with --eval-interval 0")
    _check_tokenizer(args, train)
    return train, validation


def _refuse_long_examples(dataset: data_mod.ExampleDataset, seq_len: int) -> None:
    """--no-truncate: refuses a dataset holding an example longer than --seq-len, naming the longest."""
    longest = int(np.argmax(dataset.lengths))
    if dataset.lengths[longest] > seq_len:
        raise ValueError(f"--no-truncate: example {longest} of {dataset.path} has {int(dataset.lengths[longest])} "
                         f"tokens, the longest, more than --seq-len {seq_len} ({int(np.sum(dataset.lengths > seq_len))} "
                         f"examples are longer); give --seq-len {int(dataset.lengths[longest])}, or leave out "
                         "--no-truncate to train on their first --seq-len tokens")


def _examples_summary(dataset: data_mod.ExampleDataset, args) -> str:
    """The line that says what training gets from a dataset of examples at this --seq-len and --packing."""
    stats = dataset.stats(args.seq_len, packing=args.packing == "on")
    return (f"examples: {stats['examples']:,} ({stats['targets']:,} targets), {stats['dropped_no_target']:,} dropped "
            f"with no target, {stats['truncated']:,} truncated at --seq-len {args.seq_len}; {stats['rows']:,} rows "
            f"per epoch with packing {args.packing}, {stats['padding_fraction']:.1%} padding")


def _check_tokenizer(args, train: data_mod.TokenDataset) -> None:
    """Refuses data made by another tokenizer than the --init-from-hf model's own: its ids would mean other
    tokens to the model, which would train and sample garbage without an error. Tokenizers are compared by
    content (data.tokenizer_fingerprint), not by path."""
    model_dir = args.init_from_hf
    if not model_dir or args.allow_tokenizer_mismatch or not (Path(model_dir) / data_mod.TOKENIZER_FILE).is_file():
        return  # nothing to compare with: GPT-2 checkpoints may hold vocab.json and merges.txt alone
    data_fingerprint = train.tokenizer_fingerprint()
    model_tokenizer, _ = data_mod.load_pretrained_tokenizer(model_dir)
    if data_fingerprint is None or data_fingerprint == data_mod.tokenizer_fingerprint(model_tokenizer):
        return  # a bare token file says nothing of its tokenizer
    ours = f"{Path(model_dir) / data_mod.TOKENIZER_FILE} ({model_tokenizer.get_vocab_size()} tokens)"
    prepare = f"`python -m jnntile.data FILES --tokenizer {model_dir} --out DIR`"
    theirs = f"{train.path.parent / data_mod.TOKENIZER_FILE} ({train.vocab_size} tokens)"
    if args.data is None:
        raise ValueError(f"--init-from-hf {model_dir} has its own tokenizer, {ours}, but without --data the run "
                         f"trains on the built-in corpus, tokenized by a BPE of its own, {theirs}: prepare data with "
                         f"that model's tokenizer, {prepare}, and pass --data DIR (or --allow-tokenizer-mismatch to "
                         "train on it anyway)")
    raise ValueError(f"--data {args.data} was tokenized by {theirs}, which differs from the tokenizer of "
                     f"--init-from-hf {model_dir}, {ours}: the model would read its token ids as other tokens; "
                     f"prepare the data again with that model's tokenizer, {prepare}, or give "
                     "--allow-tokenizer-mismatch if the two tokenizers agree on every id")


def _base(args) -> dict:
    """Where this run's first weights come from, as its checkpoints record it: a Hugging Face directory (its path
    and `checkpoint.hf_fingerprint`), or the preset and the seed that draws them."""
    if args.init_from_hf:
        return {"init_from_hf": str(Path(args.init_from_hf).resolve()),
                "fingerprint": checkpoint.hf_fingerprint(args.init_from_hf)}
    return {"model": args.model, "seed": args.seed}


def _resumed_base(path: Path, record: dict, args, finetune) -> dict:
    """The base of checkpoint `path` (its state.json's `record`), checked against this run's flags: the frozen base
    of a LoRA checkpoint or a quantized one is built again from them, and the seed also draws the batches. Raises
    naming both.
    A full fine-tune whose --init-from-hf folder is gone resumes all the same: its checkpoint holds every parameter.
    """
    saved_args = record.get("args", {})
    saved = record.get("base") or ({"init_from_hf": saved_args["init_from_hf"]} if saved_args.get("init_from_hf")
                                   else {"model": saved_args.get("model"), "seed": saved_args.get("seed")})
    afresh = "or start afresh (--overwrite, or another --out)"
    if "init_from_hf" not in saved:
        if args.init_from_hf or (saved["model"], saved["seed"]) != (args.model, args.seed):
            given = f"--init-from-hf {args.init_from_hf}" if args.init_from_hf else f"--model {args.model} --seed {args.seed}"
            raise ValueError(f"checkpoint {path} was trained from --model {saved['model']} --seed {saved['seed']}, this "
                             f"run asks for {given}: give --model {saved['model']} --seed {saved['seed']} (and no "
                             f"--init-from-hf) to resume it, {afresh}")
        return saved
    recorded = saved["init_from_hf"]
    if not args.init_from_hf:
        raise ValueError(f"checkpoint {path} was trained from --init-from-hf {recorded}: give --init-from-hf "
                         f"{recorded} to resume it")
    if not Path(args.init_from_hf).exists():
        if finetune.rebuilds_base:
            held = ("the LoRA adapters alone" if finetune.lora is not None
                    else "its quantized frozen weights dequantized")
            raise ValueError(f"--init-from-hf {args.init_from_hf} does not exist: checkpoint {path} holds {held}, "
                             "whose frozen base is that folder; put it back to resume")
        print(f"note: --init-from-hf {args.init_from_hf} does not exist; resuming from {path}, which holds every "
              "parameter", file=sys.stderr)
        return saved
    mine = _base(args)
    if saved.get("fingerprint", mine["fingerprint"]) != mine["fingerprint"]:
        raise ValueError(f"checkpoint {path} was trained from --init-from-hf {recorded}, and --init-from-hf "
                         f"{args.init_from_hf} holds other weights: give {recorded} (or a copy of it) to resume, {afresh}")
    return mine


def _config(args, data_vocab: int, weights: Path | None = None):
    """The model config the flags ask for; with `weights`, a checkpoint's in place of --init-from-hf's."""
    tiles = flags.execution_settings(args)
    if args.init_from_hf:
        config, _ = families.open_hf(weights or args.init_from_hf)  # checks every file before anything starts
        if data_vocab > config.vocab_size:
            raise ValueError(f"the data uses {data_vocab} token ids but {args.init_from_hf} has a vocabulary of "
                             f"{config.vocab_size}")
        for name in flags.SIZE_FLAGS:  # the weights have their sizes: a flag may only repeat them
            given, field = getattr(args, name), config.FLAG_FIELDS[name]
            if given is not None and given != getattr(config, field):
                raise flags.naming_flags(ValueError(f"the model's size comes from --init-from-hf {args.init_from_hf} "
                                                    f"({field}={getattr(config, field)}); leave the flag out"),
                                         {name: given})
        config = dataclasses.replace(config, **tiles)
        try:  # a family without dropout refuses a rate
            return config if args.dropout is None else dataclasses.replace(config, dropout=args.dropout)
        except ValueError as e:
            raise flags.naming_flags(e, {"dropout": args.dropout}) from None
    config = flags.preset_config(args, vocab_size=data_vocab, **tiles)
    if args.seq_len > config.max_positions:
        config = dataclasses.replace(config, **families.size_overrides(args.model, max_positions=args.seq_len))
    return config


def _make_optimizer(args) -> optax.GradientTransformation:
    decay_steps = max(args.steps, args.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup_steps, decay_steps, end_value=args.lr / 10)
    if args.optimizer == "adamw":
        # As nanoGPT: decay matrices and embeddings, not biases and layer-norm weights.
        decay_2d = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params,  # noqa: E731
                                                is_leaf=lambda x: isinstance(x, jnntile.Tensor))
        main = optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_2d)
    else:
        main = optim.sgd(schedule)
    if args.grad_clip > 0:
        return optim.chain(optim.clip_by_global_norm(args.grad_clip), main), schedule
    return optim.chain(main), schedule


def _memory_in_use_mb() -> float:
    ram = [n for n in jnntile.runtime.stats()["nodes"] if n["kind"] == "RAM"]
    return ram[0]["used_bytes"] / 2**20 if ram else 0.0


def _step_batch(dataset, step: int, args, **fields) -> tuple:
    """`jnntile.step.step_batch` of step `step` as the flags ask (`fields` replace some)."""
    return step_mod.step_batch(dataset, step, **{
        "batch_size": args.batch_size, "grad_accum_steps": args.grad_accum_steps, "seq_len": args.seq_len,
        "order": args.data_order, "seed": args.seed, "packing": args.packing == "on",
        "truncate": not args.no_truncate, **fields})


def _evaluate(eval_step, params, frozen, dataset, args) -> float:
    """The mean validation loss of --eval-batches batches (drawn at random; examples packed as in training), each
    batch's the mean over its targets on every rank, as one process gets it."""
    ranks = jnntile.runtime.world_size()
    losses = []
    for i in range(args.eval_batches):
        batch = _step_batch(dataset, i, args, grad_accum_steps=1, order="random", seed=args.seed + 1)
        idx, targets, segments, positions = (None if a is None else distributed.local_rows(a[0]) for a in batch)
        # This rank's mean weighted by its share of the batch's targets, times the ranks, whose mean is then the
        # batch's (ranks' rows of examples hold uneven numbers of targets; text's weight is exactly 1).
        weight = (int(step_mod.count_targets(targets[None]).sum()) * ranks
                  / max(int(step_mod.count_targets(batch[1]).sum()), 1))
        losses.append(float(eval_step(params, idx, targets, frozen, segments, positions)) * weight)
    return distributed.mean_and_any(float(np.mean(losses)), False, "the validation loss")[0]


# Flags that may differ between the ranks of a distributed run: where things are on each machine, what
# each machine can hold, what rank 0 alone does. The rest must be the same on every rank.
PER_RANK_FLAGS = {"data", "out", "quiet", "init_from_hf", "export_hf", "export_dtype", "init_lora", "export_lora",
                  "workers", "memory_limit_mb", "swap_dir", "swap_size_mb", "swap_backend", "gpu_memory_limit_mb",
                  "cuda_workers"}


def _same_on_every_rank(args, config, dataset) -> dict:
    """What the ranks of a distributed run must agree on: flags, the model with its tiles, the data."""
    tokens = np.asarray(dataset.tokens)
    # Sharded, every rank writes its tiles into each export's files: in one dtype.
    per_rank = PER_RANK_FLAGS - {"export_dtype"} if args.shard_state else PER_RANK_FLAGS
    return {**{f"--{k.replace('_', '-')}": v for k, v in vars(args).items() if k not in per_rank},
            "model": dataclasses.asdict(config),
            "data": {"tokens": len(dataset), "vocab_size": dataset.vocab_size,
                     "crc32": zlib.crc32(tokens[:65536].tobytes() + tokens[-65536:].tobytes())}}


def _require_one_out(out: Path) -> None:
    """Refuses, on every rank, --out that is not one directory every rank sees (rank 0's lock file, with its
    PID, is not what every rank reads there): sharded, every rank writes its tiles of each checkpoint into it."""
    lock = out / run_dir.LOCK_FILE
    try:
        distributed.require_same("--out", {"lock": lock.read_text() if lock.is_file() else None})
    except distributed.SetUpError:
        raise distributed.SetUpError(f"--out {out} is not one directory that every rank sees (rank 0's lock file, "
                                     f"{lock.name}, is not there on every rank): with --shard-state every rank writes its tiles of each "
                                     "checkpoint into it; give a directory on a file system every rank shares") from None


# ---- outputs -----------------------------------------------------------------------

def plot_losses(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = [r["step"] for r in rows], np.array([r["loss"] for r in rows])
    ax.plot(steps, losses, label="train", linewidth=0.6, alpha=0.4)
    window = min(25, len(losses))  # the moving average shows the trend through batch-to-batch noise
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1:], smooth, label=f"train, mean of {window}", linewidth=1.5)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def generate_samples(model, datasets, args) -> list[str]:
    """Continues a few prompts from the first of `datasets` (the validation data, then the training data) that
    holds one, with the trained weights (top-40, temperature 0.8).

    Decoding runs on the tiled model with a key/value cache (jnntile.decoding),
    under this run's memory limit and swap. Prompt and sample stay within the
    trained context (seq_len positions): a prompt of up to 16 tokens, shorter if
    --sample-tokens needs the room.
    """
    window = min(args.seq_len, model.max_positions)
    new_tokens = min(args.sample_tokens, window - 1)
    if new_tokens < args.sample_tokens and jnntile.runtime.rank() == 0:
        print(f"samples of {new_tokens} tokens: the model was trained on {window} positions")
    prompt_len = min(16, window + 1 - new_tokens)
    dataset = next(d for d in datasets if d is not None and len(d) > prompt_len)
    if isinstance(dataset, data_mod.ExampleDataset):
        chosen = np.random.default_rng(args.seed + 2).permutation(dataset.examples())
        prompts = [_example_prompt(dataset, int(chosen[i % len(chosen)]), prompt_len) for i in range(args.samples)]
    else:
        prompts = [dataset.batch(i, 1, prompt_len, "random", seed=args.seed + 2)[0][0] for i in range(args.samples)]
    decoder = decoding.Decoder(model, batch_size=args.samples, max_len=prompt_len + new_tokens - 1)
    continuations = decoder.generate(prompts, new_tokens, temperature=0.8, top_k=40, seed=args.seed)
    return [dataset.decode(list(p) + c) for p, c in zip(prompts, continuations)]


def _example_prompt(dataset: data_mod.ExampleDataset, index: int, prompt_len: int) -> np.ndarray:
    """What example `index` gives the model before its first trained token (a chat's turns up to the reply), its
    last `prompt_len` tokens at most: a sample then shows the reply the model learned to write."""
    ids, mask = dataset.example(index)
    first = max(1, int(np.argmax(mask)))
    return ids[max(0, first - prompt_len):first]


# ---- main ----------------------------------------------------------------------------

def train(args) -> dict:
    """Runs training as configured by `args`; returns a summary. Raises ValueError on bad input."""
    with contextlib.ExitStack() as held:  # the lock of --out, for as long as the run lasts
        return _train(args, held)


def _train(args, held: contextlib.ExitStack) -> dict:
    if distributed.launched_ranks() > 1 and not jnntile.runtime.config().distributed:
        if not jnntile.runtime.HAS_MPI:  # said by every rank
            raise ValueError(f"{distributed.launched_ranks()} processes were launched to train one model, but "
                             f"{jnntile._xla_ffi.mpi_unavailable_reason()}")
        jnntile.runtime.stop()
        jnntile.runtime.configure(distributed=True)
    rank, ranks = jnntile.runtime.rank(), jnntile.runtime.world_size()
    lead = rank == 0  # the rank that prints and writes
    bars = lead and not args.quiet  # progress bars: the model's build and the steps
    out = Path(args.out)
    # An error on one rank stops every rank here, before anything runs.
    with distributed.checked_together("the training set-up") as same:
        _check_args(args)
        if args.shard_state and ranks == 1:
            raise ValueError("--shard-state shards the state across the ranks of an mpirun; with one process there is "
                             "nothing to shard: run it under mpirun -n N (N > 1), or leave --shard-state out")
        one_batch = flags.one_batch_per_step(args)
        schedule_note = (f" ({args.grad_accum_steps} micro-batches of {args.batch_size} through each layer together)"
                         if one_batch is not args else "")
        args = one_batch
        rows = distributed.DEFAULT_OWNERSHIP.batch_rows(args.batch_size, rank, ranks)
        batch_size = rows.stop - rows.start  # this rank's sequences per micro-batch
        if lead:
            held.enter_context(run_dir.lock(out))
            for stale in checkpoint.remove_stale_temporaries(out):
                print(f"note: removed {stale}, left by a checkpoint write that was cut short", file=sys.stderr)
            run_dir.check_outputs(out, resume=args.resume, overwrite=args.overwrite,
                                      exports={"--export-hf": args.export_hf, "--export-lora": args.export_lora},
                                      sources={"--init-from-hf": args.init_from_hf, "--init-lora": args.init_lora})
        if args.data is None and ranks > 1:  # rank 0 prepares the built-in corpus (once), the others wait
            try:
                if lead:
                    data_mod.ensure_default_dataset(progress=not args.quiet)
            finally:
                distributed.wait_for_every_rank("the preparation of the built-in corpus")
        train_data, val_data = _load_data(args)
        finetune = flags.finetune_settings(args)
        resume_from = checkpoint.latest(out) if args.resume else None
        if args.resume and resume_from is None:
            raise ValueError(f"--resume: no checkpoint in {out}")
        record = checkpoint.read_state(resume_from) if resume_from else None
        base = _resumed_base(resume_from, record, args, finetune) if record else _base(args)
        gone = args.init_from_hf and not Path(args.init_from_hf).exists()  # accepted above for a full fine-tune only
        config = _config(args, train_data.vocab_size, resume_from if record and gone else None)

        limits = flags.limits(args)
        spec, tiles_note = planning.fit(flags.step_spec(args, config, batch_size=batch_size, finetune=finetune,
                                                        shards=ranks if args.shard_state else 1), limits)
        runtime_settings = flags.runtime_settings(args)
        if args.shard_state:  # the plan says whether the parameters a rank fetches are kept (planning.fit)
            runtime_settings.update(shard_state=True, shard_keep_fetched=spec.keep_fetched)
        runtime_config = dataclasses.replace(flags.runtime_config(args), **runtime_settings)
        config = spec.config
        plan = planning.plan(spec, workers=limits.workers, gpu_mb=limits.gpu_mb)
        # Refuses early (MemoryPlanError, a ValueError) when the step cannot run under the limit.
        verdict = plan.check(limits)
        resumed_step = record["step"] if record else 0
        exports = args.export_hf or args.export_lora
        if exports and resumed_step > args.steps:
            raise ValueError(f"{resume_from} is at step {resumed_step}, past --steps {args.steps}: give --steps "
                             f"{resumed_step} to export it")
        same.update(_same_on_every_rank(args, config, train_data))
    if args.shard_state:
        _require_one_out(out)
    if resumed_step >= args.steps and not exports:  # at --steps with exports: they are written from the checkpoint
        if lead:
            print(f"nothing to do: {resume_from} is at step {resumed_step} and --steps is {args.steps}; give a larger "
                  "--steps to train further", flush=True)
        return {"interrupted": False, "step": resumed_step, "losses": []}
    if runtime_settings and runtime_config != jnntile.runtime.config():
        jnntile.runtime.stop()
        jnntile.runtime.configure(**runtime_settings)
    jnntile.runtime.start()

    # A checkpoint holds every parameter, except under LoRA, and a quantized frozen base is not read back from
    # it: the frozen base comes from where it came from.
    restores_all = resume_from is not None and not finetune.rebuilds_base

    def make_model():
        if args.init_from_hf and not restores_all:
            return families.from_hf(args.init_from_hf, batch_size=batch_size, seq_len=args.seq_len, seed=args.seed,
                                    progress=bars, **{k: getattr(config, k) for k in config.execution_field_names()})
        with nn.uninitialized() if restores_all else contextlib.nullcontext():  # no initial values to overwrite
            return families.build(config, batch_size=batch_size, seq_len=args.seq_len, seed=args.seed,
                                  progress=bars and not restores_all)

    with distributed.sharded_state():  # with --shard-state: each tile of the model, frozen or not, on one rank
        model, lora_settings = finetune.build(make_model, config.dtype, args.seed)
    if args.init_lora and resume_from is None:
        base = args.init_from_hf or args.model
        named = lora.other_base(args.init_lora, base)
        if named is not None and lead:  # the shapes may match all the same: nothing else would tell
            print(f"warning: --init-lora {args.init_lora} was trained on {named} (its adapter_config.json's "
                  f"base_model_name_or_path), not on {base}; its adapters may not suit this base model",
                  file=sys.stderr, flush=True)
        lora.load_peft(model, args.init_lora)
    tx, schedule = _make_optimizer(args)
    graphdef, params, frozen = step_mod.split(model, finetune)
    opt_state = tx.init(params)
    start_step = 0
    metrics_path = out / "metrics.jsonl"
    if resume_from is not None:
        opt_state, record = checkpoint.restore(resume_from, model=model, opt_state=opt_state, finetune=finetune)
        graphdef, params, frozen = step_mod.split(model, finetune)
        start_step = record["step"]
        if lead:
            run_dir.truncate_metrics(metrics_path, start_step)
    elif lead:
        run_dir.remove_run(out)

    train_step, eval_step = step_mod.make_steps(graphdef, tx, args.grad_accum_steps, args.fused_update)
    if lead:
        if tiles_note:
            print(tiles_note, flush=True)
        batch = f"batch {args.batch_size} x {args.seq_len}" + (
            f" x {args.grad_accum_steps} micro-batches per step" if args.grad_accum_steps > 1 else "") + (
            f" ({batch_size} per rank)" if ranks > 1 else "") + schedule_note
        source = args.init_from_hf or args.model
        print(f"{config.describe()} ({source}); tiles {model.tiles}; {batch}; StarPU: "
              f"{jnntile.runtime.describe()} (planned peak {plan.peak / 2**20:.0f} MB{' per rank' if ranks > 1 else ''}: "
              f"{verdict})",
              flush=True)
        if isinstance(train_data, data_mod.ExampleDataset):
            print(_examples_summary(train_data, args), flush=True)

    tokens_per_step = args.grad_accum_steps * args.batch_size * args.seq_len
    sharded = distributed.sharding()  # every rank then takes part in what reads the state: saves, exports, samples

    def save(step):
        state = {"data_position": step * tokens_per_step, "data_order": args.data_order,
                 "rng": {"seed": args.seed,
                         "dropout_seed_of_next_step":
                             int(step_mod.dropout_seed(args.seed, step * args.grad_accum_steps))},
                 "args": {k: v for k, v in vars(args).items() if k != "quiet"}, "base": base}
        with _signals_deferred(stop_requested, f"the checkpoint of step {step}"):
            return checkpoint.save(out, model=step_mod.merged(graphdef, params, frozen), opt_state=opt_state,
                                   step=step, state=state, finetune=finetune)

    losses = []
    step = start_step
    stop_requested = []  # the signals that asked the run to stop
    swapping = bool(jnntile.runtime.config().swap_dir)
    bar = tqdm(total=args.steps, initial=start_step, disable=not bars, unit="step", dynamic_ncols=True)
    # Ctrl-C only asks to stop: the step in flight updates tiles in place, so it
    # must finish (and be recorded) before the checkpoint is written.
    def request_stop(signum, frame):
        if stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt(f"step {step} did not finish; "
                                    + (run_dir.standing_checkpoint(out) if lead else "rank 0 says which checkpoint stands"))
        stop_requested.append(signum)

    # SIGTERM, which batch schedulers and container runtimes send, stops the run the same way.
    previous_handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with (metrics_path if lead else Path(os.devnull)).open("a") as metrics:
            stopping = False
            while step < args.steps and not stopping:
                batch = _step_batch(train_data, step, args)
                # Every rank counts the whole step's targets and tokens (padding is no token) from its batch.
                step_targets = int(step_mod.count_targets(batch[1]).sum())
                tokens = tokens_per_step if batch[2] is None else int(np.count_nonzero(batch[2]))
                idx, targets, segments, positions = (None if a is None else distributed.local_rows(a, axis=1)
                                                     for a in batch)
                swapped_before = jnntile.runtime.swap_bytes() if swapping else None
                started = time.perf_counter()
                seeds = step_mod.dropout_seeds(args.seed, step, args.grad_accum_steps)
                params, opt_state, loss = train_step(params, opt_state, idx, targets, seeds, frozen, segments,
                                                     positions, step_targets)
                # The one blocking read of the step; with several ranks, the mean of theirs (and whether
                # any rank was asked to stop, so that all stop after the same step).
                loss, stopping = distributed.mean_and_any(float(loss), bool(stop_requested), "the loss")
                seconds = time.perf_counter() - started
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr or enable --grad-clip")
                row = {"step": step, "loss": loss, "lr": float(schedule(step)), "tokens_per_s": tokens / seconds,
                       "seconds": seconds}
                if swapping:  # what moved while the step ran (an update still running counts in the next step)
                    written, read = (now - before for now, before in zip(jnntile.runtime.swap_bytes(), swapped_before))
                    row.update(swap_written_mb=written / 2**20, swap_read_mb=read / 2**20,
                               swap_peak_used_mb=jnntile.runtime.swap_peak_used_bytes() / 2**20)
                if args.eval_interval and val_data is not None and ((step + 1) % args.eval_interval == 0
                                                                    or step + 1 == args.steps):
                    row["val_loss"] = _evaluate(eval_step, params, frozen, val_data, args)
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                losses.append(loss)
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                mem_mb=f"{_memory_in_use_mb():.0f}", refresh=False)
                if args.checkpoint_interval and step % args.checkpoint_interval == 0 and step < args.steps:
                    if lead or sharded:
                        save(step)
                    # Rank 0 alone writes it (sharded: its state.json and `latest`, last), longer than a watchdog
                    # for a large model: the others wait here.
                    distributed.wait_for_every_rank("a checkpoint")
    except OSError as e:  # a full disk; writes through a file object do not name their file
        e.filename = e.filename or str(metrics_path)
        raise
    except RuntimeError as e:
        jnntile.runtime.raise_if_swap_failed(e, f"Step {step} did not finish, and the tiles it updated in place are "
                                                f"not a state to save: {run_dir.standing_checkpoint(out)}")
        raise
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        bar.close()
    if not lead and not sharded:
        return {"interrupted": stopping, "step": step, "losses": losses}
    if stopping:
        path = save(step)
        name = signal.Signals(stop_requested[0]).name if stop_requested else "another rank"
        if lead:
            print(f"\ninterrupted ({name}) at step {step}: checkpoint saved to {path}; continue with --resume",
                  flush=True)
        return {"interrupted": True, "signal": stop_requested[0] if stop_requested else signal.SIGINT, "step": step,
                "losses": losses}
    trained = step > start_step  # else a finished run's checkpoint is exported as it is
    path = save(step) if trained else resume_from
    if trained and lead:
        plot_losses(metrics_path, out / "loss.png")
    final_model = step_mod.merged(graphdef, params, frozen)

    def export(directory, write, copy_from=None):
        with tensorfile.collective_writes():  # sharded: every rank writes its tiles of the weights' files
            if lead:
                run_dir.export(directory, out, step, write, copy_from)
            else:  # rank 0 writes the rest
                write(Path(directory))

    if args.export_lora:
        export(args.export_lora, lambda d: lora.save_peft(final_model, lora_settings, d,
                                                          base_model=args.init_from_hf or args.model))
        if lead:
            print(f"exported LoRA adapters (PEFT) to {args.export_lora}")
    if args.export_hf:
        if lora_settings is not None:
            lora.merge(final_model)
        export(args.export_hf, lambda d: families.save_hf(final_model, d, args.export_dtype), _tokenizer_dir(args))
        if lead:
            print(f"exported Hugging Face checkpoint ({args.export_dtype}{', adapters merged' if lora_settings else ''}) "
                  f"to {args.export_hf}")
    if not lead:  # sharded: after its part in the checkpoint and the exports, its part in the samples' reads
        if trained and args.samples:
            generate_samples(final_model, (val_data, train_data), args)
        return {"interrupted": False, "step": step, "losses": losses}
    if not trained:
        print(f"nothing to train: {path} is at --steps ({step}); its weights were exported")
        return {"interrupted": False, "step": step, "losses": [], "checkpoint": str(path)}
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    summary = {"step": step, "losses": losses, "checkpoint": str(path), "first_loss": rows[0]["loss"] if rows else None,
               "last_loss": rows[-1]["loss"] if rows else None,
               # The first step compiles its programs: its speed counts only when it is the one step.
               "tokens_per_s": float(np.median([r["tokens_per_s"] for r in rows[1:] or rows]))}
    rate = summary["tokens_per_s"]
    rate = f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}"  # a slow model's rate is not 0
    speed = f"median {rate} tokens/s" if len(rows) > 1 else f"{rate} tokens/s in its one step, compilation included"
    print(f"done: {step} step{'s' if step != 1 else ''}, loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, "
          f"{speed}; metrics in {metrics_path}, curve in {out / 'loss.png'}")
    if args.samples:
        for i, text in enumerate(generate_samples(final_model, (val_data, train_data), args)):
            print(f"--- sample {i} ---\n{text}")
    return summary


@contextlib.contextmanager
def _signals_deferred(requests: list, what: str):
    """Ctrl-C and SIGTERM while `what` is written are added to `requests` instead of cutting the write short
    (which would leave no checkpoint of the steps since the last one)."""
    def defer(signum, frame):
        requests.append(signum)
        print(f"\n{signal.Signals(signum).name}: {what} is being written; it is finished first", file=sys.stderr,
              flush=True)

    previous = {sig: signal.signal(sig, defer) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None) -> int:
    # Outside the training loop (which checkpoints first), SIGTERM exits through Python's own exit, so
    # that the runtime's exit handler stops StarPU and removes the swap files.
    jnntile.runtime.exit_on_sigterm()
    args = parse_args(argv)
    try:
        summary = train(args)
    except distributed.SetUpError as e:  # raised on every rank, before anything ran: each one says it
        print(f"error: {e}", file=sys.stderr, flush=True)
        distributed.wait_for_every_rank("the report of a set-up error")  # mpirun ends them all at the first exit
        return 2
    except (ValueError, FileNotFoundError, FloatingPointError, jnntile.runtime.SwapFailure) as e:
        print(f"error{_on_rank()}: {e}", file=sys.stderr)
        return _end_every_rank(2)
    except OSError as e:  # a full or read-only disk under --out, --swap-dir or --export-hf
        where = f" ({e.filename})" if e.filename else ""
        print(f"error{_on_rank()}: {e.strerror or e}{where}: free space there or choose another directory",
              file=sys.stderr)
        return _end_every_rank(2)
    except KeyboardInterrupt as e:  # Ctrl-C outside the training loop, or a second one inside a step
        print(f"interrupted{_on_rank()}{f': {e}' if str(e) else ''}", file=sys.stderr)
        return _end_every_rank(128 + signal.SIGINT)
    except BaseException:
        if jnntile.runtime.world_size() > 1:
            traceback.print_exc()
            _end_every_rank(1)
        raise
    # As a shell reports a process ended by a signal: 130 after SIGINT, 143 after SIGTERM.
    return 128 + int(summary.get("signal", signal.SIGINT)) if summary.get("interrupted") else 0


def _on_rank() -> str:
    return f" on rank {jnntile.runtime.rank()}" if jnntile.runtime.world_size() > 1 else ""


def _end_every_rank(code: int) -> int:
    """After an error on this rank alone: the other ranks would wait for its tiles until their watchdog
    fires, so end them all now (mpirun names this rank). On one process, returns `code`."""
    if jnntile.runtime.world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        jnntile.runtime.abort(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
