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


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    """rank, alpha (the update is scaled by alpha / rank) and the PEFT target names (None: every
    projection the family has); `source`, the PEFT directory they were read from, if any."""

    rank: int
    alpha: float
    targets: tuple[str, ...] | None = None
    source: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"--lora-rank {self.rank}: the rank of LoRA adapters must be at least 1")
        if not np.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"--lora-alpha {self.alpha}: must be a positive number")

    def resolved(self, model) -> "LoRASettings":
        """These settings with the family's every projection as targets when none were named, checked."""
        known = _hf_module(model).LORA_TARGETS
        targets = tuple(known) if self.targets is None else tuple(self.targets)
        unknown = sorted(set(targets) - set(known))
        if unknown and self.source is not None:
            raise ValueError(self._another_architecture(model, targets))
        if unknown or not targets:
            raise ValueError(f"--lora-targets: {', '.join(unknown) or 'none given'}: this model's projections are "
                             f"{', '.join(known)}")
        for module in set(known.values()):  # the parts of a fused projection go together
            parts = [t for t, m in known.items() if m == module]
            named = [t for t in parts if t in targets]
            if named and len(named) != len(parts):
                missing = ", ".join(sorted(set(parts) - set(named)))
                raise ValueError(f"--lora-targets names {', '.join(named)} but not {missing}"
                                 f": jnntile computes {', '.join(parts)} as one product ({module}), which takes one "
                                 "adapter; name all of them or none")
        return dataclasses.replace(self, targets=tuple(t for t in known if t in targets))


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


def apply(model, settings: LoRASettings, seed: int = 0) -> LoRASettings:
    """Wraps each targeted Linear of `model` in `nn.LoRA` (A drawn from `seed` and the module's path, B zero);
    returns the settings with the targets resolved. The model must have no adapters yet."""
    if adapters(model):
        raise ValueError("the model already has LoRA adapters")
    settings = settings.resolved(model)
    modules = {_hf_module(model).LORA_TARGETS[t] for t in settings.targets}
    wrapped = []
    for path, parent in list(nnx.iter_graph(model)):
        if not isinstance(parent, nnx.Module):
            continue
        for name in modules:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear):
                where = ".".join(str(p) for p in (*path, name))
                setattr(parent, name, nn.LoRA(child, rank=settings.rank, alpha=settings.alpha, seed=seed, name=where))
                wrapped.append(where)
    if not wrapped:
        raise ValueError(f"no module of this model matches --lora-targets {','.join(settings.targets)}")
    return settings


def applied_settings(model) -> LoRASettings:
    """The settings of the adapters `model` has (rank, alpha, PEFT targets)."""
    mine = adapters(model)
    if not mine:
        raise ValueError("the model has no LoRA adapters")
    first = next(iter(mine.values()))
    modules = {path.rpartition(".")[2] for path in mine}
    targets = tuple(t for t, m in _hf_module(model).LORA_TARGETS.items() if m in modules)
    return LoRASettings(first.rank, first.alpha, targets)


