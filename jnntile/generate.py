"""Continue prompts with a language model on tiled tensors: `python -m jnntile.generate`.

    python -m jnntile.generate --checkpoint out --prompt "def main(" --max-new-tokens 100
    python -m jnntile.generate --hf gpt2_dir --prompt "Hello" --prompt "Tiles are" --temperature 0
    python -m jnntile.generate --hf llama_dir --lora adapter_dir --prompt "Hello"
    python -m jnntile.generate --hf llama_dir --system "Answer briefly." --chat "What is a tile?"

Weights come from a checkpoint of `python -m jnntile.train` (a ckpt-* directory,
or a training --out directory for its latest checkpoint) or from a Hugging Face
checkpoint directory of a supported family (--hf below lists them; its
config.json's model_type tells), and stay StarPU tiles under the memory limit and swap given
here, as in training: the model may be larger than RAM. With --dtype bfloat16 the
projection weights are stored in bfloat16 alone (nothing updates them, so no
float32 copy is kept). --lora applies PEFT LoRA adapters (of `train --export-lora`,
a LoRA run's checkpoint, or PEFT's save_pretrained) unmerged. The prompts are decoded
together with a key/value cache (jnntile.decoding). The texts
(prompt and continuation) go to stdout; progress and speed go to stderr.

--chat MESSAGE is a conversation of one user message (with --system's before it),
rendered with the model's chat template and its generation prompt and tokenized
as python -m jnntile.data tokenizes conversations; its reply stops at the
template's end-of-turn token, and only the reply is printed.

The tokenizer is the training data's for a checkpoint, the directory's own
(tokenizer.json, or vocab.json and merges.txt) for --hf, or --tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer, Tokenizer
from tqdm import tqdm

import jnntile
from jnntile.data import chat
from jnntile.training import checkpoint, lora
from jnntile.models import decoding
from jnntile import flags, nn, planning
from jnntile import data as data_mod
from jnntile.models import families

DEFAULTS = dict(max_new_tokens=50, temperature=0.8, top_k=40, seed=0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jnntile.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a checkpoint of python -m jnntile.train (ckpt-* directory, or its --out directory)")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory (config.json and "
                        f"safetensors weights) of {families.TITLES}")
    p.add_argument("--lora", metavar="DIR", help="apply the LoRA adapters of a PEFT directory (adapter_config.json, "
                   "adapter_model.safetensors) to the model, unmerged; a LoRA run's --out: its latest checkpoint's")
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompt", action="append", metavar="TEXT",
                        help="text to continue; repeat for several prompts, decoded as one batch")
    inputs.add_argument("--chat", action="append", metavar="MESSAGE",
                        help="a user message to reply to with the model's chat template; repeat for several "
                             "conversations, decoded as one batch; each reply ends at the end-of-turn token")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each user message")
    chat.add_chat_template_flag(p)
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.json, or a directory with tokenizer.json or vocab.json and merges.txt")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"], help="tokens per prompt")
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"], help="0: greedy")
    p.add_argument("--top-k", type=int, default=DEFAULTS["top_k"], help="sample among the k likeliest; 0: all")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    flags.add_runtime_flags(p)
    flags.add_execution_flags(p, training=False)
    flags.add_quantize_flag(p, "the model's projection weights")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.chat is None and (args.system is not None or args.chat_template is not None):
        p.error("--system and --chat-template apply to conversations: give --chat MESSAGE, not --prompt")
    return args


# ---- where the weights and the tokenizer are -------------------------------------------

def _weights_dir(args) -> Path:
    """The directory holding config.json and model.safetensors."""
    if args.hf:
        path = Path(args.hf)
        if not path.is_dir():
            raise FileNotFoundError(f"--hf {path}: no such directory")
        return path
    path = Path(args.checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {path}: no such directory")
    if not (path / "state.json").is_file():
        latest = checkpoint.latest(path)
        if latest is None:
            raise ValueError(f"--checkpoint {path} is not a jnntile checkpoint: it has neither state.json (a ckpt-* "
                             f"directory) nor a '{checkpoint.LATEST}' file (a training --out directory); pass one of "
                             "those, or --hf DIR for a Hugging Face checkpoint directory")
        path = latest
    if (path / lora.ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        base = checkpoint.read_state(path).get("args", {}).get("init_from_hf") or "BASE"
        raise ValueError(f"--checkpoint {path} holds LoRA adapters, not a model: give the base and the adapters, "
                         f"--hf {base} --lora {path}")
    return path


def _adapters_dir(path) -> Path:
    """--lora's PEFT directory: a LoRA run's --out directory stands for its latest checkpoint, as for --checkpoint."""
    path = Path(path)
    if not (path / lora.ADAPTER_CONFIG).is_file() and (path / checkpoint.LATEST).is_file():
        return checkpoint.latest(path) or path
    return path


def _read_config(weights: Path, args):
    return families.read_config(weights, **flags.execution_settings(args))


def _tokenizer_candidates(args, weights: Path) -> list[Path]:
    if args.tokenizer:
        return [Path(args.tokenizer)]
    if args.hf:
        return [weights]
    # The training data's tokenizer lies beside its token file (or in its dataset directory).
    data = checkpoint.read_state(weights).get("args", {}).get("data")
    if data is None:
        return [data_mod.default_dataset_dir()]
    data = Path(data)
    return [data if data.is_dir() else data.parent]


def load_tokenizer(args, weights: Path):
    """A `tokenizers` tokenizer (encode(text).ids, decode(ids)); raises naming where it looked."""
    looked = []
    for path in _tokenizer_candidates(args, weights):
        if path.is_file():
            return Tokenizer.from_file(str(path))
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_file(str(path / "tokenizer.json"))
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
        looked.append(str(path))
    raise FileNotFoundError(f"no tokenizer in {', '.join(looked)} (tokenizer.json, or vocab.json and merges.txt): "
                            "pass --tokenizer PATH")


# ---- what the model is fed --------------------------------------------------------------

@dataclasses.dataclass
class Prompts:
    """The prompts' token ids, their flags as messages name them (--prompt 'text'), and the ids a continuation
    stops at (a chat template's end of turn; none for --prompt)."""

    ids: list[list[int]]
    labels: list[str]
    stop: frozenset[int] = frozenset()


def _template_dirs(args, weights: Path) -> list[Path]:
    """Where the chat template may be: the tokenizer's directory, then a checkpoint's base model (--init-from-hf)."""
    dirs = [path if path.is_dir() else path.parent for path in _tokenizer_candidates(args, weights)]
    if args.checkpoint:
        base = checkpoint.read_state(weights).get("args", {}).get("init_from_hf")
        dirs += [Path(base)] if base else []
    return dirs


def load_template(args, weights: Path) -> chat.ChatTemplate:
    """The chat template --chat renders with (--chat-template's, else the model's); raises naming the flag."""
    dirs = _template_dirs(args, weights)
    for path in dirs:
        template = chat.load_chat_template(path, args.chat_template)
        if template is not None:
            return template
    raise ValueError(f"--chat needs a chat template, and {', '.join(map(str, dirs))} has none "
                     f"({chat.CHAT_TEMPLATE_FILE}, or {chat.TOKENIZER_CONFIG_FILE}'s chat_template): give one with "
                     "--chat-template FILE, or continue text with --prompt")


def _eos_ids(path: Path) -> list[int]:
    """generation_config.json's eos_token_id (an id, or a list of them) in `path`, if any."""
    try:
        value = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]


