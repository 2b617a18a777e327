"""The pure-JAX Llama reference and its configuration, against Hugging Face `transformers`.

tools/make_hf_fixtures.py made the fixtures in tests/data/ with LlamaForCausalLM (grouped-query
attention, untied head, Llama 3.1's rope scaling) and Qwen2ForCausalLM (q/k/v biases, tied head):
logits, loss and the gradient of every parameter. torch is not needed here.
"""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import rel_err
from tokenizers import Tokenizer

from jnntile.models.llama import PRESETS, LlamaConfig
from jnntile.models.llama import reference as ref

DATA = Path(__file__).parent / "data"
FIXTURES = ["llama", "qwen2"]


def _load(name):
    directory = DATA / f"hf_tiny_{name}"
    config = LlamaConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
    params = {k: jnp.asarray(v) for k, v in safetensors.numpy.load_file(directory / "model.safetensors").items()}
    return config, params, dict(np.load(DATA / f"hf_tiny_{name}_expected.npz"))


@pytest.mark.parametrize("name", FIXTURES)
def test_config_json_gives_the_model_transformers_built(name):
    config, params, _ = _load(name)
    assert {k: tuple(v.shape) for k, v in params.items()} == config.param_shapes()
    assert config.kv_groups == 2 and config.head_dim == 8
    assert config.qkv_bias == (name == "qwen2") and not config.o_bias
    assert config.tie_word_embeddings == (name == "qwen2")
    assert (config.rope_scaling_dict or {}).get("rope_type") == ("llama3" if name == "llama" else None)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_loss_and_gradients_match_transformers(name):
    config, params, expected = _load(name)
    idx, targets = jnp.asarray(expected["idx"]), jnp.asarray(expected["targets"])
    assert rel_err(ref.forward(params, config, idx), expected["logits"]) < 1e-4
    value, grads = jax.value_and_grad(ref.loss)(params, config, idx, targets)
    assert abs(float(value) - float(expected["loss"])) < 1e-4 * float(expected["loss"])
    assert set(grads) == {key.removeprefix("grad:") for key in expected if key.startswith("grad:")}
    for key, grad in grads.items():
        assert rel_err(grad, expected["grad:" + key]) < 1e-4, key


def test_grouped_query_attention_equals_attention_with_copied_heads():
    """GQA with 2 key/value heads for 4 query heads equals plain multi-head attention whose key/value
    heads are copied per query head (query head h uses key/value head h // 2)."""
    config, params, expected = _load("llama")
    mha = dataclasses.replace(config, num_key_value_heads=4)
    copied = dict(params)
    D = config.head_dim
    for i in range(config.num_hidden_layers):
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            copied[name] = jnp.repeat(params[name].reshape(2, D, -1), 2, axis=0).reshape(4 * D, -1)
    idx = jnp.asarray(expected["idx"])
    assert rel_err(ref.forward(copied, mha, idx), ref.forward(params, config, idx)) < 1e-6


def test_llama3_frequency_scaling():
    """Llama 3.1's scaling keeps short wavelengths, divides long ones by the factor and blends between."""
    config = LlamaConfig(head_dim=16, hidden_size=64, num_attention_heads=4, rope_theta=10000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    plain = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))
    scaled = config.inverse_frequencies()
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 64 / 4, wavelength > 64 / 1
    np.testing.assert_allclose(scaled[short], plain[short], rtol=1e-6)
    np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-6)
    smooth = (64 / wavelength[~short & ~long] - 1) / 3
    blended = (1 - smooth) * plain[~short & ~long] / 8 + smooth * plain[~short & ~long]
    np.testing.assert_allclose(scaled[~short & ~long], blended, rtol=1e-6)
    assert short.any() and long.any() and (~short & ~long).any()


def test_rotary_embedding_is_a_rotation_by_position():
    """Rotating by position p, then by q, is rotating by p + q; norms are kept."""
    inv_freq = jnp.asarray(LlamaConfig(head_dim=8, hidden_size=32, num_attention_heads=4).inverse_frequencies())
    x = jax.random.normal(jax.random.key(0), (1, 1, 2, 8))
    p, q = jnp.array([[3]]), jnp.array([[5]])
    np.testing.assert_allclose(ref.rotary(ref.rotary(x, p, inv_freq), q, inv_freq), ref.rotary(x, p + q, inv_freq),
                               atol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(ref.rotary(x, p, inv_freq), axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)


@pytest.mark.parametrize("name, billions", [("smollm-135m", 0.1345), ("llama-1b", 1.236), ("tinyllama-1.1b", 1.100),
                                            ("llama-8b", 8.030), ("llama-70b", 70.554)])
def test_presets_have_the_published_parameter_counts(name, billions):
    assert PRESETS[name].n_params() / 1e9 == pytest.approx(billions, rel=1e-3)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not a Llama-family model; supported: .'llama', "
                                 "'mistral', 'qwen2'."),
    ({"hidden_size": None}, r"a llama config needs \['hidden_size'\]"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
     "rope_scaling of type 'yarn' is not supported; supported: .'llama3',."),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
])
def test_config_json_errors_name_the_problem(change, message):
    hf = json.loads((DATA / "hf_tiny_llama" / "config.json").read_text())
    hf.update(change)
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_dict(hf)


def test_older_config_json_keys_and_mistral_sliding_window():
    hf = json.loads((DATA / "hf_tiny_llama" / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = rope  # the keys of files written before transformers 5
    assert LlamaConfig.from_hf_dict(hf) == LlamaConfig.from_hf_dict(
        json.loads((DATA / "hf_tiny_llama" / "config.json").read_text()))
    mistral = LlamaConfig.from_hf_dict({**hf, "model_type": "mistral", "sliding_window": 8})
    mistral.check_sequence_length(8)
    with pytest.raises(ValueError, match="seq_len=9 exceeds the sliding window of 8 positions in config.json"):
        mistral.check_sequence_length(9)


def test_to_hf_dict_round_trips():
    for name in FIXTURES:
        config = _load(name)[0]
        assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("name", FIXTURES)
def test_tokenizer_files_load_and_round_trip(name):
    tokenizer = Tokenizer.from_file(str(DATA / f"hf_tiny_{name}" / "tokenizer.json"))
    text = "Tiles move between RAM and disk; ünïcode too."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert max(ids) < _load(name)[0].vocab_size
    assert tokenizer.decode(ids) == text
