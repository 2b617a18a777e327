"""LoRA adapters on a model of any family: apply them by target name, read and write them as PEFT does.

`apply(model, settings)` wraps the targeted `nn.Linear`s in `nn.LoRA` (their weights frozen, the
adapters' `nnx.LoRAParam`s trained: `nn.trainable(adapters_only=True)`). Targets are PEFT's names, the
last part of a Hugging Face module path ("q_proj", "c_attn"); each family's `hf.LORA_TARGETS` says which
of its modules holds each one, and its `lora_to_peft` / `lora_from_peft` convert the factors between its
layout and PEFT's (lora_A (rank, in), lora_B (out, rank), one per Hugging Face module).

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors`, as `PeftModel.save_pretrained`
writes them and `peft.PeftModel.from_pretrained(base, directory)` loads them onto the Hugging Face base.
Adapters are small (rank x (in + out) per projection), so they are read and written whole, one at a time.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from flax import nnx

from jnntile.io import jsonfile, tensorfile
from jnntile import nn
from jnntile.models import families
from jnntile.ops import values as values_ops

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


ALL_LINEAR = "all-linear"  # PEFT's target_modules for every linear layer but the output head


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern look-up: the first pattern that matches the end of module `key`."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?{pattern}$", key):
            return value
    return default


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    """rank, alpha (the update is scaled by alpha / rank, or alpha / sqrt(rank) with `rslora`) and the targets as
    PEFT's target_modules: a tuple of module names, "all-linear", or a regular expression (a str) that matches
    Hugging Face module paths whole (None: every projection the family has); `rank_pattern` / `alpha_pattern`
    give modules whose path ends in a pattern their own rank / alpha; `dropout`, PEFT's lora_dropout (the rate
    of the dropout on each adapter's input in training); `source`, the PEFT directory they were read from, if
    any."""

    rank: int
    alpha: float
    targets: tuple[str, ...] | str | None = None
    source: str | None = dataclasses.field(default=None, compare=False)
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)
    rslora: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"--lora-rank {self.rank}: the rank of LoRA adapters must be at least 1")
        if not np.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"--lora-alpha {self.alpha}: must be a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout {self.dropout}: the rate of dropout must be in [0, 1)")
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            try:
                re.compile(self.targets)
            except re.error as error:
                raise ValueError(f"--lora-targets {self.targets!r} is not a regular expression: {error}") from None

    def resolved(self, model) -> "LoRASettings":
        """These settings with the targets checked: names in the family's order (every projection for none or
        "all-linear"); a regular expression as it is."""
        known = _hf_module(model).LORA_TARGETS
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            return self
        targets = tuple(known) if self.targets in (None, ALL_LINEAR) else tuple(self.targets)
        paths = sorted(t for t in targets if "." in t)  # PEFT's module paths ("model.layers.0.self_attn.q_proj")
        if paths:
            targets = tuple(t.rpartition(".")[2] for t in paths)
        unknown = sorted(set(targets) - set(known))
        if unknown and self.source is not None:
            raise ValueError(self._another_architecture(model, targets))
        if unknown or not targets:
            raise ValueError(f"--lora-targets: {', '.join(unknown) or 'none given'}: this model's projections are "
                             f"{', '.join(known)} (or all-linear, or a regular expression of module paths)")
        if paths:
            return dataclasses.replace(self, targets=tuple(paths))
        return dataclasses.replace(self, targets=tuple(t for t in known if t in targets))

    def targets_module(self, key: str) -> bool:
        """Whether Hugging Face module `key` ("model.layers.0.self_attn.q_proj") is a target (of resolved settings)."""
        if isinstance(self.targets, str):
            return re.fullmatch(self.targets, key) is not None
        return any(key == t or key.endswith("." + t) for t in self.targets)  # as PEFT matches a list

    def spec(self, key: str, part: str, rows) -> nn.AdapterSpec:
        """The adapter of Hugging Face module `key`, part `part` of its Linear."""
        return nn.AdapterSpec(part, int(_pattern_value(self.rank_pattern, key, self.rank)),
                              float(_pattern_value(self.alpha_pattern, key, self.alpha)), rows, self.rslora,
                              self.dropout)

    def _another_architecture(self, model, targets) -> str:
        """Why adapters read from `source` cannot go on `model`: their targets are another family's modules."""
        mine = families.of_config(model.config)
        theirs = [f.name for f in families.FAMILIES if f is not mine and set(targets) <= set(f.hf.LORA_TARGETS)]
        whose = f"the projections of a {' or '.join(theirs)} model" if theirs else "modules this model does not have"
        return (f"the adapters in {self.source} are of {', '.join(targets)}, {whose}: they were trained on "
                f"another architecture than this {mine.name} model (whose projections are "
                f"{', '.join(mine.hf.LORA_TARGETS)}); give adapters trained on this base model")