def end_of_turn_ids(template: chat.ChatTemplate, tokenizer, dirs: list[Path]) -> frozenset[int]:
    """The ids a reply ends at, as transformers' generate stops: the template's eos_token, the eos_token_id of
    generation_config.json in `dirs`, and the special token the template writes after an assistant's turn (Llama
    3's <|eot_id|>, ChatML's <|im_end|>, which a model whose eos_token is another ends its replies with)."""
    ids = {tokenizer.token_to_id(template.special_tokens.get("eos_token", ""))}
    ids.update(i for path in dirs for i in _eos_ids(path))
    user, reply = {"role": "user", "content": "Hi"}, "Hello"
    prompt, _ = template.render([user], add_generation_prompt=True)
    text, _ = template.render([user, {"role": "assistant", "content": reply}])
    if text.startswith(prompt + reply):
        after = tokenizer.encode(text[len(prompt) + len(reply):], add_special_tokens=False).ids[:1]
        special = tokenizer.get_added_tokens_decoder()
        ids.update(i for i in after if i in special and special[i].special)
    return frozenset(ids - {None})


def encode_prompts(args, weights: Path, tokenizer) -> Prompts:
    """The prompts of --prompt (tokenized text), or of --chat (conversations rendered with the chat template and
    its generation prompt, tokenized as python -m jnntile.data tokenizes them, with their end-of-turn ids)."""
    if args.chat is None:
        return Prompts([tokenizer.encode(text).ids for text in args.prompt],
                       [f"--prompt {text!r}" for text in args.prompt])
    template = load_template(args, weights)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    ids = [template.encode(tokenizer, system + [{"role": "user", "content": message}], add_generation_prompt=True)[0]
           for message in args.chat]
    return Prompts(ids, [f"--chat {message!r}" for message in args.chat],
                   end_of_turn_ids(template, tokenizer, [weights, *_template_dirs(args, weights)]))


