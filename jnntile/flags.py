"""The command-line flags that `train`, `generate` and `memory` share, defined once with their defaults.

Runtime flags map one to one onto `jnntile.runtime.RuntimeConfig` fields; a flag left out keeps the
runtime's default (stated in RuntimeConfig). Execution flags map onto the model config's tile_* fields,
its `dtype` and its `remat`. `step_spec` and `limits` build what the memory planner plans (a StepSpec) and under
what (Limits) from the flags, for every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from jnntile.training import optim
from jnntile.core import runtime
from jnntile.models import COMPUTE_DTYPES, REMAT_CHOICES, TILE_AXES, families
from jnntile.planning import Limits, StepSpec

# --swap-size-mb and --swap-backend count only with --swap-dir (runtime_settings); the planner reads --swap-size-mb
# alone as a what-if.
_SWAP_FIELDS = ("swap_dir", "swap_size_mb", "swap_backend")


def _runtime_flag_fields() -> list[dataclasses.Field]:
    """The RuntimeConfig fields that are flags (`jnntile.runtime.setting(..., flag=help)`), in their order."""
    return [f for f in dataclasses.fields(runtime.RuntimeConfig) if f.metadata.get("flag")]


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """A flag --<field> for every RuntimeConfig field that declares one, with the help written beside its default."""
    types = {"int": int, "float": float, "str": str, "str | None": str}
    for field in _runtime_flag_fields():
        name, kind = "--" + field.name.replace("_", "-"), str(field.type)
        if kind == "bool":
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=field.metadata["flag"])
        else:
            parser.add_argument(name, type=types[kind], choices=field.metadata["choices"], help=field.metadata["flag"])


def runtime_settings(args) -> dict:
    """The `jnntile.runtime.configure(**settings)` the flags ask for (only those given)."""
    settings = {f.name: getattr(args, f.name) for f in _runtime_flag_fields()
                if f.name not in _SWAP_FIELDS and getattr(args, f.name, None) is not None}
    if getattr(args, "swap_dir", None):
        settings["swap_dir"] = args.swap_dir
        for name in ("swap_size_mb", "swap_backend"):
            if getattr(args, name, None) is not None:
                settings[name] = getattr(args, name)
    return settings


def runtime_config(args) -> runtime.RuntimeConfig:
    """The runtime's configuration with the runtime flags given, checked (`RuntimeConfig.validate`); an error
    about a setting the flags gave names its flag."""
    settings = runtime_settings(args)
    config = dataclasses.replace(runtime.config(), **settings)
    try:
        config.validate()
    except ValueError as e:
        named = {name: value for name, value in settings.items() if str(e).startswith(f"{name}=")}
        raise naming_flags(e, named) from None
    return config


def naming_flags(error: ValueError, given: dict, fields: dict | None = None) -> ValueError:
    """`error` led by the flags that made it: `given` maps their attribute names to values (None: not given),
    `fields` the names of those that set a config field of another name to it (which `error` may name)."""
    def flag(name, value):
        field = (fields or {}).get(name, name)
        return f"--{name.replace('_', '-')} {value}" + (f" ({field})" if field != name else "")

    named = " ".join(flag(name, value) for name, value in given.items() if value is not None)
    return ValueError(f"{named}: {error}") if named else error


def check_values(args, finite=(), positive=(), non_negative=(), hints=None) -> None:
    """Refuses the flags (by attribute name; absent or None ones pass) of `finite` that are NaN or infinite, of
    `positive` that are not positive, of `non_negative` that are negative; the message names the flag and
    its value, then `hints[name]` where given."""
    def refuse(name, problem):
        raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} {problem}{(hints or {}).get(name, '')}")

    values = {name: getattr(args, name, None) for name in (*finite, *positive, *non_negative)}
    for name in finite:
        if values[name] is not None and not math.isfinite(values[name]):
            refuse(name, "must be a finite number")
    for name in positive:
        if values[name] is not None and values[name] <= 0:
            refuse(name, "must be positive")
    for name in non_negative:
        if values[name] is not None and values[name] < 0:
            refuse(name, "must not be negative")


def check_step_flags(args) -> None:
    """Refuses what no step runs with, in the flags that `train` and `memory` share: the batch, the sequence,
    clipping, dropout, and the runtime's settings (`runtime_config`). Both commands call it, so the planner
    refuses what training would."""
    check_values(args, finite=("grad_clip", "dropout"), positive=("batch_size", "grad_accum_steps", "seq_len"),
                 non_negative=("grad_clip",))
    runtime_config(args)


SIZE_FLAGS = ("n_layer", "n_head", "n_embd")  # the generic size flags (families.size_overrides)


def preset_config(args, **fields):
    """The config of preset --model with the size flags and --dropout given, and `fields` (other config fields by
    name): a config the family cannot take (the config's own checks) is refused naming those flags."""
    sizes = {name: getattr(args, name, None) for name in SIZE_FLAGS}
    overrides = families.size_overrides(args.model, **sizes)
    dropout = getattr(args, "dropout", None)
    if dropout is not None:
        overrides["dropout"] = dropout
    try:
        return families.preset(args.model, **overrides, **fields)
    except ValueError as e:
        raise naming_flags(e, {"model": args.model, **sizes, "dropout": dropout},
                           families.PRESETS[args.model].config.FLAG_FIELDS) from None


def add_execution_flags(parser: argparse.ArgumentParser, training: bool = True) -> None:
    """The tile flags, --dtype, and --remat where a command trains (`training`)."""
    for axis in TILE_AXES:
        parser.add_argument(f"--tile-{axis}", type=int, help=f"tile size on the {axis} axis (default: automatic)")
    parser.add_argument("--dtype", choices=COMPUTE_DTYPES,
                        help="compute dtype: bfloat16 makes activations and the weights' compute copies bfloat16, "
                             "the parameters, their gradients and the optimizer state stay float32 (default: "
                             "float32)")
    if not training:
        return
    parser.add_argument("--remat", choices=REMAT_CHOICES,
                        help="activation recomputation: block keeps only each transformer block's input for the "
                             "backward and recomputes the block there; auto lets the memory planner choose (default: "
                             "auto with --memory-limit-mb, else none)")


GRAD_ACCUM_SCHEDULES = ("micro-batch", "layer")


def add_batch_flags(parser: argparse.ArgumentParser, batch_size: int) -> None:
    """A step's batch: sequences per micro-batch, micro-batches per step, and the order they run in."""
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help="sequences per micro-batch (the batch of one step, unless --grad-accum-steps)")
    parser.add_argument("--grad-accum-steps", type=int, default=1,
                        help="micro-batches per step: a step sees batch-size x this many sequences, then one update "
                             "runs (default: 1)")
    parser.add_argument("--grad-accum-schedule", choices=GRAD_ACCUM_SCHEDULES, default="micro-batch",
                        help="micro-batch: each micro-batch runs its forward and backward before the next and adds "
                             "its gradients, scaled by its share of the step's targets (1/N for text), into the tiled gradients "
                             "(memory of one micro-batch); "
                             "layer: the micro-batches go through each layer together, as one batch in tiles of "
                             "--batch-size sequences, so a step reads each weight once instead of once per "
                             "micro-batch (with disk swap: fewer bytes moved; the activations of every micro-batch "
                             "at once, one dropout seed per step) (default: micro-batch)")