def merge(model) -> None:
    """Replaces every adapter by its base Linear holding base + (alpha / rank) B A in float32 (PEFT's
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
            "target_modules": list(settings.targets), "lora_dropout": 0.0, "bias": "none",
            # GPT-2's Conv1D stores its weight (in, out): PEFT transposes the merged update for it.
            "fan_in_fan_out": not next(iter(adapters(model).values())).base.weight_out_first,
            "base_model_name_or_path": base_model, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "use_rslora": False, "use_dora": False, "revision": None}


def save_peft(model, settings: LoRASettings, directory, base_model: str | None = None) -> None:
    """Writes the model's adapters as a PEFT directory (created; each file written atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = _hf_module(model)
    tensors = {}
    for path, module in adapters(model).items():
        a, b = (np.asarray(values_ops.to_array(p.get_value())) for p in (module.lora_a, module.lora_b))
        for hf_module, (lora_a, lora_b) in hf.lora_to_peft(model.config, path, a, b).items():
            tensors[f"{_PEFT_PREFIX}{hf_module}.lora_A.weight"] = np.ascontiguousarray(lora_a, np.float32)
            tensors[f"{_PEFT_PREFIX}{hf_module}.lora_B.weight"] = np.ascontiguousarray(lora_b, np.float32)
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
        raise ValueError(f"{file}: peft_type is {config.get('peft_type')!r}; jnntile reads LoRA adapters")
    for key, what in (("use_dora", "DoRA"), ("use_rslora", "rsLoRA")):
        if config.get(key):
            raise ValueError(f"{file}: {what} adapters ({key}: true) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not isinstance(config.get("r"), int) or not targets:
        raise ValueError(f"{file} needs an integer r and a list of target_modules")
    return LoRASettings(rank=config["r"], alpha=float(config.get("lora_alpha", 8)), targets=tuple(targets),
                        source=str(directory))


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
    mine = adapters(model)
    if not mine:
        raise ValueError(f"the model has no adapters to load {directory} into; apply them first (lora.apply)")
    first = next(iter(mine.values()))
    if (first.rank, first.alpha) != (settings.rank, settings.alpha):
        raise ValueError(f"{directory} holds adapters of rank {settings.rank}, alpha {settings.alpha:g}; this model's "
                         f"have rank {first.rank}, alpha {first.alpha:g}")
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
    values = {}
    used = set()
    for path, module in mine.items():
        a, b = module.lora_a.get_value(), module.lora_b.get_value()
        # The PEFT modules and shapes this adapter has: those of zeros of its shapes, converted.
        expected = hf.lora_to_peft(model.config, path, np.zeros(a.shape, np.float32), np.zeros(b.shape, np.float32))
        missing = [m for m in expected if set(peft.get(m, {})) != {"A", "B"}]
        if missing:
            raise ValueError(f"{file} lacks the adapter of {missing[0]} (lora_A and lora_B weights)")
        pairs = {m: (peft[m]["A"].read(), peft[m]["B"].read()) for m in expected}
        used.update(expected)
        for m, (lora_a, lora_b) in pairs.items():
            if lora_a.shape != expected[m][0].shape or lora_b.shape != expected[m][1].shape:
                raise ValueError(f"{file}: the adapter of {m} is lora_A {lora_a.shape}, lora_B {lora_b.shape}; "
                                 f"this model needs {expected[m][0].shape}, {expected[m][1].shape}")
        values[path] = hf.lora_from_peft(model.config, path, pairs, a.shape, b.shape)
    unused = sorted(set(peft) - used)
    if unused:
        raise ValueError(f"{file} holds adapters of {unused[:3]}, which this model's targets do not include")
    for path, (a, b) in values.items():
        module = mine[path]
        module.lora_a.set_value(tensorfile.load_into(module.lora_a.get_value(), a.astype(np.float32)))
        module.lora_b.set_value(tensorfile.load_into(module.lora_b.get_value(), b.astype(np.float32)))


@dataclasses.dataclass(frozen=True)
class FineTune:
    """What a training run trains: every parameter (the default), those `train_only` / `freeze` select
    (regular expressions searched in parameter paths), or LoRA adapters on a frozen base (`lora`). Frozen
    parameters get no gradient and no optimizer state; with adapters in bfloat16 the base is stored in
    bfloat16 (no float32 copy exists)."""

    freeze: str | None = None
    train_only: str | None = None
    lora: LoRASettings | None = None

    def __post_init__(self):
        self.filter()  # checks the patterns and their combination now

    @property
    def trains_everything(self) -> bool:
        return self.lora is None and not self.freeze and not self.train_only

    def record(self) -> dict:
        """What a checkpoint's state.json says of it (a resumed run must ask for the same)."""
        settings = None if self.lora is None else {"rank": self.lora.rank, "alpha": self.lora.alpha,
                                                   "targets": list(self.lora.targets or [])}
        return {"freeze": self.freeze, "train_only": self.train_only, "lora": settings}

    def filter(self):
        """The NNX filter of the trained parameters (`nn.trainable`)."""
        return nn.trainable(self.freeze, self.train_only, adapters_only=self.lora is not None)

    def base_dtype(self, dtype: str) -> str:
        """The dtype the Linear weights of a model computing in `dtype` are stored in."""
        return dtype if self.lora is not None else "float32"

    def build(self, make_model, dtype: str, seed: int = 0):
        """`make_model()` (a family's constructor or loader) with the base in `base_dtype(dtype)` and the
        adapters applied; returns (model, the LoRA settings resolved or None)."""
        with nn.base_dtype(self.base_dtype(dtype)):
            model = make_model()
        settings = apply(model, self.lora, seed) if self.lora is not None else None
        if not self.trains_everything and not nnx.state(model, self.filter()):
            raise ValueError(f"--train-only {self.train_only!r} / --freeze {self.freeze!r} leave no parameter to "
                             "train; parameter paths look like " + ", ".join(list(model.named_params())[:3]))
        return model, settings
