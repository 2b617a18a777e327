"""The jnntile GPT-2 against the pure-JAX reference: logits, loss and every gradient.

Checked for 1 to 3 layers and three tilings (one tile per tensor, many tiles,
uneven tiles), eagerly and under jit, plus Hugging Face checkpoints and bad input.
"""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import BFLOAT16_MODEL_TOL, PACKED_TILE_SEQS, check_packed_against_alone, rel_err
from flax import nnx

import jnntile
from jnntile.models import families, gpt2, gpu_aligned_tile, resolve_tiles
from jnntile.models.gpt2 import reference as ref
from jnntile.models.gpt2.config import GPT2Config
from jnntile.models.families import load_hf

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

B, T = 2, 16
BASE = GPT2Config(n_layer=1, n_head=4, n_embd=32, vocab_size=96, n_positions=32)
TILINGS = {
    "one tile": dict(tile_batch=B, tile_seq=T, tile_embd=32, tile_heads=4, tile_hidden=128, tile_vocab=96),
    "many tiles": dict(tile_batch=1, tile_seq=4, tile_embd=8, tile_heads=1, tile_hidden=32, tile_vocab=24),
    "uneven tiles": dict(tile_batch=1, tile_seq=6, tile_embd=12, tile_heads=3, tile_hidden=40, tile_vocab=40),
}
FIXTURE = Path(__file__).parent / "data" / "hf_tiny_gpt2"