PACKING_CHOICES = ("on", "off")


def add_example_flags(parser: argparse.ArgumentParser) -> None:
    """How a dataset of fine-tuning examples fills the --seq-len rows (`jnntile.data.ExampleDataset.batch`)."""
    parser.add_argument("--packing", choices=PACKING_CHOICES, default="on",
                        help="with a dataset of examples: on packs whole examples into each --seq-len row, each "
                             "attending to itself alone; off pads each example to a row of its own (padding is never "
                             "trained) (default: on)")
    parser.add_argument("--no-truncate", action="store_true",
                        help="with a dataset of examples: refuse one longer than --seq-len, instead of training on "
                             "its first --seq-len tokens")


def check_example_flags(args, examples: bool, data: str) -> None:
    """Refuses --packing off and --no-truncate with text data (`examples` False), where they mean nothing: its
    rows are windows of one token stream, all full."""
    given = [flag for flag, on in (("--packing off", args.packing == "off"), ("--no-truncate", args.no_truncate))
             if on]
    if given and not examples:
        raise ValueError(f"{' and '.join(given)} shape a dataset of fine-tuning examples, but {data} is text, whose "
                         "--seq-len windows are always full; leave them out (or prepare examples: `python -m "
                         "jnntile.data FILE.jsonl --tokenizer DIR --out DIR`)")