# ---- checks before anything is loaded ---------------------------------------------------

def _check_args(args) -> None:
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be positive")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature={args.temperature} must be 0 (greedy) or positive")
    if args.top_k < 0:
        raise ValueError(f"--top-k={args.top_k} must be positive, or 0 for the whole vocabulary")


def _check_lengths(prompts: Prompts, args, config) -> int:
    """The cache length the prompts need (positions read by the model); raises when beyond the model's."""
    for label, ids in zip(prompts.labels, prompts.ids):
        if not ids:
            raise ValueError(f"{label} gives no tokens: every prompt needs at least one")
        if max(ids) >= config.vocab_size:
            raise ValueError(f"{label} gives token id {max(ids)}, outside the model's vocabulary of "
                             f"{config.vocab_size}: is the tokenizer the model's? (--tokenizer)")
    longest = max(len(p) for p in prompts.ids)
    needed = longest + args.max_new_tokens - 1
    if needed > config.max_positions:
        most = config.max_positions - longest + 1
        raise ValueError(f"the longest prompt ({longest} tokens) and --max-new-tokens={args.max_new_tokens} need "
                         f"{needed} positions, beyond the model's {config.max_positions}: use "
                         + (f"--max-new-tokens {most} or less" if most > 0 else "a shorter prompt"))
    return needed


def _check_memory(config, batch: int, length: int, limit_mb: int, swap_mb: int) -> None:
    """Refuses a model whose weights and cache exceed the memory limit plus swap (they live in tiles)."""
    weights = 4 * config.n_params()
    cache = config.kv_cache_bytes(batch, length)
    if weights + cache > (limit_mb + swap_mb) * 2**20:
        raise ValueError(f"the weights ({weights / 2**20:.0f} MB) and the key/value cache ({cache / 2**20:.0f} MB) "
                         f"exceed the memory limit of {limit_mb} MB" + (f" plus {swap_mb} MB of swap" if swap_mb else "")
                         + ": raise --memory-limit-mb, or add --swap-dir (and --swap-size-mb)")


def _fit_tiles(config, batch: int, length: int, limits: planning.Limits) -> tuple[object, str]:
    """`config` with tiles whose largest tasks fit the memory `limits`, and a note when automatic ones were shrunk
    (as train chooses them); raises naming the tile flags when no tiles fit.

    Decoding runs the training forward's tasks over the cache's positions. The planner's step, with SGD (whose
    update adds no state), also runs the backward's tasks, which are no smaller: tiles that fit it fit decoding.
    """
    config = dataclasses.replace(config, tile_batch=config.tile_batch or batch)  # the decoder's default batch tile
    limit_mb, gpu_mb = limits.memory_limit_mb, limits.gpu_mb
    spec = planning.StepSpec(config, batch, length, optimizer="sgd")
    memory_plan = planning.plan(spec, workers=limits.workers, gpu_mb=gpu_mb)
    problem = memory_plan.task_fit_problem(limit_mb, gpu_mb)
    if problem is None:
        return config, ""
    fitted, note = planning.fit_tiles(spec, limits)
    fitted = fitted.config
    if note:
        shrunk = ", ".join(f"{axis} {getattr(memory_plan.tiles, axis)} -> {getattr(fitted, f'tile_{axis}')}"
                           for axis in dataclasses.asdict(memory_plan.tiles)
                           if getattr(fitted, f"tile_{axis}") not in (None, getattr(memory_plan.tiles, axis)))
        return fitted, f"automatic tiles shrunk ({shrunk}) so that every task fits the memory limits"
    hint = memory_plan.suggest_tiles(limit_mb, gpu_mb)
    raise ValueError(f"cannot generate with these tiles: {problem}; give smaller tiles{f' ({hint})' if hint else ''} "
                     "or raise --memory-limit-mb" + (" (or --gpu-memory-limit-mb)" if gpu_mb else ""))


