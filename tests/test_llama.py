"""The tiled Llama (jnntile.models.llama) against the pure-JAX reference and transformers' saved results.

* Logits, loss and the gradient of every parameter equal the reference's (1e-5) for the two fixtures
  (Llama 3 with grouped-query attention, frequency scaling and an untied head; Qwen2 with q/k/v biases and
  a tied head) on one tile, many tiles and uneven tiles, and transformers' own (1e-4).
* Hugging Face files: the fixture loads from one file and from bfloat16 shards; `save_hf` writes the
  fixture back bit for bit; damaged or foreign checkpoints are refused naming the problem.
* Greedy decoding with the key/value cache equals the reference's; the commands train (and resume
  bit for bit), export and generate a Llama as they do a GPT-2.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from conftest import BFLOAT16_MODEL_TOL, PACKED_TILE_SEQS, check_packed_against_alone, rel_err
from flax import nnx

import jnntile
from jnntile.training import checkpoint, optim
from jnntile import data as data_mod
from jnntile.models import decoding
from jnntile import generate as generate_mod
from jnntile import train as train_mod
from jnntile.models import families, loss_and_grads
from jnntile.models import hf as hf_files
from jnntile.models.llama import hf
from jnntile.models.llama import reference as ref

pytestmark = pytest.mark.usefixtures("placement")

DATA = Path(__file__).parent / "data"
FIXTURES = ["llama", "qwen2"]
B, T = 2, 16
TILINGS = {  # the fixtures: C 32, KV 2 (G 2), D 8, I 64, V 320
    "one tile": {},
    "many tiles": dict(tile_batch=1, tile_seq=4, tile_embd=8, tile_heads=1, tile_hidden=16, tile_vocab=64),
    "uneven tiles": dict(tile_batch=1, tile_seq=6, tile_embd=12, tile_heads=1, tile_hidden=40, tile_vocab=96),
}


def _fixture(name):
    directory = DATA / f"hf_tiny_{name}"
    params = safetensors.numpy.load_file(directory / "model.safetensors")
    return directory, params, dict(np.load(DATA / f"hf_tiny_{name}_expected.npz"))


def _loss_and_grads(model, idx, targets):
    loss, grads = loss_and_grads(model, idx, targets)
    tensors = dict(zip(model.named_params(), jnntile.nn.tensors(grads)))
    # The gradients in Hugging Face's names and layouts, as the parameters convert.
    hf_grads = hf.from_model(model.config, {name: jnntile.grad_of(g) for name, g in tensors.items()})
    return float(loss), {name: np.asarray(g) for name, g in hf_grads.items()}


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("name", FIXTURES)
def test_logits_loss_and_gradients_match_the_reference_and_transformers(name, tiling):
    directory, params, expected = _fixture(name)
    idx, targets = expected["idx"], expected["targets"]
    model = families.from_hf(directory, batch_size=B, seq_len=T, **TILINGS[tiling])
    logits, _ = model(model.token_tensor(idx))
    config = model.config
    ref_params = {k: jnp.asarray(v) for k, v in params.items()}
    assert rel_err(logits.numpy(), ref.forward(ref_params, config, jnp.asarray(idx))) < 1e-5
    assert rel_err(logits.numpy(), expected["logits"]) < 1e-4
    loss, grads = _loss_and_grads(model, idx, targets)
    ref_loss, ref_grads = jax.value_and_grad(ref.loss)(ref_params, config, jnp.asarray(idx), jnp.asarray(targets))
    assert abs(loss - float(ref_loss)) < 1e-5 * float(ref_loss)
    assert set(grads) == set(ref_grads)
    for key, grad in grads.items():
        assert rel_err(grad, ref_grads[key]) < 1e-5, key
        assert rel_err(grad, expected["grad:" + key]) < 1e-4, key


@pytest.mark.parametrize("tiling", ["one tile", "uneven tiles"])
@pytest.mark.parametrize("name", FIXTURES)
def test_bfloat16_matches_transformers_and_the_reference_within_rounding(name, tiling):
    """dtype="bfloat16": logits near transformers' float32 ones, float32 master gradients near the
    reference's, within bfloat16 rounding (BFLOAT16_MODEL_TOL)."""
    directory, params, expected = _fixture(name)
    idx, targets = expected["idx"], expected["targets"]
    model = families.from_hf(directory, batch_size=B, seq_len=T, dtype="bfloat16", **TILINGS[tiling])
    logits, _ = model(model.token_tensor(idx))
    assert logits.dtype == "bfloat16"
    assert rel_err(logits.numpy(), expected["logits"]) < BFLOAT16_MODEL_TOL
    loss, grads = _loss_and_grads(model, idx, targets)
    ref_params = {k: jnp.asarray(v) for k, v in params.items()}
    ref_loss, ref_grads = jax.value_and_grad(ref.loss)(ref_params, model.config, jnp.asarray(idx),
                                                       jnp.asarray(targets))
    assert abs(loss - float(ref_loss)) < BFLOAT16_MODEL_TOL * float(ref_loss)
    for key, grad in grads.items():
        assert grad.dtype == np.float32, key
        assert rel_err(grad, ref_grads[key]) < BFLOAT16_MODEL_TOL, key