def one_batch_per_step(args: argparse.Namespace) -> argparse.Namespace:
    """The flags of --grad-accum-schedule layer written as the batch it runs: --grad-accum-steps N micro-batches
    of B sequences become one batch of N x B in tiles of B (--tile-batch, unless given), the same rows; other
    flags, and a micro-batch schedule, are returned as they are."""
    if args.grad_accum_schedule != "layer" or args.grad_accum_steps == 1:
        return args
    return argparse.Namespace(**{**vars(args), "batch_size": args.batch_size * args.grad_accum_steps,
                                 "grad_accum_steps": 1, "tile_batch": args.tile_batch or args.batch_size})


def add_update_flags(parser: argparse.ArgumentParser) -> None:
    """Gradient clipping and how the optimizer update meets the backward (a command that trains or plans it)."""
    parser.add_argument("--grad-clip", type=float, default=1.0, help="global norm (default: 1.0); 0 disables")
    parser.add_argument("--fused-update", choices=optim.FUSED_UPDATE_CHOICES, default="auto",
                        help="update each parameter inside the backward, as soon as its gradient is final, so "
                             "gradients never reach swap; with --grad-clip the update is speculative and committed "
                             "once the norm is known, the new state beside the old until then. auto: on without "
                             "clipping, with clipping only with --swap-dir and not right after a step whose norm "
                             "clipped (default: auto). The results are the same bits either way")
    parser.add_argument("--shard-state", action="store_true",
                        help="under mpirun: give each tile of the parameters (frozen ones too), their gradients and "
                             "their optimizer state one owner rank, which alone holds it, so that each rank holds "
                             "about 1/N of the state; every rank writes its own tiles of each checkpoint "
                             "(docs/distributed.md)")


def update_mode(args) -> str:
    """The `jnntile.optim.update_mode` the flags ask for: "after", "fused" or "speculative"."""
    return optim.update_mode(args.grad_clip > 0, args.fused_update, bool(getattr(args, "swap_dir", None)))


def add_quantize_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--quantize-base", choices=("none", "nf4", "int8"), default="none",
                        help=f"store {what} quantized: nf4 (4-bit NormalFloat, blocks of 64 along each weight's input "
                             "axis, which and whose tiles must be multiples of 64) or int8 (a scale per output row); "
                             "each product dequantizes a tile inside its task (default: none)")
    parser.add_argument("--double-quant", action="store_true",
                        help="with --quantize-base nf4: quantize its absmax scales too, QLoRA's double quantization "
                             "(8-bit codes in blocks of 256 less their mean, as bitsandbytes' compress_statistics): "
                             "about 0.37 fewer bits per weight")


def quantize_base(args) -> str | None:
    """--quantize-base and --double-quant as `nn.quantized_base` takes them: "nf4", "nf4_dq", "int8" or None."""
    if args.double_quant and args.quantize_base != "nf4":
        raise ValueError(f"--double-quant quantizes the scales of NF4 weights, and --quantize-base is "
                         f"{args.quantize_base}: give --quantize-base nf4, or leave --double-quant out")
    if args.quantize_base == "none":
        return None
    return "nf4_dq" if args.double_quant else args.quantize_base


def add_finetune_flags(parser: argparse.ArgumentParser) -> None:
    """What a run trains: every parameter, a selection, or LoRA adapters (`jnntile.lora.FineTune`)."""
    parser.add_argument("--freeze", metavar="REGEX", help="freeze the parameters whose path matches (e.g. "
                        "'wte|wpe|h\\.[0-5]\\.'): no gradient, no optimizer state")
    parser.add_argument("--train-only", metavar="REGEX", help="train only the parameters whose path matches")
    parser.add_argument("--lora-rank", type=int, help="train LoRA adapters of this rank on a frozen base (with "
                        "--dtype bfloat16 the base is stored in bfloat16)")
    add_quantize_flag(parser, "the frozen projection weights (with --lora-rank, --freeze or --train-only)")
    parser.add_argument("--lora-alpha", type=float, help="LoRA scale numerator: updates are scaled by alpha / rank "
                        "(default: twice the rank)")
    parser.add_argument("--lora-dropout", type=float, metavar="P", help="dropout rate of each adapter's input in "
                        "training, PEFT's lora_dropout (default: --init-lora's, else 0)")
    every = "; ".join(f"{','.join(family.hf.LORA_TARGETS)} for {family.title}" for family in families.FAMILIES)
    parser.add_argument("--lora-targets", help=f"comma-separated projections to adapt, PEFT's names, each its own "
                        f"adapter; all-linear; or a regular expression of Hugging Face module paths, as PEFT's "
                        f"target_modules (default: every projection: {every})")
    parser.add_argument("--init-lora", metavar="DIR", help="start the adapters from a PEFT directory (its rank, alpha "
                        "and targets)")