def _hf_module(model):
    return families.of_config(model.config).hf


def adapters(model) -> dict[str, nn.LoRA]:
    """The model's LoRA modules by path ("layers.0.self_attn.qkv_proj")."""
    return {".".join(str(p) for p in path): module for path, module in nnx.iter_graph(model)
            if isinstance(module, nn.LoRA)}


def _each_adapter(model):
    """(Hugging Face module, LoRA path, its Adapter) of every adapter of `model`."""
    hf = _hf_module(model)
    for path, module in adapters(model).items():
        for part, adapter in module.adapters.items():
            yield hf.lora_module(path, part), path, adapter


def apply(model, settings: LoRASettings, seed: int = 0) -> LoRASettings:
    """Wraps each Linear of `model` with a targeted part in `nn.LoRA`, an adapter per targeted Hugging Face module
    (A drawn from `seed` and the module's path, B zero); returns the settings with the targets resolved. The
    model must have no adapters yet. The adapters' dropout sites follow the model's own (`nn.Dropout`'s), one
    each, so that no two masks of a step are the same."""
    if adapters(model):
        raise ValueError("the model already has LoRA adapters")
    settings = settings.resolved(model)
    hf = _hf_module(model)
    # In the family's order, never a set's: the adapters' creation order numbers their dropout sites and, with
    # sharded state, the tags of their tiles' transfers, which must be the same in every process.
    modules = list(dict.fromkeys(hf.LORA_TARGETS.values()))
    site = 1 + max((m.site for _, m in nnx.iter_graph(model) if isinstance(m, nn.Dropout)), default=-1)
    wrapped = []
    for path, parent in list(nnx.iter_graph(model)):
        if not isinstance(parent, nnx.Module):
            continue
        for name in modules:
            child = getattr(parent, name, None)
            if not isinstance(child, nn.Linear):
                continue
            where = ".".join(str(p) for p in (*path, name))
            specs = [settings.spec(hf.lora_module(where, part), part, rows)
                     for part, rows in hf.lora_parts(model.config, name).items()
                     if settings.targets_module(hf.lora_module(where, part))]
            if specs:
                setattr(parent, name, nn.LoRA(child, specs, seed=seed, name=where, first_site=site))
                site += len(specs)
                wrapped.append(where)
    if not wrapped:
        targets = settings.targets if isinstance(settings.targets, str) else ",".join(settings.targets)
        raise ValueError(f"no module of this model matches --lora-targets {targets}; its modules are named like "
                         f"{hf.lora_module('layers.0.self_attn.o_proj', 'o_proj')}")
    return settings


def applied_settings(model) -> LoRASettings:
    """The settings of the adapters `model` has: the PEFT targets, the first adapter's rank and alpha, and
    rank_pattern / alpha_pattern entries (whole module paths) for the adapters that differ."""
    mine = list(_each_adapter(model))
    if not mine:
        raise ValueError("the model has no LoRA adapters")
    first = mine[0][2].spec
    parts = {adapter.spec.name for _, _, adapter in mine}
    targets = tuple(t for t in _hf_module(model).LORA_TARGETS if t in parts)
    return LoRASettings(first.rank, first.alpha, targets,
                        rank_pattern={key: a.spec.rank for key, _, a in mine if a.spec.rank != first.rank},
                        alpha_pattern={key: a.spec.alpha for key, _, a in mine if a.spec.alpha != first.alpha},
                        rslora=first.rslora, dropout=first.dropout)