def _batch(config, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    targets[0, :3] = -100  # ignored positions
    return idx, targets


def _model_like_reference(config, params):
    model = gpt2.GPT2(config, batch_size=B, seq_len=T)
    model.load_hf_params({k: np.asarray(v) for k, v in params.items()})
    return model


def _check_against_reference(model, config, params, idx, targets, loss, grads, logits):
    ref_loss, ref_grads = jax.value_and_grad(lambda p: ref.loss(p, config, idx, targets))(params)
    assert rel_err(logits, ref.forward(params, config, idx)) < 1e-5, "logits differ"
    assert rel_err(loss, ref_loss) < 1e-5, "loss differs"
    named_grads = dict(zip(model.named_params(), jnntile.nn.tensors(grads)))
    assert set(named_grads) == set(ref_grads)
    for name, g in named_grads.items():
        values = jnntile.grad_of(g).numpy().reshape(ref_grads[name].shape)
        assert rel_err(values, ref_grads[name]) < 1e-5, f"gradient of {name} differs"


@pytest.mark.parametrize("tiling", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("n_layer", [1, 3])
def test_matches_reference_eagerly(tiling, n_layer):
    config = dataclasses.replace(BASE, n_layer=n_layer, **tiling)
    params = ref.init_params(config, seed=n_layer)
    model = _model_like_reference(config, params)
    idx, targets = _batch(config)

    def loss_fn(m, idx, targets):
        logits, loss = m(m.token_tensor(idx), m.token_tensor(targets, allow_ignore=True))
        return loss, logits

    # Logits are read after differentiating, so activations are kept (they are
    # invalidated by default; the jit test below reads them inside instead).
    (loss, logits), grads = jnntile.nn.value_and_grad(loss_fn, has_aux=True, keep_activations=True)(
        model, idx, targets)
    _check_against_reference(model, config, params, idx, targets, loss, grads, logits.numpy())


@pytest.mark.parametrize("tiling", TILINGS.values(), ids=TILINGS.keys())
def test_matches_reference_under_jit(tiling):
    config = dataclasses.replace(BASE, n_layer=2, **tiling)
    params = ref.init_params(config, seed=5)
    model = _model_like_reference(config, params)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, idx, targets):
        m = nnx.merge(graphdef, state)

        def loss_fn(m, idx, targets):
            logits, loss = m(m.token_tensor(idx), m.token_tensor(targets, allow_ignore=True))
            return loss, jnntile.to_array(logits)

        return jnntile.nn.value_and_grad(loss_fn, has_aux=True)(m, idx, targets)

    for seed in range(2):  # the second batch reuses the compiled program and its tensors
        idx, targets = _batch(config, seed)
        (loss, logits), grads = step(state, idx, targets)
        _check_against_reference(model, config, params, idx, targets, loss, grads, logits)
    assert step._cache_size() == 1


def test_loss_from_hugging_face_checkpoint_matches_reference():
    model = families.from_hf(FIXTURE, batch_size=B, seq_len=T, tile_seq=5, tile_embd=12, tile_vocab=40)
    config, params = load_hf(FIXTURE)
    idx, targets = _batch(config, seed=3)
    _, loss = model(model.token_tensor(idx), model.token_tensor(targets, allow_ignore=True))
    assert rel_err(loss.numpy(), ref.loss(params, config, idx, targets)) < 1e-5


FIXTURE_TILINGS = {  # the fixture: C 32, H 2, V 96
    "one tile": {},
    "many tiles": dict(tile_batch=1, tile_seq=4, tile_embd=8, tile_heads=1, tile_hidden=32, tile_vocab=24),
    "uneven tiles": dict(tile_batch=1, tile_seq=5, tile_embd=12, tile_hidden=40, tile_vocab=40),
}


@pytest.mark.parametrize("tiling", FIXTURE_TILINGS.values(), ids=FIXTURE_TILINGS.keys())
def test_bfloat16_matches_hugging_face_and_the_reference_within_rounding(tiling):
    """--dtype bfloat16 on the Hugging Face fixture: bfloat16 activations and weight copies, float32 masters
    whose gradients match the float32 reference's within bfloat16 rounding (BFLOAT16_MODEL_TOL)."""
    model = families.from_hf(FIXTURE, batch_size=B, seq_len=T, dtype="bfloat16", **tiling)
    config, params = load_hf(FIXTURE)
    expected = np.load(FIXTURE.parent / "hf_tiny_gpt2_expected.npz")
    idx, targets = expected["idx"], expected["targets"]

    def loss_fn(m, idx, targets):
        logits, loss = m(m.token_tensor(idx), m.token_tensor(targets, allow_ignore=True))
        return loss, logits

    (loss, logits), grads = jnntile.nn.value_and_grad(loss_fn, has_aux=True, keep_activations=True)(
        model, idx, targets)
    assert logits.dtype == "bfloat16"
    assert rel_err(logits.numpy(), expected["logits"]) < BFLOAT16_MODEL_TOL
    assert abs(float(loss) - float(expected["loss"])) < BFLOAT16_MODEL_TOL * float(expected["loss"])
    ref_grads = jax.grad(lambda p: ref.loss(p, config, idx, targets))(params)
    for name, g in zip(model.named_params(), jnntile.nn.tensors(grads)):
        values = jnntile.grad_of(g).numpy()
        assert values.dtype == np.float32, f"the gradient of the master {name} is float32"
        assert rel_err(values.reshape(ref_grads[name].shape), ref_grads[name]) < BFLOAT16_MODEL_TOL, name


def test_a_model_built_for_loading_computes_no_initial_values():
    config = load_hf(FIXTURE)[0]
    jnntile.runtime.wait_all()
    before = jnntile.runtime.stats()["tasks_submitted"]
    with jnntile.nn.uninitialized():
        model = gpt2.GPT2(config, batch_size=B, seq_len=T)
    assert jnntile.runtime.stats()["tasks_submitted"] == before
    with pytest.raises(ValueError, match="read before anything wrote it"):
        model.named_params()["wte.weight"].get_value().numpy()


def test_save_to_hugging_face_round_trips_exactly(tmp_path):
    model = families.from_hf(FIXTURE, batch_size=B, seq_len=T, tile_embd=12)
    families.save_hf(model, tmp_path / "out")
    config, params = load_hf(tmp_path / "out")
    _, original = load_hf(FIXTURE)
    assert config == load_hf(FIXTURE)[0]
    for name in original:
        np.testing.assert_array_equal(params[name], original[name])


def test_checkpoint_written_in_shards_reads_back_equal(tmp_path):
    model = families.from_hf(FIXTURE, batch_size=B, seq_len=T, tile_embd=12)
    families.save_hf(model, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json", *shards])
    assert all(name.startswith("transformer.") for name in index["weight_map"])  # save_pretrained's names
    for shard in shards:
        tensors = safetensors.numpy.load_file(tmp_path / "out" / shard)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 20_000, shard
    config, params = load_hf(tmp_path / "out")
    original_config, original = load_hf(FIXTURE)
    assert config == original_config and list(params) == list(original)
    for name in original:
        np.testing.assert_array_equal(params[name], original[name], err_msg=name)
    families.save_hf(model, tmp_path / "out")  # one file again: the shards of the first save are gone
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_same_seed_same_weights_for_any_tiling():
    one = gpt2.GPT2(dataclasses.replace(BASE, **TILINGS["one tile"]), batch_size=B, seq_len=T, seed=3)
    uneven = gpt2.GPT2(dataclasses.replace(BASE, **TILINGS["uneven tiles"]), batch_size=B, seq_len=T, seed=3)
    a, b = one.to_hf_params(), uneven.to_hf_params()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_head_count_must_divide_width():
    with pytest.raises(ValueError, match="n_head=5 does not divide n_embd=32"):
        dataclasses.replace(BASE, n_head=5)


def test_tile_larger_than_its_axis():
    config = dataclasses.replace(BASE, tile_heads=8)
    with pytest.raises(ValueError, match="tile_heads=8 is larger than its axis"):
        gpt2.GPT2(config, batch_size=B, seq_len=T)


@pytest.mark.parametrize("gpu_mb, vocab, embd, hidden, rows", [
    # A GPU's feature tiles are multiples of 64 (tensor cores) but the last; GPT-2's odd vocabulary cannot be
    # aligned, so its one misaligned tile is made the smallest (3 x 16384 + 1105, not 4 x 12565 all misaligned).
    (80000, 16384, 768, 3072, 8192),
    (0, 7180, 768, 1536, 512),  # CPU workers: even splits, as measured (jnntile/models/__init__.py)
])
def test_automatic_tiles_of_gpt2_124m_on_cpu_and_gpu(gpu_mb, vocab, embd, hidden, rows, monkeypatch):
    monkeypatch.setattr(jnntile.runtime, "gpu_memory_mb", lambda config=None: gpu_mb)
    tiles = resolve_tiles(GPT2Config(), batch_size=8, seq_len=1024)
    assert (tiles.vocab, tiles.embd, tiles.hidden, tiles.batch * tiles.seq) == (vocab, embd, hidden, rows)


def test_gpu_tiles_of_an_aligned_axis_are_multiples_of_64():
    # Qwen2's vocabulary (151936 = 64 x 2374) in 10 tiles: 9 x 15232 + 14848, where an even split is 15193.6.
    assert gpu_aligned_tile(151936, 16384) == 15232
    assert gpu_aligned_tile(11008, 8192) == 5504  # Llama 2 7B's hidden axis, already aligned
    assert gpu_aligned_tile(768, 4096) == 768  # a whole axis is one tile

def test_sequence_longer_than_positions():
    with pytest.raises(ValueError, match="n_positions"):
        gpt2.GPT2(BASE, batch_size=B, seq_len=64)


def test_token_ids_out_of_range():
    model = gpt2.GPT2(BASE, batch_size=B, seq_len=T)
    idx, _ = _batch(BASE)
    idx[1, 2] = BASE.vocab_size
    submitted = jnntile.runtime.stats()["tasks_submitted"]
    with pytest.raises(ValueError, match="96"):
        model.token_tensor(idx)
    assert jnntile.runtime.stats()["tasks_submitted"] == submitted


def test_batch_of_wrong_shape():
    model = gpt2.GPT2(BASE, batch_size=B, seq_len=T)
    with pytest.raises(ValueError, match="built for"):
        model.token_tensor(np.zeros((B, T + 1), np.int32))


def test_checkpoint_with_missing_or_misshapen_tensor(tmp_path):
    config, params = load_hf(FIXTURE)
    del params["h.0.mlp.c_fc.bias"]
    save_dir = tmp_path / "broken"
    save_dir.mkdir()
    (save_dir / "config.json").write_text(json.dumps(config.to_hf_dict()))
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in params.items()}, save_dir / "model.safetensors")
    with pytest.raises(ValueError, match="h.0.mlp.c_fc.bias"):
        families.from_hf(save_dir, batch_size=B, seq_len=T)
    model = gpt2.GPT2(config, batch_size=B, seq_len=T)
    _, params = load_hf(FIXTURE)
    params["wpe.weight"] = params["wpe.weight"][:, :-1]
    with pytest.raises(ValueError, match="wpe.weight"):
        model.load_hf_params(params)


@pytest.mark.parametrize("remat", ["none", "block"])
@pytest.mark.parametrize("tiling", PACKED_TILE_SEQS)
def test_packed_examples_get_what_they_get_alone(tiling, remat):
    """Document masking and positions restarting at 0 per example (packing_tensors): every example of a packed
    batch gets the logits and gradients it gets alone, on one, many and uneven sequence tiles."""
    config = dataclasses.replace(BASE, n_layer=2, tile_batch=1, tile_seq=PACKED_TILE_SEQS[tiling], remat=remat)
    check_packed_against_alone(lambda b, t: gpt2.GPT2(config, batch_size=b, seq_len=t), config.vocab_size)