def finetune_settings(args):
    """The `jnntile.lora.FineTune` the flags ask for."""
    from jnntile.training import lora

    settings = None
    targets = args.lora_targets
    if targets and re.fullmatch(r"[\w.,\s]+", targets):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())  # names; all-linear or else a regex
    if getattr(args, "init_lora", None):
        settings = lora.read_settings(args.init_lora)
        for flag, given, saved in (("--lora-rank", args.lora_rank, settings.rank),
                                   ("--lora-alpha", args.lora_alpha, settings.alpha)):
            if given is not None and given != saved:
                raise ValueError(f"{flag} {given:g} differs from {saved:g} in {args.init_lora}; leave it out")
        if targets is not None:
            raise ValueError(f"--lora-targets: the targets of --init-lora {args.init_lora} are its own; leave it out")
        if args.lora_dropout is not None:  # a training setting, not the adapters': the flag may change it
            settings = dataclasses.replace(settings, dropout=args.lora_dropout)
    elif args.lora_rank is not None:
        alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
        settings = lora.LoRASettings(args.lora_rank, alpha, targets, dropout=args.lora_dropout or 0.0)
    elif args.lora_alpha is not None or targets is not None or args.lora_dropout is not None:
        raise ValueError("--lora-alpha, --lora-targets and --lora-dropout need --lora-rank (or --init-lora)")
    return lora.FineTune(freeze=args.freeze, train_only=args.train_only, lora=settings,
                         quantize_base=quantize_base(args))


def execution_settings(args) -> dict:
    """The model config's tile_* fields, dtype and remat the flags set (only those given)."""
    settings = {f"tile_{axis}": getattr(args, f"tile_{axis}") for axis in TILE_AXES
                if getattr(args, f"tile_{axis}", None) is not None}
    if getattr(args, "dtype", None) is not None:
        settings["dtype"] = args.dtype
    if hasattr(args, "remat"):  # a command that trains: recomputation is chosen under a memory limit by default
        remat = args.remat or ("auto" if getattr(args, "memory_limit_mb", None) is not None else None)
        if remat is not None:
            settings["remat"] = remat
    return settings


def step_spec(args, config, **fields) -> StepSpec:
    """The `jnntile.planning.StepSpec` of the step the flags describe on `config`: --batch-size, --seq-len,
    --grad-accum-steps, --optimizer, what trains (`finetune_settings`) and the update mode (`update_mode`);
    `fields` replace what the command knows better (this rank's batch_size, a finetune it read already)."""
    if "finetune" not in fields:
        fields["finetune"] = finetune_settings(args)
    return StepSpec(config, **{"batch_size": args.batch_size, "seq_len": args.seq_len,
                               "grad_accum_steps": args.grad_accum_steps, "optimizer": args.optimizer,
                               "update": update_mode(args), **fields})


def limits(args, what_if: bool = False) -> Limits:
    """The `jnntile.planning.Limits` of the runtime the runtime flags configure (`runtime_config`). `what_if`, for
    the planner's command: --swap-size-mb without --swap-dir plans with that much swap, and
    --gpu-memory-limit-mb with that much GPU memory even where no GPU is."""
    given = Limits.of(runtime_config(args))
    if not what_if:
        return given
    swap = args.swap_size_mb if args.swap_size_mb is not None else given.swap_mb
    gpu = 0 if args.cuda_workers == 0 else args.gpu_memory_limit_mb or given.gpu_mb
    return dataclasses.replace(given, swap_mb=swap, gpu_mb=gpu)