def merge(model) -> None:
    """Replaces every adapter by its base Linear holding base + the scaled updates in float32 (PEFT's
    merge_and_unload): the model then computes what it did, without adapters, and saves as a plain
    checkpoint of its family."""
    for path, module in adapters(model).items():
        base = module.base
        base.weight.set_value(module.merged_weight())
        parent = model
        *parents, name = path.split(".")
        for part in parents:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        setattr(parent, name, base)


def peft_config(model, settings: LoRASettings, base_model: str | None = None) -> dict:
    """adapter_config.json's contents for `model`'s adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "target_modules": _targets_record(settings.targets), "rank_pattern": dict(settings.rank_pattern),
            "alpha_pattern": dict(settings.alpha_pattern), "lora_dropout": settings.dropout, "bias": "none",
            # GPT-2's Conv1D stores its weight (in, out): PEFT transposes the merged update for it.
            "fan_in_fan_out": not next(iter(adapters(model).values())).base.weight_out_first,
            "base_model_name_or_path": base_model, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "use_rslora": settings.rslora, "use_dora": False, "revision": None}


def save_peft(model, settings: LoRASettings, directory, base_model: str | None = None) -> None:
    """Writes the model's adapters as a PEFT directory (created; each file written atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = _hf_module(model)
    tensors = {}
    for key, path, adapter in _each_adapter(model):
        a, b = (np.asarray(values_ops.to_array(p.get_value())) for p in (adapter.lora_a, adapter.lora_b))
        lora_a, lora_b = hf.lora_to_peft(model.config, adapter.spec.name, a, b)
        tensors[f"{_PEFT_PREFIX}{key}.lora_A.weight"] = np.ascontiguousarray(lora_a, np.float32)
        tensors[f"{_PEFT_PREFIX}{key}.lora_B.weight"] = np.ascontiguousarray(lora_b, np.float32)
    tensorfile.write_atomically(directory / ADAPTER_WEIGHTS,
                                lambda p: tensorfile.write_file(p, tensors, metadata={"format": "pt"}))
    text = json.dumps(peft_config(model, settings, base_model), indent=2) + "\n"
    tensorfile.write_atomically(directory / ADAPTER_CONFIG, lambda p: Path(p).write_text(text))


def _read_config(directory) -> dict:
    return jsonfile.read_object(Path(directory) / ADAPTER_CONFIG, missing=f"{directory} is not a PEFT adapter "
                                "directory", damaged="write the adapters again (--export-lora) or fix the file")


def read_settings(directory) -> LoRASettings:
    """The LoRASettings of a PEFT directory's adapter_config.json; raises naming the file and what it lacks."""
    file = Path(directory) / ADAPTER_CONFIG
    config = _read_config(directory)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type is {config.get('peft_type')!r}; jnntile reads LoRA adapters only")
    if config.get("use_dora"):
        raise ValueError(f"{file}: DoRA adapters (use_dora: true) are not supported; jnntile reads LoRA adapters")
    targets = config.get("target_modules")
    if not isinstance(config.get("r"), int) or not targets or not isinstance(targets, (str, list)):
        raise ValueError(f"{file} needs an integer r and target_modules (a list or a regular expression)")
    patterns = {key: config.get(key) or {} for key in ("rank_pattern", "alpha_pattern")}
    if not all(isinstance(p, dict) for p in patterns.values()):
        raise ValueError(f"{file}: rank_pattern and alpha_pattern must be objects (module pattern: value)")
    dropout = config.get("lora_dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{file}: lora_dropout is {dropout!r}; it must be a number in [0, 1)")
    return LoRASettings(rank=config["r"], alpha=float(config.get("lora_alpha", 8)),
                        targets=targets if isinstance(targets, str) else tuple(targets), source=str(directory),
                        rslora=bool(config.get("use_rslora")), dropout=float(dropout), **patterns)


