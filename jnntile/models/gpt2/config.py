"""GPT-2 configuration shared by the jnntile model and the pure-JAX reference.

Sizes follow the Hugging Face / OpenAI GPT-2 naming (n_layer, n_head, n_embd,
vocab_size, n_positions). The tile_* fields only matter to the tiled jnntile
model; None lets jnntile choose a tile size for that logical axis.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jnntile.models import ExecutionFields, is_int

_SIZE_FIELDS = ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")

# Hugging Face `GPT2Config` defaults for keys that old or hand-written
# config.json files may leave out. The architecture sizes have no default here:
# guessing them would load a checkpoint into the wrong model.
_HF_REQUIRED_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")
_HF_DEFAULT_DROPOUT = 0.1
_HF_DEFAULT_EPSILON = 1e-5
# Both names denote the tanh approximation of GELU that GPT-2 was trained with.
_TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class GPT2Config(ExecutionFields):
    """Hyper-parameters of a GPT-2 model. Defaults are GPT-2 small (124M).

    Frozen, hence hashable: it can be passed to `jax.jit` as a static argument.
    """

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    n_positions: int = 1024
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.check_execution_fields()
        if self.n_embd % self.n_head != 0:
            divisors = [d for d in range(1, self.n_embd + 1) if self.n_embd % d == 0]
            raise ValueError(
                f"n_head={self.n_head} does not divide n_embd={self.n_embd}; "
                f"choose n_head among divisors {divisors} or change n_embd"
            )
        if not isinstance(self.dropout, numbers.Real) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if not isinstance(self.layer_norm_epsilon, numbers.Real) or not self.layer_norm_epsilon > 0:
            raise ValueError(f"layer_norm_epsilon={self.layer_norm_epsilon!r} must be positive")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    # The fields that the commands' --n-layer, --n-head, --n-embd and a longer --seq-len set.
    FLAG_FIELDS = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "max_positions": "n_positions"}

    @property
    def max_positions(self) -> int:
        return self.n_positions

    @property
    def n_blocks(self) -> int:
        return self.n_layer

    def describe(self) -> str:
        return (f"GPT-2, {self.n_params() / 1e6:.2f}M parameters, n_layer={self.n_layer} n_head={self.n_head} "
                f"n_embd={self.n_embd} vocab={self.vocab_size}")

    def kv_cache_bytes(self, batch: int, length: int) -> int:
        """Bytes of the key/value cache (float32) of `batch` sequences of `length` positions."""
        return 4 * self.n_layer * batch * length * 2 * self.n_embd

    def axis_sizes(self) -> dict[str, int]:
        return {"embd": self.n_embd, "heads": self.n_head, "hidden": 4 * self.n_embd, "vocab": self.vocab_size}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, with Hugging Face's names and layouts, in its state-dict order."""
        C, V, P = self.n_embd, self.vocab_size, self.n_positions
        shapes = {"wte.weight": (V, C), "wpe.weight": (P, C)}
        for i in range(self.n_layer):
            h = f"h.{i}."
            shapes.update({
                h + "ln_1.weight": (C,),
                h + "ln_1.bias": (C,),
                h + "attn.c_attn.weight": (C, 3 * C),
                h + "attn.c_attn.bias": (3 * C,),
                h + "attn.c_proj.weight": (C, C),
                h + "attn.c_proj.bias": (C,),
                h + "ln_2.weight": (C,),
                h + "ln_2.bias": (C,),
                h + "mlp.c_fc.weight": (C, 4 * C),
                h + "mlp.c_fc.bias": (4 * C,),
                h + "mlp.c_proj.weight": (4 * C, C),
                h + "mlp.c_proj.bias": (C,),
            })
        shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
        return shapes

    def n_params(self) -> int:
        """Number of parameters, counting the tied LM head once (as GPT-2 does)
        and including LayerNorm weights and all biases. GPT-2 small: 124,439,808."""
        return sum(math.prod(shape) for shape in self.param_shapes().values())

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` content of this model (tile sizes are
        jnntile-only and are not written)."""
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "activation_function": "gelu_new",
            "resid_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "attn_pdrop": self.dropout,
            "tie_word_embeddings": True,
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "GPT2Config":
        """Build a config from a Hugging Face GPT-2 `config.json` dict.

        Optional keys take Hugging Face defaults. Settings this GPT-2 does not
        implement (untied head, another activation, per-site dropout rates,
        attention scaling variants) raise instead of loading a different model.
        `overrides` sets fields absent from config.json, e.g. tile sizes.
        """
        missing = [key for key in _HF_REQUIRED_KEYS if key not in hf]
        if missing:
            raise ValueError(
                f"Hugging Face config is missing required key(s) {missing}; "
                f"a GPT-2 config.json needs {list(_HF_REQUIRED_KEYS)}"
            )
        model_type = hf.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"model_type={model_type!r} is not supported; only 'gpt2' is")
        activation = hf.get("activation_function", "gelu_new")
        if activation not in _TANH_GELU_NAMES:
            raise ValueError(
                f"activation_function={activation!r} is not supported; "
                f"GPT-2 here uses the tanh GELU {_TANH_GELU_NAMES}"
            )
        if not hf.get("tie_word_embeddings", True):
            raise ValueError("tie_word_embeddings=false is not supported: the LM head is tied to wte")
        n_inner = hf.get("n_inner")
        if n_inner is not None and n_inner != 4 * hf["n_embd"]:
            raise ValueError(f"n_inner={n_inner} is not supported; the MLP width is 4 * n_embd")
        if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
            raise ValueError(
                "only the standard attention scaling 1/sqrt(head_dim) is supported "
                "(scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false)"
            )
        n_ctx = hf.get("n_ctx", hf["n_positions"])
        if n_ctx != hf["n_positions"]:
            raise ValueError(f"n_ctx={n_ctx} differs from n_positions={hf['n_positions']}")
        rates = {key: hf.get(key, _HF_DEFAULT_DROPOUT) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        if len(set(rates.values())) != 1:
            raise ValueError(f"dropout rates differ {rates}; this GPT-2 has a single dropout rate")
        fields = {key: hf[key] for key in _HF_REQUIRED_KEYS}
        fields["dropout"] = rates["resid_pdrop"]
        fields["layer_norm_epsilon"] = hf.get("layer_norm_epsilon", _HF_DEFAULT_EPSILON)
        fields.update(overrides)
        return cls(**fields)

    # ---------------------------------------------------------------- presets

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPT2Config":
        """A named configuration from PRESETS, with fields replaced by `overrides`,
        e.g. `GPT2Config.preset("tiny", vocab_size=65)`."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


# "tiny" and "small" are for tests, notebooks and laptop-sized runs. They keep
# the GPT-2 BPE vocabulary (50257) so they work with the GPT-2 tokenizer; a
# dataset with its own vocabulary (e.g. characters) overrides it:
# `GPT2Config.preset("tiny", vocab_size=dataset.vocab_size)`.
# tiny uses n_positions=256 so a full-length batch stays cheap on a CPU.
PRESETS: dict[str, GPT2Config] = {
    "tiny": GPT2Config(n_layer=2, n_head=4, n_embd=128, n_positions=256),
    "small": GPT2Config(n_layer=6, n_head=6, n_embd=384),
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
}
