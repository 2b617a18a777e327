"""The pure-JAX reference GPT-2 and Hugging Face checkpoint interop.

The reference is checked against logits and loss saved from Hugging Face's
GPT2LMHeadModel (tools/make_hf_fixtures.py made them; torch is not needed here).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jnntile.models.gpt2 import reference as ref
from jnntile.models.gpt2.config import PRESETS, GPT2Config
from jnntile.models.families import load_hf, write_hf

DATA = Path(__file__).parent / "data"
HF_DIR = DATA / "hf_tiny_gpt2"
TINY = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32)

# Jitted once per config: eager op-by-op dispatch would dominate the test time.
# The eager functions are still used where the eager input checks are tested.
forward = jax.jit(ref.forward, static_argnums=1)
loss = jax.jit(ref.loss, static_argnums=1, static_argnames="ignore_index")


@pytest.fixture(scope="module")
def hf_model():
    return load_hf(HF_DIR)


@pytest.fixture(scope="module")
def expected():
    return dict(np.load(DATA / "hf_tiny_gpt2_expected.npz"))


def copy_checkpoint(tmp_path, tensors=None):
    """A copy of the HF fixture in tmp_path, optionally with other tensors."""
    directory = tmp_path / "ckpt"
    shutil.copytree(HF_DIR, directory)
    if tensors is not None:
        safetensors.numpy.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def hf_tensors():
    return safetensors.numpy.load_file(HF_DIR / "model.safetensors")


# ------------------------------------------------------------ config


def test_config_defaults_are_gpt2_small():
    config = GPT2Config()
    assert (config.n_layer, config.n_head, config.n_embd) == (12, 12, 768)
    assert (config.vocab_size, config.n_positions) == (50257, 1024)
    assert config.head_dim == 64
    assert config.n_params() == 124_439_808  # the published GPT-2 small count
    assert PRESETS["gpt2-xl"].n_params() == 1_557_611_200


def test_config_n_params_matches_init(hf_model):
    config, params = hf_model
    assert config == TINY
    assert ref.n_params(params) == config.n_params()


def test_config_errors_name_the_field_and_fix():
    with pytest.raises(ValueError, match=r"n_head=5 does not divide n_embd=64; choose n_head among divisors \[1, 2, 4, 8"):
        GPT2Config(n_head=5, n_embd=64)
    with pytest.raises(ValueError, match="n_layer=0 must be a positive integer"):
        GPT2Config(n_layer=0)
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        GPT2Config(dropout=1.0)
    with pytest.raises(ValueError, match="tile_seq=0 must be a positive integer"):
        GPT2Config(tile_seq=0)
    with pytest.raises(ValueError, match="unknown preset 'gpt3'; known presets: tiny, small, gpt2, gpt2-medium"):
        GPT2Config.preset("gpt3")


def test_config_presets_and_hf_dict():
    tiny = GPT2Config.preset("tiny", vocab_size=65, tile_seq=64)
    assert (tiny.n_layer, tiny.n_head, tiny.n_embd, tiny.n_positions) == (2, 4, 128, 256)
    assert (tiny.vocab_size, tiny.tile_seq) == (65, 64)
    hf = tiny.to_hf_dict()
    assert hf["model_type"] == "gpt2" and hf["n_ctx"] == 256 and hf["activation_function"] == "gelu_new"
    assert GPT2Config.from_hf_dict(hf, tile_seq=64) == tiny
    # Optional keys fall back to Hugging Face defaults (dropout 0.1).
    minimal = {key: hf[key] for key in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")}
    assert GPT2Config.from_hf_dict(minimal).dropout == 0.1
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['n_embd'\]"):
        GPT2Config.from_hf_dict({k: v for k, v in minimal.items() if k != "n_embd"})
    with pytest.raises(ValueError, match="tie_word_embeddings=false is not supported"):
        GPT2Config.from_hf_dict({**minimal, "tie_word_embeddings": False})


# ------------------------------------------------- reference vs Hugging Face


def test_logits_and_loss_match_hugging_face(hf_model, expected):
    config, params = hf_model
    idx = jnp.asarray(expected["idx"])
    logits = np.asarray(forward(params, config, idx))
    scale = max(1.0, float(np.abs(expected["logits"]).max()))
    assert np.abs(logits - expected["logits"]).max() < 1e-4 * scale
    for targets_key, loss_key in (("targets", "loss"), ("targets_masked", "loss_masked")):
        value = float(loss(params, config, idx, jnp.asarray(expected[targets_key])))
        np.testing.assert_allclose(value, expected[loss_key], rtol=1e-5)


def test_ignore_index_excludes_tokens_from_mean(hf_model, expected):
    config, params = hf_model
    idx, targets = jnp.asarray(expected["idx"]), jnp.asarray(expected["targets"])
    logprobs = jax.nn.log_softmax(forward(params, config, idx), axis=-1)
    nll = -np.take_along_axis(np.asarray(logprobs), np.asarray(targets)[..., None], axis=-1)[..., 0]
    keep = np.ones(targets.shape, bool)
    keep[:, ::3] = False
    masked = jnp.where(keep, targets, -1)
    value = float(loss(params, config, idx, masked, ignore_index=-1))
    np.testing.assert_allclose(value, nll[keep].mean(), rtol=1e-6)
    # A batch with nothing to predict contributes 0, not NaN.
    assert float(loss(params, config, idx, jnp.full_like(targets, -1), ignore_index=-1)) == 0.0


def test_causality(hf_model, expected):
    config, params = hf_model
    idx = np.array(expected["idx"])
    changed = idx.copy()
    changed[:, 10] = (changed[:, 10] + 1) % config.vocab_size
    before = np.asarray(forward(params, config, jnp.asarray(idx)))
    after = np.asarray(forward(params, config, jnp.asarray(changed)))
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.allclose(before[:, 10:], after[:, 10:])


def test_grad_under_jit_is_finite_for_every_parameter(hf_model, expected):
    config, params = hf_model
    grad_fn = jax.jit(jax.grad(ref.loss), static_argnums=1)
    grads = grad_fn(params, config, jnp.asarray(expected["idx"]), jnp.asarray(expected["targets"]))
    assert grads.keys() == params.keys()
    for name, grad in grads.items():
        assert grad.shape == params[name].shape, name
        assert np.isfinite(np.asarray(grad)).all(), name
        assert np.abs(np.asarray(grad)).max() > 0, name


def test_dropout_only_with_rng(hf_model, expected):
    config, params = hf_model
    idx = jnp.asarray(expected["idx"])
    noisy = dataclasses.replace(config, dropout=0.2)
    plain = np.asarray(forward(params, config, idx))
    np.testing.assert_array_equal(np.asarray(forward(params, noisy, idx)), plain)
    assert not np.allclose(forward(params, noisy, idx, dropout_rng=jax.random.key(0)), plain)


def test_init_params_statistics():
    config = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=512, n_positions=64)
    params = ref.init_params(config, seed=0)
    assert ref.n_params(params) == config.n_params()
    assert all(p.dtype == jnp.float32 for p in params.values())
    np.testing.assert_allclose(np.std(params["wte.weight"]), 0.02, rtol=0.05)
    np.testing.assert_allclose(np.std(params["h.1.mlp.c_proj.weight"]), 0.02 / 2, rtol=0.05)
    assert (np.asarray(params["h.0.ln_1.weight"]) == 1).all() and (np.asarray(params["h.0.attn.c_attn.bias"]) == 0).all()
    np.testing.assert_array_equal(ref.init_params(config, seed=0)["wpe.weight"], params["wpe.weight"])


def test_bad_token_ids_raise(hf_model):
    config, params = hf_model
    idx = np.zeros((1, 8), np.int32)
    with pytest.raises(ValueError, match=r"idx contains token id 96 outside \[0, 96\)"):
        ref.forward(params, config, jnp.asarray(idx).at[0, 3].set(96))
    with pytest.raises(ValueError, match=r"idx contains token id -1 outside"):
        ref.forward(params, config, jnp.asarray(idx).at[0, 3].set(-1))
    with pytest.raises(ValueError, match=r"targets contains token id 200 outside \[0, 96\) or ignore_index=-100"):
        ref.loss(params, config, jnp.asarray(idx), jnp.asarray(idx).at[0, 0].set(200))
    with pytest.raises(ValueError, match="sequence length 33 > n_positions=32"):
        ref.forward(params, config, jnp.zeros((1, 33), jnp.int32))
    # Under jit the ids cannot be checked; a bad one must not pass silently.
    logits = forward(params, config, jnp.asarray(idx).at[0, 3].set(-1))
    assert np.isnan(logits[0, 3]).all()


# -------------------------------------------------------- checkpoint files


def test_save_load_round_trip_is_bit_exact(tmp_path, hf_model):
    config, params = hf_model
    jax_params = {name: jnp.asarray(value) for name, value in params.items()}
    write_hf(tmp_path / "new" / "dir", config, jax_params)
    names = safetensors.numpy.load_file(tmp_path / "new" / "dir" / "model.safetensors").keys()
    assert all(name.startswith("transformer.") for name in names) and "transformer.wte.weight" in names
    assert json.loads((tmp_path / "new" / "dir" / "config.json").read_text())["tie_word_embeddings"] is True
    assert [p.name for p in (tmp_path / "new" / "dir").iterdir() if p.name.endswith(".tmp")] == []
    config2, params2 = load_hf(tmp_path / "new" / "dir")
    assert config2 == config and params2.keys() == params.keys()
    for name in params:
        assert params2[name].dtype == np.float32
        assert params2[name].tobytes() == params[name].tobytes(), name


def test_load_accepts_prefixless_names_buffers_and_tied_head(tmp_path, hf_model):
    config, params = hf_model
    tensors = {name.removeprefix("transformer."): value for name, value in hf_tensors().items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))  # old HF mask buffer
    tensors["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
    tensors["lm_head.weight"] = tensors["wte.weight"]
    _, loaded = load_hf(copy_checkpoint(tmp_path, tensors))
    for name in params:
        np.testing.assert_array_equal(loaded[name], params[name])


def test_load_rejects_untied_head(tmp_path):
    tensors = hf_tensors()
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    with pytest.raises(ValueError, match="untied LM heads are unsupported"):
        load_hf(copy_checkpoint(tmp_path, tensors))


def test_load_missing_unexpected_and_misshapen_tensors(tmp_path):
    tensors = hf_tensors()
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match=r"tensor 'h.1.mlp.c_fc.bias' \(expected shape \(128,\)\) is missing from .*model.safetensors"):
        load_hf(copy_checkpoint(tmp_path / "a", tensors))

    tensors = hf_tensors()
    tensors["transformer.h.0.attn.c_proj.weight"] = np.zeros((32, 33), np.float32)
    with pytest.raises(ValueError, match=r"tensor 'h.0.attn.c_proj.weight' has shape \(32, 33\) in .*model.safetensors, expected \(32, 32\)"):
        load_hf(copy_checkpoint(tmp_path / "b", tensors))

    tensors = hf_tensors()
    tensors["transformer.h.2.ln_1.weight"] = np.ones(32, np.float32)
    with pytest.raises(ValueError, match=r"unexpected tensor 'h.2.ln_1.weight' with shape \(32,\) in .*model.safetensors"):
        load_hf(copy_checkpoint(tmp_path / "c", tensors))


def test_load_missing_files(tmp_path):
    directory = copy_checkpoint(tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither .*model.safetensors nor .*index.json exists"):
        load_hf(directory)
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf(directory)


def test_load_config_with_bad_head_count(tmp_path):
    directory = copy_checkpoint(tmp_path)
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "n_head": 5}))
    with pytest.raises(ValueError, match="n_head=5 does not divide n_embd=32"):
        load_hf(directory)


def test_save_rejects_wrong_params(tmp_path, hf_model):
    config, params = hf_model
    with pytest.raises(ValueError, match="tensor 'ln_f.bias' .* is missing from the params to save"):
        write_hf(tmp_path, config, {k: v for k, v in params.items() if k != "ln_f.bias"})
    assert list(tmp_path.iterdir()) == []