def test_save_hf_writes_the_checkpoint_back(tmp_path):
    directory, params, _ = _fixture("llama")
    model = families.from_hf(directory, batch_size=B, seq_len=T, **TILINGS["uneven tiles"])
    families.save_hf(model, tmp_path)
    saved = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    assert list(saved) == list(model.config.param_shapes())
    for key, value in params.items():
        np.testing.assert_array_equal(saved[key], value, err_msg=key)
    assert families.read_config(tmp_path, **TILINGS["uneven tiles"]) == model.config


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", FIXTURES)
def test_drawing_or_loading_a_model_counts_each_parameter_once_in_the_progress_bar(name, quantize):
    directory = _fixture(name)[0]
    config = families.read_config(directory)
    with jnntile.nn.quantized_base(quantize):
        for make in (lambda: families.build(config, batch_size=B, seq_len=T),
                     lambda: families.from_hf(directory, batch_size=B, seq_len=T)):
            with jnntile.nn.progress(config.n_params(), "parameters") as bar:
                make()
            assert bar.n == config.n_params()


def test_checkpoint_written_in_shards_reads_back_equal(tmp_path):
    directory, params, _ = _fixture("qwen2")
    model = families.from_hf(directory, batch_size=B, seq_len=T, **TILINGS["uneven tiles"])
    families.save_hf(model, tmp_path, dtype="bfloat16", max_shard_bytes=4_000)
    index = json.loads((tmp_path / hf_files.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / hf_files.WEIGHTS_FILE).exists()
    assert list(index["weight_map"]) == list(model.config.param_shapes())
    config, loaded = families.load_hf(tmp_path)
    assert config == families.read_config(directory)
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name], value.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=name)


