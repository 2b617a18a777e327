"""Configuration of the Llama family (Llama 2/3, TinyLlama, SmolLM, Qwen2, Mistral).

Fields carry Hugging Face's `config.json` names. The tile_* fields (jnntile.models.ExecutionFields) only
matter to the tiled jnntile model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

from jnntile.models import ExecutionFields, is_int

_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")
# What each supported model_type means for the attention biases (q/k/v, and o).
MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_SCALING_TYPES = ("llama3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ExecutionFields):
    """Hyper-parameters of a Llama-family model. Defaults are the `llama-tiny` test shape.

    Frozen, hence hashable: it can be passed to `jax.jit` as a static argument.
    `head_dim` None means hidden_size // num_attention_heads; `num_key_value_heads`
    below `num_attention_heads` is grouped-query attention (each key/value head
    serves num_attention_heads // num_key_value_heads query heads).
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    max_position_embeddings: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, kept as a sorted tuple of items so the config stays hashable.
    rope_scaling: Optional[tuple] = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    o_bias: bool = False  # Llama's attention_bias puts them on all four projections
    sliding_window: Optional[int] = None  # Mistral: attention over at most this many previous positions
    model_type: str = "llama"
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            if (value is not None or name != "head_dim") and (not is_int(value) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.head_dim is None:
            heads, width = self.num_attention_heads, self.hidden_size
            if width % heads:
                divisors = [d for d in range(1, width + 1) if width % d == 0]
                raise ValueError(f"num_attention_heads={heads} does not divide hidden_size={width}; choose "
                                 f"num_attention_heads among divisors {divisors} or change hidden_size")
            object.__setattr__(self, "head_dim", width // heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd: the rotary embedding turns pairs of features; choose "
                             "sizes that give an even head_dim (hidden_size / num_attention_heads)")
        self.check_execution_fields()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}: each key/value head serves a group of "
                             f"query heads; choose num_attention_heads a multiple of {self.num_key_value_heads}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; use one of {MODEL_TYPES}")
        if self.dropout != 0:
            raise ValueError(f"dropout={self.dropout}: the Llama family has no dropout; it must be 0")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be positive")
        scaling = self.rope_scaling_dict
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ROPE_SCALING_TYPES:
                raise ValueError(f"rope_scaling of type {kind!r} is not supported; supported: {ROPE_SCALING_TYPES}")
            missing = [k for k in _LLAMA3_KEYS if k not in scaling]
            if missing:
                raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}")

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    # The fields that the commands' --n-layer, --n-head, --n-embd and a longer --seq-len set.
    FLAG_FIELDS = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size",
                   "max_positions": "max_position_embeddings"}

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def n_blocks(self) -> int:
        return self.num_hidden_layers

    def describe(self) -> str:
        return (f"{self.model_type}, {self.n_params() / 1e6:.2f}M parameters, layers={self.num_hidden_layers} "
                f"heads={self.num_attention_heads} (key/value {self.num_key_value_heads}) hidden={self.hidden_size} "
                f"vocab={self.vocab_size}")

    def kv_cache_bytes(self, batch: int, length: int) -> int:
        """Bytes of the key/value cache (float32) of `batch` sequences of `length` positions."""
        return 4 * self.num_hidden_layers * batch * length * 2 * self.num_key_value_heads * self.head_dim

    def axis_sizes(self) -> dict[str, int]:
        # Tiles cut the key/value heads; each takes the query heads of its groups along.
        return {"embd": self.hidden_size, "heads": self.num_key_value_heads, "hidden": self.intermediate_size,
                "vocab": self.vocab_size}

    def inverse_frequencies(self) -> np.ndarray:
        """The rotary embedding's D/2 frequencies theta^(-2i/D) in float32, as Hugging Face computes them, with
        Llama 3.1's scaling when configured (low frequencies divided by `factor`, a smooth blend between the two
        wavelength bounds)."""
        D = self.head_dim
        inv_freq = (1.0 / (np.float32(self.rope_theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D))))
        scaling = self.rope_scaling_dict
        if scaling is None:
            return inv_freq.astype(np.float32)
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def check_sequence_length(self, seq_len: int) -> None:
        """Refuses sequences this implementation would compute wrongly: longer than the positions the model
        has, or than Mistral's sliding window (attention here is over every previous position)."""
        if seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len={seq_len} is longer than max_position_embeddings="
                             f"{self.max_position_embeddings}")
        if self.sliding_window is not None and seq_len > self.sliding_window:
            raise ValueError(f"seq_len={seq_len} exceeds the sliding window of {self.sliding_window} positions in "
                             "config.json: jnntile attends over every previous position, which equals sliding-window "
                             f"attention only up to {self.sliding_window} positions; use --seq-len "
                             f"{self.sliding_window} or less")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, with Hugging Face's names and (out, in) layouts, in its order."""
        C, I, V = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (V, C)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (C,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[p + f"self_attn.{name}.weight"] = (rows, C)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (C, q)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (C,)
            shapes[p + "post_attention_layernorm.weight"] = (C,)
            shapes[p + "mlp.gate_proj.weight"] = (I, C)
            shapes[p + "mlp.up_proj.weight"] = (I, C)
            shapes[p + "mlp.down_proj.weight"] = (C, I)
        shapes["model.norm.weight"] = (C,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, C)
        return shapes

    def n_params(self) -> int:
        """Number of parameters (a tied head counted once)."""
        return sum(math.prod(shape) for shape in self.param_shapes().values())

    # ----------------------------------------------------------- Hugging Face

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "LlamaConfig":
        """A config from a Hugging Face `config.json` dict of model_type llama, mistral or qwen2.

        Settings this implementation does not compute (another activation, MLP
        biases, a partial rotary embedding) raise instead of loading a different model.
        """
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a Llama-family model; supported: {MODEL_TYPES}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"a {model_type} config needs {missing}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported")
        attention_bias = bool(hf.get("attention_bias", False))
        # transformers 5 writes rope_parameters (theta and scaling together); older files rope_theta and
        # rope_scaling.
        rope = hf.get("rope_parameters")
        theta = (rope or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = ({k: v for k, v in rope.items() if k != "rope_theta"} if rope is not None
                   else hf.get("rope_scaling"))
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        sliding = hf.get("sliding_window") if (model_type == "mistral" or hf.get("use_sliding_window")) else None
        fields = dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"), max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias, sliding_window=sliding,
            model_type=model_type)
        return cls(**{**fields, **overrides})

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content of this model (tile sizes are jnntile's own and not written)."""
        architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        hf = dict(
            architectures=[architectures[self.model_type]], model_type=self.model_type, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling_dict,
            tie_word_embeddings=self.tie_word_embeddings, hidden_act="silu")
        if self.model_type == "llama":
            hf["attention_bias"] = self.o_bias
        if self.sliding_window is not None:
            hf["sliding_window"] = self.sliding_window
        return hf

    @classmethod
    def preset(cls, name: str, **overrides) -> "LlamaConfig":
        """Preset `name` with fields replaced by `overrides`; a head_dim that is the preset's hidden_size /
        num_attention_heads follows the width and head count given, unless `overrides` sets it."""
        if name not in PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; choose one of {sorted(PRESETS)}")
        base = PRESETS[name]
        derived = base.head_dim * base.num_attention_heads == base.hidden_size
        return dataclasses.replace(base, **{**({"head_dim": None} if derived else {}), **overrides})


_LLAMA3_SCALING = lambda factor: {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,  # noqa: E731
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# The shapes people fine-tune, from their published config.json files (parameter counts in comments).
PRESETS = {
    "llama-tiny": LlamaConfig(),  # 0.2M: for tests
    # HuggingFaceTB/SmolLM-135M: 134.5M
    "smollm-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                               rope_theta=10000.0, tie_word_embeddings=True),
    # meta-llama/Llama-3.2-1B: 1.24B
    "llama-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                            max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                            rope_scaling=_LLAMA3_SCALING(32.0)),
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T: 1.10B
    "tinyllama-1.1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                  rope_theta=10000.0),
    # meta-llama/Llama-3.1-8B: 8.03B
    "llama-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                            rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING(8.0)),
    # meta-llama/Llama-3.1-70B: 70.55B
    "llama-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                             rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING(8.0)),
}