# ---- main -------------------------------------------------------------------------------

def generate(args) -> list[str]:
    """Runs generation as configured by `args`; returns the texts. Raises ValueError on bad input."""
    _check_args(args)
    adapters_dir = _adapters_dir(args.lora) if args.lora else None
    adapters = lora.read_settings(adapters_dir) if adapters_dir else None  # checked before anything is loaded
    weights = _weights_dir(args)
    config = _read_config(weights, args)
    tokenizer = load_tokenizer(args, weights)
    prompts = encode_prompts(args, weights, tokenizer)
    length = _check_lengths(prompts, args, config)
    B = len(prompts.ids)

    settings = flags.runtime_settings(args)
    runtime_config = dataclasses.replace(jnntile.runtime.config(), **settings)
    runtime_config.validate()
    limits = planning.Limits.of(runtime_config)
    _check_memory(config, B, length, limits.memory_limit_mb, limits.swap_mb)
    config, tiles_note = _fit_tiles(config, B, length, limits)
    if runtime_config != jnntile.runtime.config():
        jnntile.runtime.stop()
        jnntile.runtime.configure(**settings)
    jnntile.runtime.start()

    started = time.perf_counter()
    tiles = {k: getattr(config, k) for k in config.execution_field_names()}
    # Nothing updates a weight here: a bfloat16 one needs no float32 master, and any may be quantized.
    with nn.base_dtype(config.dtype), nn.quantized_base(flags.quantize_base(args)):
        model = families.from_hf(weights, batch_size=B, seq_len=length, progress=not args.quiet, **tiles)
    if adapters is not None:
        lora.apply(model, adapters)
        lora.load_peft(model, adapters_dir)
    decoder = decoding.Decoder(model, batch_size=B, max_len=length)
    log = sys.stderr
    if tiles_note:
        print(tiles_note, file=log, flush=True)
    print(f"{config.describe()} from {weights}, loaded in "
          f"{time.perf_counter() - started:.1f} s; tiles {model.tiles}; StarPU: {jnntile.runtime.describe()}",
          file=log, flush=True)

    started = time.perf_counter()
    done_at = {}  # positions done -> time

    def progress(done):
        done_at[done] = time.perf_counter()
        bar.update(done - bar.n)

    with tqdm(total=length, disable=args.quiet, unit="pos", file=log, dynamic_ncols=True) as bar:
        try:
            continuations = decoder.generate(prompts.ids, args.max_new_tokens, temperature=args.temperature,
                                             top_k=args.top_k or None, seed=args.seed, stop=prompts.stop,
                                             progress=progress)
        except RuntimeError as e:
            jnntile.runtime.raise_if_swap_failed(e)
            raise
    seconds = time.perf_counter() - started
    print(f"{sum(map(len, continuations))} new tokens ({B} x at most {args.max_new_tokens}) in {seconds:.2f} s "
          "with compilation", file=log, end="")
    # Steady decoding: the steps after the first, which compiled the step program (the last ends early once every
    # reply reached its end of turn).
    first = decoder.prefill_length([len(p) for p in prompts.ids]) + 1
    last = max(done_at)
    if last > first:
        steps_per_s = (last - first) / (done_at[last] - done_at[first])
        print(f"; decoding {steps_per_s:.1f} steps/s x {B} sequences = {steps_per_s * B:.1f} tokens/s",
              file=log, end="")
    print(file=log, flush=True)
    if args.chat is not None:  # the reply alone, without its end-of-turn token
        return [tokenizer.decode(c[:-1] if c and c[-1] in prompts.stop else c) for c in continuations]
    return [tokenizer.decode(p + c) for p, c in zip(prompts.ids, continuations)]


def main(argv=None) -> int:
    jnntile.runtime.exit_on_sigterm()  # so that the exit handler removes the swap files
    args = parse_args(argv)
    try:
        texts = generate(args)
    except (ValueError, FileNotFoundError, jnntile.runtime.SwapFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i} ---")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