def test_bfloat16_shards_load(tmp_path):
    directory, params, expected = _fixture("qwen2")
    shutil.copy(directory / "config.json", tmp_path)
    names = list(params)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for shard, keys in shards.items():
        safetensors.numpy.save_file({k: params[k].astype(ml_dtypes.bfloat16) for k in keys}, tmp_path / shard)
    weight_map = {key: shard for shard, keys in shards.items() for key in keys}
    (tmp_path / hf_files.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = families.from_hf(tmp_path, batch_size=B, seq_len=T, **TILINGS["many tiles"])
    rounded = {k: jnp.asarray(v.astype(ml_dtypes.bfloat16).astype(np.float32)) for k, v in params.items()}
    logits, _ = model(model.token_tensor(expected["idx"]))
    assert rel_err(logits.numpy(), ref.forward(rounded, model.config, jnp.asarray(expected["idx"]))) < 1e-5


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.safetensors").unlink(), "neither .* nor .* exists"),
    (lambda d: (d / "config.json").write_text('{"model_type": "bert"}'),
     "model_type 'bert' in config.json is not supported; jnntile reads gpt2, llama, mistral, qwen2"),
])
def test_damaged_checkpoints_are_refused_naming_the_problem(tmp_path, damage, message):
    directory, _, _ = _fixture("llama")
    shutil.copytree(directory, tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        families.from_hf(tmp_path / "ckpt", batch_size=B, seq_len=T)


@pytest.mark.parametrize("fields, message", [
    (dict(hidden_size=66), r"num_attention_heads=4 does not divide hidden_size=66; choose num_attention_heads among "
                           r"divisors \[1, 2, 3, 6, 11, 22, 33, 66\]"),
    (dict(hidden_size=36, num_attention_heads=4), "head_dim=9 is odd: the rotary embedding turns pairs of features"),
    (dict(num_attention_heads=3, hidden_size=48), "num_key_value_heads=2 does not divide num_attention_heads=3"),
    (dict(dropout=0.1), "dropout=0.1: the Llama family has no dropout; it must be 0"),
])
def test_a_config_that_is_no_llama_is_refused_where_it_is_made(fields, message):
    with pytest.raises(ValueError, match=message):
        families.preset("llama-tiny", **fields)


def test_a_preset_s_head_dim_follows_the_width_and_head_count_given():
    assert families.preset("llama-tiny", hidden_size=128).head_dim == 32
    assert families.preset("llama-tiny", num_attention_heads=8).head_dim == 8
    assert families.preset("llama-tiny", hidden_size=128, head_dim=16).head_dim == 16  # as config.json may give it


# ---- decoding and the commands ----------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_decoding_equals_the_reference(name):
    # Prompts of different lengths in one batch, the cache tiled unevenly: each continuation is the one the
    # reference's full forward picks token by token.
    directory, params, _ = _fixture(name)
    prompts = [[5, 17, 99, 3, 250, 8, 41], [7, 300, 12]]
    new_tokens = 6
    model = families.from_hf(directory, batch_size=2, seq_len=5, tile_seq=5, tile_heads=1)
    continuations = decoding.Decoder(model, batch_size=2, max_len=12, prefill_chunk=4).generate(
        prompts, new_tokens, temperature=0)
    ref_params = {k: jnp.asarray(v) for k, v in params.items()}
    for prompt, continuation in zip(prompts, continuations):
        tokens = list(prompt)
        for _ in range(new_tokens):
            logits = ref.forward(ref_params, model.config, jnp.asarray([tokens]))
            tokens.append(int(jnp.argmax(logits[0, -1])))
        assert continuation == tokens[len(prompt):]


def test_train_resume_export_and_generate_from_the_command_line(dataset, tmp_path):
    common = ["--data", str(dataset), "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
              "--eval-interval", "0", "--samples", "0", "--quiet", "--tile-hidden", "64", "--tile-vocab", "128"]
    train_mod.train(train_mod.parse_args([*common, "--steps", "6", "--out", str(tmp_path / "whole")]))
    train_mod.train(train_mod.parse_args([*common, "--steps", "3", "--out", str(tmp_path / "parts")]))
    train_mod.train(train_mod.parse_args([*common, "--steps", "6", "--out", str(tmp_path / "parts"), "--resume",
                                          "--export-hf", str(tmp_path / "hf")]))
    def losses(out):
        return [json.loads(line)["loss"] for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("whole")) == 6 and losses("parts") == losses("whole")  # resuming changes nothing
    exported = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    config = families.read_config(tmp_path / "hf")
    assert config.model_type == "llama" and set(exported) == set(config.param_shapes())
    texts = generate_mod.generate(generate_mod.parse_args(
        ["--checkpoint", str(tmp_path / "parts"), "--prompt", "alpha beta", "--max-new-tokens", "4",
         "--temperature", "0"]))
    assert len(texts) == 1 and texts[0].startswith("alpha beta")


def test_fine_tune_a_hugging_face_llama_on_text_prepared_with_its_tokenizer(tmp_path):
    directory, _, _ = _fixture("llama")
    text = tmp_path / "text.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(["tiles", "move", "between", "RAM", "and", "disk"], 20))
                              for _ in range(200)))
    data_mod.main([str(text), "--out", str(tmp_path / "data"), "--tokenizer", str(directory)])
    summary = train_mod.train(train_mod.parse_args(
        ["--data", str(tmp_path / "data"), "--init-from-hf", str(directory), "--batch-size", "2", "--seq-len", "16",
         "--steps", "4", "--eval-interval", "0", "--samples", "0", "--quiet", "--out", str(tmp_path / "out"),
         "--export-hf", str(tmp_path / "tuned")]))
    assert summary["last_loss"] < summary["first_loss"]
    assert families.read_config(tmp_path / "tuned") == families.read_config(directory)
    texts = generate_mod.generate(generate_mod.parse_args(
        ["--hf", str(tmp_path / "tuned"), "--tokenizer", str(directory), "--prompt", "tiles move", "--max-new-tokens",
         "3", "--temperature", "0"]))
    assert texts[0].startswith("tiles move")


def test_a_checkpoint_of_a_llama_with_rope_scaling_resumes(tmp_path):
    # The config's rope_scaling is a tuple of pairs, which state.json holds as lists.
    directory, _, _ = _fixture("llama")
    model = families.from_hf(directory, batch_size=B, seq_len=T)
    assert model.config.rope_scaling is not None
    tx = optim.adamw(1e-3)
    params = nnx.state(model, nnx.Param)
    path = checkpoint.save(tmp_path, model=model, opt_state=tx.init(params), step=1, state={})
    again = families.from_hf(directory, batch_size=B, seq_len=T, tile_seq=8)
    _, record = checkpoint.restore(path, model=again, opt_state=tx.init(nnx.state(again, nnx.Param)))
    assert record["step"] == 1


@pytest.mark.parametrize("tiling", PACKED_TILE_SEQS)
@pytest.mark.parametrize("name", FIXTURES)
def test_packed_examples_get_what_they_get_alone(name, tiling):
    """Document masking and rotary positions restarting at 0 per example (packing_tensors), grouped-query
    attention: every example of a packed batch gets the logits and gradients it gets alone, on one, many and
    uneven sequence tiles."""
    directory, _, _ = _fixture(name)

    def make_model(b, t):
        return families.from_hf(directory, batch_size=b, seq_len=t, tile_batch=1, tile_seq=PACKED_TILE_SEQS[tiling])
    check_packed_against_alone(make_model, 320)