def other_base(directory, base: str) -> str | None:
    """The base model a PEFT directory's adapter_config.json names (base_model_name_or_path) when it is not
    `base` (a directory or a preset name); None when it names none or `base`.

    Names are compared by their last part, so that a hub id ("org/name") and a local copy of it
    (".../name") match, and a path matches itself however it is written (relative, with "..", a link).
    """
    named = _read_config(directory).get("base_model_name_or_path")
    if not isinstance(named, str) or not named.strip():
        return None

    def last_part(name: str) -> str:
        return Path(name).expanduser().resolve().name.casefold()

    return None if last_part(named) == last_part(base) else named


def load_peft(model, directory) -> None:
    """Overwrites the model's adapters (applied with the directory's settings) from a PEFT directory; every
    tensor is checked before any is written."""
    directory = Path(directory)
    settings = read_settings(directory)
    mine = list(_each_adapter(model))
    if not mine:
        raise ValueError(f"the model has no adapters to load {directory} into; apply them first (lora.apply)")
    file = directory / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found (jnntile reads adapters in safetensors, not adapter_model.bin)")
    stored = tensorfile.SafetensorsFile(file)
    peft: dict = {}
    for name in stored:
        module, _, kind = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"{file}: unexpected tensor {name!r} (jnntile reads lora_A / lora_B weights only)")
        peft.setdefault(module, {})[kind[0]] = stored[name]
    hf = _hf_module(model)
    values = []
    for key, path, adapter in mine:
        spec = adapter.spec
        wanted = settings.spec(key, spec.name, spec.rows)
        if wanted != spec:
            raise ValueError(f"{directory} holds the adapter of {key} with rank {wanted.rank}, alpha {wanted.alpha:g}"
                             f"{' (rsLoRA)' if wanted.rslora else ''}; this model's has rank {spec.rank}, alpha "
                             f"{spec.alpha:g}{' (rsLoRA)' if spec.rslora else ''}")
        if set(peft.get(key, {})) != {"A", "B"}:
            raise ValueError(f"{file} lacks the adapter of {key} (lora_A and lora_B weights)")
        a, b = adapter.lora_a.get_value(), adapter.lora_b.get_value()
        expected = hf.lora_to_peft(model.config, spec.name, np.zeros(a.shape, np.float32),
                                   np.zeros(b.shape, np.float32))
        lora_a, lora_b = peft[key]["A"].read(), peft[key]["B"].read()
        if lora_a.shape != expected[0].shape or lora_b.shape != expected[1].shape:
            raise ValueError(f"{file}: the adapter of {key} is lora_A {lora_a.shape}, lora_B {lora_b.shape}; "
                             f"this model needs {expected[0].shape}, {expected[1].shape}")
        values.append((adapter, hf.lora_from_peft(model.config, spec.name, lora_a, lora_b, a.shape, b.shape)))
    unused = sorted(set(peft) - {key for key, _, _ in mine})
    if unused:
        raise ValueError(f"{file} holds adapters of {unused[:3]}, which this model's targets do not include")
    for adapter, (a, b) in values:
        adapter.lora_a.set_value(tensorfile.load_into(adapter.lora_a.get_value(), a.astype(np.float32)))
        adapter.lora_b.set_value(tensorfile.load_into(adapter.lora_b.get_value(), b.astype(np.float32)))


def _targets_record(targets):
    """target_modules in a record: a regular expression as it is, names as a list (none: every projection)."""
    return targets if isinstance(targets, str) else list(targets or [])


@dataclasses.dataclass(frozen=True)
class FineTune:
    """What a training run trains: every parameter (the default), those `train_only` / `freeze` select
    (regular expressions searched in parameter paths), or LoRA adapters on a frozen base (`lora`). Frozen
    parameters get no gradient and no optimizer state; with adapters in bfloat16 the base is stored in
    bfloat16 (no float32 copy exists), and with `quantize_base` ("nf4", "nf4_dq", "int8") its projection weights, or
    the frozen ones of `freeze` / `train_only`, quantized (`nn.quantized_base`)."""

    freeze: str | None = None
    train_only: str | None = None
    lora: LoRASettings | None = None
    quantize_base: str | None = None

    def __post_init__(self):
        if self.quantize_base is not None and self.trains_everything:
            raise ValueError(f"{self._quantize_flags} quantizes frozen projection weights, and this run freezes "
                             "none: give --lora-rank, --freeze or --train-only, or leave --quantize-base out")
        self.filter()  # checks the patterns and their combination now

    @property
    def trains_everything(self) -> bool:
        return self.lora is None and not self.freeze and not self.train_only

    def record(self) -> dict:
        """What a checkpoint's state.json says of it (a resumed run must ask for the same)."""
        settings = None if self.lora is None else {"rank": self.lora.rank, "alpha": self.lora.alpha,
                                                   "targets": _targets_record(self.lora.targets)}
        for key in ("rank_pattern", "alpha_pattern", "rslora", "dropout"):  # recorded when set: older records lack them
            if settings is not None and getattr(self.lora, key):
                settings[key] = getattr(self.lora, key)
        record = {"freeze": self.freeze, "train_only": self.train_only, "lora": settings}
        return {**record, "quantize_base": self.quantize_base} if self.quantize_base else record  # older: none

    def filter(self):
        """The NNX filter of the trained parameters (`nn.trainable`)."""
        return nn.trainable(self.freeze, self.train_only, adapters_only=self.lora is not None)

    @property
    def _quantize_flags(self) -> str:
        """The flags that ask for `quantize_base`."""
        kind, double = self.quantize_base.removesuffix("_dq"), self.quantize_base.endswith("_dq")
        return f"--quantize-base {kind}" + (" --double-quant" if double else "")

    @property
    def rebuilds_base(self) -> bool:
        """Whether a resume builds the frozen base again from where it came from rather than from the
        checkpoint: LoRA's (the checkpoint holds the adapters alone) and a quantized one (held dequantized)."""
        return self.lora is not None or self.quantize_base is not None

    def base_dtype(self, dtype: str) -> str:
        """The dtype the Linear weights and Embedding tables of a model computing in `dtype` are stored in."""
        return dtype if self.lora is not None else "float32"

    def build(self, make_model, dtype: str, seed: int = 0):
        """`make_model()` (a family's constructor or loader) with the base in `base_dtype(dtype)` (quantized as
        `quantize_base` says) and the adapters applied; returns (model, the LoRA settings resolved or None)."""
        trained = nnx.filterlib.to_predicate(self.filter())
        frozen = None if self.lora is not None else lambda path, variable: not trained(path, variable)
        with nn.base_dtype(self.base_dtype(dtype)), nn.quantized_base(self.quantize_base, frozen):
            model = make_model()
            quantized = nn.quantize_frozen(model)
        if self.quantize_base is not None and not quantized:
            projections = [".".join(str(p) for p in (*path, "weight")) for path, module in nnx.iter_graph(model)
                           if isinstance(module, nn.Linear)]
            given = " ".join(f"{flag} {pattern!r}" for flag, pattern in (("--freeze", self.freeze),
                                                                         ("--train-only", self.train_only)) if pattern)
            raise ValueError(f"{self._quantize_flags}: {given} freezes no projection weight to quantize; "
                             "their paths look like " + ", ".join(projections[:3]))
        settings = apply(model, self.lora, seed) if self.lora is not None else None
        if not self.trains_everything and not nnx.state(model, self.filter()):
            raise ValueError(f"--train-only {self.train_only!r} / --freeze {self.freeze!r} leave no parameter to "
                             "train; parameter paths look like " + ", ".join(list(model.named_params())[:3]))
        return model, settings
