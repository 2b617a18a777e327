"""Fine-tuning: frozen parameters and LoRA adapters.

* `nn.LoRA` forward and gradients against pure JAX (base frozen, adapters trained), weights stored
  output-first and input-first, one, many and uneven tiles, float32 and bfloat16; the frozen base gets
  no gradient companion at all.
* The training command: `--freeze` / `--train-only` leave the frozen weights bitwise unchanged and give
  them no optimizer state; `--lora-rank` trains adapters on a Hugging Face Llama and a GPT-2 whose base
  stays bitwise unchanged, resumes bit-identically from checkpoints that hold the adapters alone, exports
  them in PEFT's layout (`--export-lora`) and merged (`--export-hf --merge-lora` equals base + scale B A
  computed from the exported adapter), and `generate --lora` applies them unmerged.
* PEFT's own files (tests/data/peft_tiny_*, written by tools/make_lora_fixtures.py with `peft`): loaded onto
  the Hugging Face fixtures they give PEFT's logits, loss and adapter gradients.
* The planner counts frozen parameters once, without gradients or optimizer state.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BFLOAT16_TOL, counter_uniform01
from flax import nnx

import jnntile
from jnntile.training import checkpoint, lora
from jnntile import nn, planning
from jnntile.io import tensorfile
from jnntile import generate as generate_mod
from jnntile.training import step as step_mod
from jnntile import train as train_mod
from jnntile.models import families
from jnntile.ops import quant

DATA = Path(__file__).parent / "data"

# (input tiles, output tiles) of a (2, 5, 8) -> (2, 5, 3, 4) projection
TILINGS = {"one tile": ((2, 5, 8), (3, 4)), "many tiles": ((1, 2, 4), (1, 2)), "uneven tiles": ((1, 3, 3), (2, 3))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("out_first", [True, False], ids=["output-first", "input-first"])
@pytest.mark.parametrize("tiles", TILINGS.values(), ids=TILINGS.keys())
def test_lora_values_and_gradients_match_jax(rng, tiles, out_first, dtype):
    (x_tiles, out_tiles) = tiles
    base = nn.Linear((8,), (3, 4), in_tiles=x_tiles[-1:], out_tiles=out_tiles, seed=1, name="proj",
                     weight_out_first=out_first, dtype=dtype)
    module = nn.LoRA(base, [nn.AdapterSpec("proj", 2, 3.0)], seed=1, name="proj")
    adapter = module.adapters["proj"]
    b = rng.standard_normal(adapter.lora_b.get_value().shape).astype(np.float32)  # B starts at zero: give it values
    adapter.lora_b.set_value(jnntile.from_array(b, adapter.lora_b.get_value().tile_shape))
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    weights = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    read = lambda p: np.asarray(jnntile.to_array(p.get_value()))  # noqa: E731
    w, a, bias = read(base.weight), read(adapter.lora_a), read(base.bias)
    cast = (lambda v: jnp.asarray(v, jnp.bfloat16)) if dtype == "bfloat16" else jnp.asarray

    def loss(model, xt):
        y = model(xt)
        return jnp.sum(jnntile.to_array(jnntile.convert(y, "float32") if dtype == "bfloat16" else y) * weights)

    value, grads = nn.value_and_grad(loss, wrt=nnx.LoRAParam)(module, jnntile.from_array(cast(x), x_tiles))

    def reference(a, b):  # in the same mixed precision: bfloat16 operands and results, float32 products and bias
        def product(spec, p, q):
            return jnp.einsum(spec, cast(p), cast(q), preferred_element_type=jnp.float32).astype(cast(x).dtype)
        if out_first:
            y, low = product("btc,jhc->btjh", x, w), product("btc,rc->btr", x, a)
            delta = jnp.einsum("btr,jhr->btjh", low, cast(b), preferred_element_type=jnp.float32) * 1.5
        else:
            y, low = product("btc,cjh->btjh", x, w), product("btc,cr->btr", x, a)
            delta = jnp.einsum("btr,rjh->btjh", low, cast(b), preferred_element_type=jnp.float32) * 1.5
        y = (y.astype(jnp.float32) + bias).astype(y.dtype)
        return jnp.sum((y + delta.astype(y.dtype)).astype(jnp.float32) * weights)

    expected, (grad_a, grad_b) = jax.value_and_grad(reference, argnums=(0, 1))(a, b)
    tol = BFLOAT16_TOL if dtype == "bfloat16" else 1e-5
    scale = float(np.abs(expected)) + 1.0
    assert abs(float(value) - float(expected)) <= tol * scale
    got = dict(nnx.to_flat_state(grads))
    keys = {kind: ("adapters", "proj", kind) for kind in ("lora_a", "lora_b")}
    assert set(got) == set(keys.values())
    for key, want in ((keys["lora_a"], grad_a), (keys["lora_b"], grad_b)):
        have = np.asarray(jnntile.to_array(jnntile.grad_of(got[key].get_value())))
        np.testing.assert_allclose(have, want, atol=tol * (np.abs(want).max() + 1.0), rtol=tol)
    assert base.weight.get_value().handle.grad is None  # frozen: not even a gradient companion


def test_merged_weight_is_base_plus_scaled_product(rng):
    base = nn.Linear((6,), (4,), in_tiles=(4,), out_tiles=(3,), seed=2, name="p", weight_out_first=True)
    module = nn.LoRA(base, [nn.AdapterSpec("p", 3, 6.0)], seed=2, name="p")
    b = rng.standard_normal((4, 3)).astype(np.float32)
    module.adapters["p"].lora_b.set_value(jnntile.from_array(b, (3, 3)))
    read = lambda t: np.asarray(jnntile.to_array(t))  # noqa: E731
    expected = read(base.weight.get_value()) + 2.0 * b @ read(module.adapters["p"].lora_a.get_value())
    np.testing.assert_allclose(read(module.merged_weight()), expected, rtol=1e-6, atol=1e-6)


def _lora_dropout_mask(shape, rate: float, seed: int, site: int) -> np.ndarray:
    """The kept elements of dropout at `site` under the step's `seed` (nn.Dropout, kernels/dropout.h)."""
    g = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
    return counter_uniform01((seed * 7919 + site) ^ 0xD60F0A7E5EED, g) >= rate


def test_lora_dropout_masks_each_adapters_input_in_training_only(rng):
    """PEFT's lora_B(lora_A(dropout(x))) * scale: the base product reads x, each adapter (here q and k parts of
    one fused product, sharing x) its own mask of x, scaled by 1 / (1 - p); without a seed (evaluation,
    generation) no mask."""
    rate, seed, first_site = 0.5, 7, 5
    base = nn.Linear((8,), (2, 3), in_tiles=(4,), out_tiles=(1, 3), seed=1, name="qk", weight_out_first=True)
    specs = [nn.AdapterSpec(part, 2, 4.0, rows, dropout=rate) for part, rows in (("q", (0, 1)), ("k", (1, 2)))]
    module = nn.LoRA(base, specs, seed=1, name="qk", first_site=first_site)
    read = lambda p: np.asarray(jnntile.to_array(p.get_value()))  # noqa: E731
    factors = []
    for adapter in module.adapters.values():
        b = rng.standard_normal((1, 3, 2)).astype(np.float32)  # B starts at zero: give it values
        adapter.lora_b.set_value(jnntile.from_array(b, (1, 3, 2)))
        factors.append((read(adapter.lora_a), b))
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    w, bias = read(base.weight), read(base.bias)

    def reference(masks):
        y = np.einsum("btc,jhc->btjh", x, w) + bias
        for k, (a, b) in enumerate(factors):
            xk = x if masks is None else x * masks[k] / (1 - rate)
            y[:, :, k:k + 1] += 2.0 * np.einsum("btr,jhr->btjh", xk @ a.T, b)
        return y

    masks = [_lora_dropout_mask(x.shape, rate, seed, first_site + k) for k in range(2)]
    assert (masks[0] != masks[1]).any() and 0.3 < masks[0].mean() < 0.7
    trained = module(jnntile.from_array(x, (1, 3, 4)), dropout_seed=jnp.int32(seed))
    np.testing.assert_allclose(np.asarray(jnntile.to_array(trained)), reference(masks), rtol=1e-5, atol=1e-5)
    evaluated = module(jnntile.from_array(x, (1, 3, 4)))
    np.testing.assert_allclose(np.asarray(jnntile.to_array(evaluated)), reference(None), rtol=1e-5, atol=1e-5)


def _lora_loss_and_grads(config, dropout: float, seed, remat: str = "none"):
    """Loss and adapter gradients of a 3-layer model with adapters of `dropout` (B drawn: nonzero) at `seed`."""
    model = families.build(dataclasses.replace(config, remat=remat), batch_size=2, seq_len=16, seed=3)
    lora.apply(model, lora.LoRASettings(2, 4.0, dropout=dropout))
    rng = np.random.default_rng(0)
    for module in lora.adapters(model).values():
        for adapter in module.adapters.values():
            b = adapter.lora_b.get_value()
            adapter.lora_b.set_value(jnntile.from_array(rng.standard_normal(b.shape).astype(np.float32), b.tile_shape))
    idx = rng.integers(0, config.vocab_size, (2, 16)).astype(np.int32)
    loss, grads = nn.value_and_grad(lambda m: m.loss(idx, idx, seed), wrt=nnx.LoRAParam)(model)
    return float(loss), [jnntile.grad_of(g).numpy() for g in nn.tensors(grads)]


LORA_DROPOUT_CONFIGS = {
    "llama": families.preset("llama-tiny", num_hidden_layers=3, vocab_size=96, tile_seq=8, tile_embd=32,
                             tile_heads=1, tile_hidden=64, tile_vocab=48),
    "gpt2": families.preset("tiny", n_layer=3, n_embd=32, vocab_size=96, n_positions=16, dropout=0.1, tile_seq=8,
                            tile_embd=16, tile_heads=2, tile_hidden=48, tile_vocab=40)}


@pytest.mark.parametrize("family", LORA_DROPOUT_CONFIGS)
def test_lora_dropout_gradients_are_the_same_with_recomputed_blocks(family):
    """The adapters' masks are functions of (the step's seed, their site), so a recomputed block draws them again;
    p = 0 draws none (the same bits as no seed), and p > 0 changes the gradients."""
    config = LORA_DROPOUT_CONFIGS[family]
    seed = jnp.int32(11)
    loss, grads = _lora_loss_and_grads(config, 0.2, seed)
    loss_remat, grads_remat = _lora_loss_and_grads(config, 0.2, seed, remat="block")
    assert loss_remat == loss
    for g, g_remat in zip(grads, grads_remat):
        np.testing.assert_array_equal(g_remat, g)
    plain = _lora_loss_and_grads(config, 0.0, seed)
    if family == "llama":  # no dropout of its own: p = 0 is the model without any
        without = _lora_loss_and_grads(config, 0.0, None)
        assert plain[0] == without[0]
        for g, g_without in zip(plain[1], without[1]):
            np.testing.assert_array_equal(g, g_without)
    assert loss != plain[0] and all((g != g_plain).any() for g, g_plain in zip(grads, plain[1]))


# ---- the training command ------------------------------------------------------------------------

def _train(dataset, out, *extra, hf="hf_tiny_llama"):
    args = ["--data", str(dataset), "--out", str(out), "--batch-size", "2", "--seq-len", "16", "--eval-interval", "0",
            "--samples", "0", "--quiet", "--lr", "1e-2", "--warmup-steps", "0", *extra]
    if hf:  # the suite's corpus (conftest.py) has a BPE of its own: its ids train the adapters all the same
        args += ["--init-from-hf", str(DATA / hf), "--allow-tokenizer-mismatch"]
    return train_mod.train(train_mod.parse_args(args))


def _tensors(path) -> dict:
    return {name: t.read() for name, t in tensorfile.SafetensorsFile(path).items()}


@pytest.mark.parametrize("hf", ["hf_tiny_llama", "hf_tiny_gpt2"])
def test_lora_trains_adapters_and_exports_them_and_the_merged_model(dataset, tmp_path, hf):
    if hf == "hf_tiny_gpt2":  # a vocabulary of 96: token ids of a repeating pattern, without a tokenizer
        dataset = tmp_path / "ids.bin"
        np.tile(np.arange(90, dtype=np.uint16) % 24, 200).tofile(dataset)
    summary = _train(dataset, tmp_path / "out", "--steps", "4", "--lora-rank", "4", "--export-lora",
                     str(tmp_path / "adapter"), "--export-hf", str(tmp_path / "merged"), "--merge-lora", hf=hf)
    assert summary["last_loss"] < summary["first_loss"]
    config = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    adapter = _tensors(tmp_path / "adapter" / lora.ADAPTER_WEIGHTS)
    base = _tensors(DATA / hf / "model.safetensors")
    merged = _tensors(tmp_path / "merged" / "model.safetensors")
    adapted = 0
    for name, weight in base.items():
        module = "base_model.model." + name.removesuffix(".weight")
        expected = weight
        if module + ".lora_A.weight" in adapter:
            update = 2.0 * adapter[module + ".lora_B.weight"] @ adapter[module + ".lora_A.weight"]
            assert np.abs(update).max() > 0  # trained
            expected = weight + (update.T if config["fan_in_fan_out"] else update)
            adapted += 1
        np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)
    n_layers = 2
    assert adapted == n_layers * (7 if hf == "hf_tiny_llama" else 4)  # every projection by default
    # The checkpoint holds the adapters, not the base, and generation applies them unmerged.
    ckpt = checkpoint.latest(tmp_path / "out")
    assert (ckpt / lora.ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").exists()
    if hf == "hf_tiny_gpt2":
        return
    prompt = ["--prompt", "alpha beta", "--tokenizer", str(dataset.parent), "--max-new-tokens", "6", "--temperature",
              "0", "--quiet"]
    unmerged = generate_mod.generate(generate_mod.parse_args(["--hf", str(DATA / hf), "--lora", str(ckpt), *prompt]))
    merged_text = generate_mod.generate(generate_mod.parse_args(["--hf", str(tmp_path / "merged"), *prompt]))
    base_text = generate_mod.generate(generate_mod.parse_args(["--hf", str(DATA / hf), *prompt]))
    assert unmerged == merged_text and unmerged != base_text


def test_lora_resumes_bit_identically_from_adapter_checkpoints(dataset, tmp_path):
    flags = ["--steps", "4", "--lora-rank", "2", "--lora-targets", "q_proj,k_proj,v_proj", "--dtype", "bfloat16"]
    straight = _train(dataset, tmp_path / "a", *flags, "--checkpoint-interval", "2")
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # back to the checkpoint of step 2
    shutil.rmtree(tmp_path / "b" / "ckpt-0000004")
    (tmp_path / "b" / checkpoint.LATEST).write_text("ckpt-0000002")
    resumed = _train(dataset, tmp_path / "b", *flags, "--resume")
    assert resumed["losses"] == straight["losses"][2:]
    assert _tensors(tmp_path / "a" / "ckpt-0000004" / lora.ADAPTER_WEIGHTS).items().__repr__() == \
        _tensors(tmp_path / "b" / "ckpt-0000004" / lora.ADAPTER_WEIGHTS).items().__repr__()
    with pytest.raises(ValueError, match="--lora"):  # a LoRA checkpoint resumed as a full fine-tune
        _train(dataset, tmp_path / "b", "--steps", "5", "--resume")


def test_lora_dropout_is_written_to_the_export_and_read_back(dataset, tmp_path):
    _train(dataset, tmp_path / "out", "--steps", "2", "--lora-rank", "2", "--lora-dropout", "0.25", "--export-lora",
           str(tmp_path / "adapter"))
    ckpt = checkpoint.latest(tmp_path / "out")
    for directory in (tmp_path / "adapter", ckpt):
        assert json.loads((directory / lora.ADAPTER_CONFIG).read_text())["lora_dropout"] == 0.25
        assert lora.read_settings(directory).dropout == 0.25
    # --init-lora trains with the directory's dropout (trained B: the masks change the loss), --lora-dropout
    # overrides it, and a resume must ask for the checkpoint's own.
    again = _train(dataset, tmp_path / "again", "--steps", "1", "--init-lora", str(tmp_path / "adapter"))
    other = _train(dataset, tmp_path / "other", "--steps", "1", "--init-lora", str(tmp_path / "adapter"),
                   "--lora-dropout", "0")
    assert again["first_loss"] != other["first_loss"]
    with pytest.raises(ValueError, match="dropout"):
        _train(dataset, tmp_path / "out", "--steps", "3", "--lora-rank", "2", "--resume")
    with pytest.raises(ValueError, match=r"--lora-dropout 1\.0: the rate of dropout must be in \[0, 1\)"):
        _train(dataset, tmp_path / "bad", "--steps", "1", "--lora-rank", "2", "--lora-dropout", "1")
    with pytest.raises(ValueError, match="--lora-dropout need --lora-rank"):
        _train(dataset, tmp_path / "bad", "--steps", "1", "--lora-dropout", "0.1")
    config = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    (tmp_path / "adapter" / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, "lora_dropout": "high"}))
    with pytest.raises(ValueError, match="lora_dropout is 'high'; it must be a number in"):
        lora.read_settings(tmp_path / "adapter")


def test_lora_resumes_on_its_own_base_only(dataset, tmp_path):
    """A LoRA checkpoint's frozen base is built again at resume: from the same weights (wherever they are now),
    not from other weights of the same shapes, nor from a preset drawn with another --seed."""
    base, moved, other = tmp_path / "base", tmp_path / "moved", tmp_path / "other"
    shutil.copytree(DATA / "hf_tiny_llama", base)
    shutil.copytree(base, other)
    tensors = _tensors(other / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] *= 1.01
    tensorfile.write_file(other / "model.safetensors", tensors, metadata={"format": "pt"})
    flags = ["--lora-rank", "2", "--allow-tokenizer-mismatch"]
    _train(dataset, tmp_path / "out", "--steps", "2", *flags, "--init-from-hf", str(base), hf=None)
    with pytest.raises(ValueError, match=f"trained from --init-from-hf {base}, and --init-from-hf {other} holds other "
                                         "weights"):
        _train(dataset, tmp_path / "out", "--steps", "3", "--resume", *flags, "--init-from-hf", str(other), hf=None)
    with pytest.raises(ValueError, match=f"trained from --init-from-hf {base}: give --init-from-hf {base} to resume"):
        _train(dataset, tmp_path / "out", "--steps", "3", "--resume", *flags, hf=None)
    base.rename(moved)
    with pytest.raises(ValueError, match=f"--init-from-hf {base} does not exist: .* holds the LoRA adapters alone"):
        _train(dataset, tmp_path / "out", "--steps", "3", "--resume", *flags, "--init-from-hf", str(base), hf=None)
    assert _train(dataset, tmp_path / "out", "--steps", "3", "--resume", *flags, "--init-from-hf", str(moved),
                  hf=None)["step"] == 3

    preset = ["--model", "llama-tiny", "--lora-rank", "2"]
    _train(dataset, tmp_path / "preset", "--steps", "1", *preset, "--seed", "1", hf=None)
    with pytest.raises(ValueError, match="trained from --model llama-tiny --seed 1, this run asks for --model "
                                         "llama-tiny --seed 0: give --model llama-tiny --seed 1"):
        _train(dataset, tmp_path / "preset", "--steps", "2", "--resume", *preset, hf=None)


def test_full_fine_tune_resumes_from_its_checkpoint_when_its_base_is_gone(dataset, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(DATA / "hf_tiny_llama", base)
    flags = ["--init-from-hf", str(base), "--allow-tokenizer-mismatch"]
    straight = _train(dataset, tmp_path / "a", "--steps", "3", "--checkpoint-interval", "2", *flags, hf=None)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # back to the checkpoint of step 2
    shutil.rmtree(tmp_path / "b" / "ckpt-0000003")
    (tmp_path / "b" / checkpoint.LATEST).write_text("ckpt-0000002")
    shutil.rmtree(base)
    resumed = _train(dataset, tmp_path / "b", "--steps", "3", "--resume", *flags, hf=None)
    assert resumed["losses"] == straight["losses"][2:]
    assert f"--init-from-hf {base} does not exist; resuming from" in capsys.readouterr().err


def test_lora_targets_compare_as_sets_with_the_defaults_resolved(dataset, tmp_path):
    _train(dataset, tmp_path / "a", "--steps", "1", "--lora-rank", "2", "--lora-targets", "v_proj,q_proj,k_proj")
    assert _train(dataset, tmp_path / "a", "--steps", "2", "--resume", "--lora-rank", "2", "--lora-targets",
                  "q_proj,k_proj,v_proj")["step"] == 2
    _train(dataset, tmp_path / "b", "--steps", "1", "--lora-rank", "2")
    every = "down_proj,up_proj,gate_proj,o_proj,v_proj,k_proj,q_proj"
    assert _train(dataset, tmp_path / "b", "--steps", "2", "--resume", "--lora-rank", "2", "--lora-targets",
                  every)["step"] == 2
    with pytest.raises(ValueError, match="--lora"):  # other adapters all the same
        _train(dataset, tmp_path / "b", "--steps", "3", "--resume", "--lora-rank", "2", "--lora-targets", "o_proj")


def test_exports_never_land_on_the_base(dataset, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(DATA / "hf_tiny_llama", base)
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    flags = ["--steps", "1", "--init-from-hf", str(base), "--allow-tokenizer-mismatch"]
    with pytest.raises(ValueError, match=f"--export-hf {base} is the --init-from-hf folder: the export would replace"):
        _train(dataset, tmp_path / "out", *flags, "--export-hf", str(base), hf=None)
    with pytest.raises(ValueError, match=f"--export-lora {base} is the --init-from-hf folder"):
        _train(dataset, tmp_path / "out", *flags, "--lora-rank", "2", "--export-lora", str(base), hf=None)
    adapter = tmp_path / "adapter"
    shutil.copytree(DATA / "peft_tiny_llama", adapter)
    with pytest.raises(ValueError, match=f"--export-lora {adapter} is the --init-lora folder"):
        _train(dataset, tmp_path / "out", *flags, "--init-lora", str(adapter), "--export-lora", str(adapter), hf=None)
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    # The merged export is a whole model: the base's tokenizer files and generation settings come along.
    _train(dataset, tmp_path / "out", *flags, "--lora-rank", "2", "--export-hf", str(tmp_path / "merged"),
           "--merge-lora", hf=None)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "merged" / name).read_bytes() == before[name]


def test_lora_base_in_bfloat16_stays_bitwise_unchanged(dataset, tmp_path):
    """The base of a bfloat16 run is stored in bfloat16, read by the products as it is, and never written."""
    config, files = families.open_hf(DATA / "hf_tiny_llama")
    model, _ = lora.FineTune(lora=lora.LoRASettings(2, 4.0)).build(
        lambda: families.from_hf(DATA / "hf_tiny_llama", batch_size=2, seq_len=16, dtype="bfloat16"), "bfloat16")
    linear = model.layers[0].mlp.down_proj
    assert isinstance(linear, nn.LoRA) and linear.base.weight.get_value().dtype == "bfloat16"
    before = np.asarray(jnntile.to_array(linear.base.weight.get_value()))
    expected = np.asarray(files["model.layers.0.mlp.down_proj.weight"].read()).astype(jnp.bfloat16)
    assert np.array_equal(before.view(np.uint16), expected.view(np.uint16))  # loaded rounded to nearest even
    tx = jnntile.optim.adamw(1e-2)
    finetune = lora.FineTune(lora=lora.LoRASettings(2, 4.0))
    graphdef, params, frozen = nnx.split(model, finetune.filter(), nnx.Param)
    step, _ = step_mod.make_steps(graphdef, tx)
    opt_state = tx.init(params)
    ids = np.random.default_rng(0).integers(0, 300, (1, 2, 16)).astype(np.int32)
    for _ in range(2):
        params, opt_state, loss = step(params, opt_state, ids, ids, [None], frozen)
        assert np.isfinite(float(loss))
    after = nnx.merge(graphdef, params, frozen).layers[0].mlp.down_proj.base.weight.get_value()
    assert np.array_equal(np.asarray(jnntile.to_array(after)).view(np.uint16), before.view(np.uint16))
    # Optimizer state exists for the adapters alone: two moments per adapter factor.
    moments = [t for t in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, jnntile.Tensor))
               if isinstance(t, jnntile.Tensor)]
    assert len(moments) == 2 * len(jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, jnntile.Tensor)))


# The embedding tables and a separate head of each family, by parameter path.
TABLES = {"hf_tiny_llama": ("embed_tokens.weight", "lm_head.weight"), "hf_tiny_gpt2": ("wte.weight", "wpe.weight")}


@pytest.mark.parametrize("file_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hf", TABLES)
def test_lora_base_in_bfloat16_stores_the_tables_and_head_in_bfloat16(hf, file_dtype, tmp_path):
    """The embedding tables and the head (Llama's own lm_head, GPT-2's tied wte) of a bfloat16 LoRA base are
    bfloat16 tensors holding the file's values rounded, read as they are: the logits are those of float32
    tables computing in bfloat16."""
    directory = DATA / hf
    if file_dtype == "bfloat16":
        shutil.copytree(directory, tmp_path / hf)
        directory = tmp_path / hf
        tensorfile.write_file(directory / "model.safetensors", _tensors(DATA / hf / "model.safetensors"),
                              metadata={"format": "pt"}, float_dtype="bfloat16")
    build = lambda: families.from_hf(directory, batch_size=2, seq_len=16, dtype="bfloat16")  # noqa: E731
    model, _ = lora.FineTune(lora=lora.LoRASettings(2, 4.0)).build(build, "bfloat16")
    full = build()  # float32 masters, as a run training everything has them
    mine, masters = model.named_params(), full.named_params()
    for name in TABLES[hf]:
        table, master = mine[name].get_value(), masters[name].get_value()
        assert table.dtype == "bfloat16" and master.dtype == "float32", name
        rounded = np.asarray(jnntile.to_array(jnntile.convert(master, "bfloat16")))
        assert np.array_equal(np.asarray(jnntile.to_array(table)).view(np.uint16), rounded.view(np.uint16)), name
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 16)).astype(np.int32)
    logits, reference = (np.asarray(jnntile.to_array(m(m.token_tensor(ids))[0]), np.float32) for m in (model, full))
    assert np.linalg.norm(logits - reference) <= BFLOAT16_TOL * np.linalg.norm(reference)


def test_freeze_keeps_frozen_weights_bitwise_and_gives_them_no_state(dataset, tmp_path):
    _train(dataset, tmp_path / "out", "--model", "tiny", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
           "--steps", "3", "--freeze", r"wte|wpe|h\.0\.", hf=None)
    ckpt = checkpoint.latest(tmp_path / "out")
    saved = _tensors(ckpt / "model.safetensors")
    config = families.read_config(ckpt)
    initial = families.build(config, batch_size=2, seq_len=16, seed=0)
    for name, parameter in initial.to_hf_params().items():
        same = np.array_equal(saved["transformer." + name], np.asarray(parameter))
        frozen = name.startswith(("wte", "wpe", "h.0."))
        assert same == frozen, name
    # Moments only for the trained parameters (and the step counts of the schedule and AdamW).
    trained = [n for n in initial.named_params() if not n.startswith(("wte", "wpe", "h.0."))]
    moments = [v for v in _tensors(ckpt / checkpoint.OPTIMIZER_FILE).values() if v.ndim > 0]
    assert len(moments) == 2 * len(trained)


def test_fine_tuning_flags_are_checked(dataset, tmp_path):
    cases = [(["--lora-rank", "2", "--lora-targets", "q_proj,foo_proj"], "foo_proj: this model's projections are"),
             (["--lora-rank", "2", "--lora-targets", "c_attn"], "c_attn"),
             (["--lora-rank", "2", "--lora-targets", r".*\.nothing_proj"], "no module of this model matches"),
             (["--lora-rank", "2", "--lora-targets", "(q"], "not a regular expression"),
             (["--lora-rank", "0"], "at least 1"),
             (["--lora-rank", "2", "--export-hf", str(tmp_path / "x")], "--merge-lora"),
             (["--export-lora", str(tmp_path / "x")], "--lora-rank"),
             (["--lora-alpha", "8"], "--lora-rank"),
             (["--lora-rank", "2", "--freeze", "norm"], "--freeze"),
             (["--train-only", "nothing-matches"], "no parameter to train"),
             (["--freeze", "("], "regular expression")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            _train(dataset, tmp_path / "out", "--steps", "1", *extra)


@pytest.mark.parametrize("targets, modules", [
    ("q_proj,v_proj", {"q_proj", "v_proj"}), ("o_proj", {"o_proj"}),
    ("all-linear", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    (r"model\.layers\.1\.self_attn\.(k|v)_proj", {"k_proj", "v_proj"})])
def test_lora_targets_any_subset_train_and_export_in_peft_layout(dataset, tmp_path, targets, modules):
    _train(dataset, tmp_path / "out", "--steps", "2", "--lora-rank", "2", "--lora-targets", targets,
           "--export-lora", str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    regex = targets.startswith("model")  # written as it is: PEFT's target_modules take one
    assert (config["target_modules"] == targets if regex else set(config["target_modules"]) == modules)
    assert config["r"] == 2 and config["lora_alpha"] == 4.0
    saved = _tensors(tmp_path / "adapter" / lora.ADAPTER_WEIGHTS)
    layers = {"1"} if regex else {"0", "1"}
    assert set(saved) == {f"base_model.model.model.layers.{layer}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}."
                          f"lora_{kind}.weight" for layer in layers for m in modules for kind in "AB"}
    # Each module its own A: trained apart, the parts of a fused product differ.
    if "q_proj" in modules and "v_proj" in modules:
        a = lambda m: saved[f"base_model.model.model.layers.0.self_attn.{m}.lora_A.weight"]  # noqa: E731
        assert not np.array_equal(a("q_proj"), a("v_proj"))
    model = families.from_hf(DATA / "hf_tiny_llama", batch_size=2, seq_len=16)
    lora.apply(model, lora.read_settings(tmp_path / "adapter"))
    lora.load_peft(model, tmp_path / "adapter")
    lora.save_peft(model, lora.applied_settings(model), tmp_path / "again")
    again = _tensors(tmp_path / "again" / lora.ADAPTER_WEIGHTS)
    assert set(again) == set(saved) and all(np.array_equal(again[k], saved[k]) for k in saved)


def test_non_lora_adapters_are_refused_naming_what(tmp_path):
    model = families.from_hf(DATA / "hf_tiny_llama", batch_size=2, seq_len=16)
    config = json.loads((DATA / "peft_tiny_llama_qv" / lora.ADAPTER_CONFIG).read_text())
    for change, message in (({"use_dora": True}, "DoRA adapters"), ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
                            ({"target_modules": ["q_proj", "w_pack"]}, "w_pack")):
        shutil.rmtree(tmp_path / "adapter", ignore_errors=True)
        shutil.copytree(DATA / "peft_tiny_llama_qv", tmp_path / "adapter")
        (tmp_path / "adapter" / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            lora.apply(model, lora.read_settings(tmp_path / "adapter"))


# ---- PEFT's own files -------------------------------------------------------------------------------

def _grad(grads, path: str, part: str, kind: str):
    """The gradient variable of `kind` of adapter `part` of LoRA module `path` in an nnx.State of gradients."""
    node = grads
    for key in (*path.split("."), "adapters", part, kind):
        node = node[int(key) if key.isdigit() else key]
    return node


# adapter fixture -> its base: shared A's (jnntile's former fused adapters), GPT-2, q/v alone with independent A
# and B, rank_pattern, alpha_pattern and rsLoRA, all-linear with independent A and B
PEFT_FIXTURES = {"llama": "llama", "gpt2": "gpt2", "llama_qv": "llama", "llama_all": "llama"}


@pytest.mark.parametrize("name", PEFT_FIXTURES)
def test_peft_adapters_give_peft_logits_loss_and_gradients(name):
    adapter = DATA / f"peft_tiny_{name}"
    expected = np.load(DATA / f"peft_tiny_{name}_expected.npz")
    idx, targets = expected["idx"], expected["targets"]
    model = families.from_hf(DATA / f"hf_tiny_{PEFT_FIXTURES[name]}", batch_size=idx.shape[0], seq_len=idx.shape[1])
    lora.apply(model, lora.read_settings(adapter))
    lora.load_peft(model, adapter)

    def loss_fn(m):
        logits, loss = m(m.token_tensor(idx), m.token_tensor(targets, allow_ignore=True))
        return loss, jnntile.to_array(logits)

    (loss, logits), grads = nn.value_and_grad(loss_fn, has_aux=True, wrt=nnx.LoRAParam)(model)
    np.testing.assert_allclose(np.asarray(logits), expected["logits"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(float(loss), float(expected["loss"]), rtol=1e-5)
    # Gradients in PEFT's layout, one adapter per Hugging Face module.
    hf = families.of_config(model.config).hf
    checked = 0
    for path, module in lora.adapters(model).items():
        for part, adapter in module.adapters.items():
            key = hf.lora_module(path, part)
            grads_ = (np.asarray(jnntile.to_array(jnntile.grad_of(grad_tree.get_value())))
                      for grad_tree in (_grad(grads, path, part, "lora_a"), _grad(grads, path, part, "lora_b")))
            for kind, have in zip("AB", hf.lora_to_peft(model.config, part, *grads_)):
                want = expected[f"grad:base_model.model.{key}.lora_{kind}.weight"]
                np.testing.assert_allclose(have, want, atol=2e-5, rtol=1e-4, err_msg=key)
                checked += 1
    assert checked == sum(1 for k in expected.files if k.startswith("grad:"))
    lora.merge(model)
    logits = jnntile.to_array(model(model.token_tensor(idx))[0])
    np.testing.assert_allclose(np.asarray(logits), expected["merged_logits"], atol=1e-4, rtol=1e-4)


# ---- the planner ------------------------------------------------------------------------------------

def test_planner_counts_frozen_parameters_once():
    config = families.preset("llama-tiny")
    full = planning.plan(planning.StepSpec(config, 2, 64))
    adapters = planning.plan(planning.StepSpec(config, 2, 64, finetune=lora.FineTune(lora=lora.LoRASettings(4, 8.0))))
    model, _ = lora.FineTune(lora=lora.LoRASettings(4, 8.0)).build(
        lambda: families.build(config, batch_size=2, seq_len=64), config.dtype)
    n_adapter = sum(t.size for t in nn.tensors(nnx.state(model, nnx.LoRAParam)))
    assert adapters.n_params == n_adapter > 0
    assert adapters.frozen_parameters == full.parameters
    assert adapters.optimizer_state == 2 * adapters.parameters and adapters.gradients == adapters.parameters
    assert adapters.state < full.state / 3
    assert "frozen parameters" in adapters.table()
    # Each adapter's dropout of its input is an activation the backward reads (A's gradient).
    dropout = planning.plan(planning.StepSpec(config, 2, 64, finetune=lora.FineTune(
        lora=lora.LoRASettings(4, 8.0, dropout=0.1))))
    assert dropout.activations > adapters.activations
    frozen = planning.plan(planning.StepSpec(config, 2, 64, finetune=lora.FineTune(freeze="embed_tokens|lm_head")))
    assert frozen.frozen_parameters + frozen.parameters == full.parameters
    assert frozen.peak < full.peak


def test_adapters_of_another_base_load_with_a_warning_naming_both(dataset, tmp_path, capsys):
    adapter = DATA / "peft_tiny_llama"  # its adapter_config.json names hf_tiny_llama
    _train(dataset, tmp_path / "qwen2", "--steps", "1", "--init-lora", str(adapter), hf="hf_tiny_qwen2")
    assert (f"warning: --init-lora {adapter} was trained on hf_tiny_llama (its adapter_config.json's "
            f"base_model_name_or_path), not on {DATA / 'hf_tiny_qwen2'}") in capsys.readouterr().err
    _train(dataset, tmp_path / "llama", "--steps", "1", "--init-lora", str(adapter))
    assert "warning" not in capsys.readouterr().err
    # The same base: a local copy of a hub id, the same folder written otherwise; no base named: no warning.
    assert lora.other_base(adapter, "/models/hf_tiny_llama") is None
    assert lora.other_base(adapter, str(DATA / ".." / "data" / "hf_tiny_llama" / "")) is None
    config = json.loads((adapter / lora.ADAPTER_CONFIG).read_text())
    for named, base, expected in (("TinyLlama/TinyLlama-1.1B", "/models/TinyLlama-1.1B", None),
                                  (None, "anything", None), ("", "anything", None),
                                  ("meta-llama/Llama-3.2-1B", "Qwen/Qwen2-0.5B", "meta-llama/Llama-3.2-1B")):
        (tmp_path / "adapter").mkdir(exist_ok=True)
        (tmp_path / "adapter" / lora.ADAPTER_CONFIG).write_text(json.dumps({**config,
                                                                            "base_model_name_or_path": named}))
        assert lora.other_base(tmp_path / "adapter", base) == expected


def test_adapters_of_another_architecture_are_refused_naming_the_folder(dataset, tmp_path):
    adapter = DATA / "peft_tiny_gpt2"
    with pytest.raises(ValueError) as refused:
        _train(dataset, tmp_path / "out", "--steps", "1", "--init-lora", str(adapter))
    message = str(refused.value)
    assert message.startswith(f"the adapters in {adapter} are of c_attn, c_fc, c_proj, the projections of a gpt2 "
                              "model: they were trained on another architecture than this llama model")
    assert "--lora-targets" not in message
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ---- checkpoints of the fused-A layout ----------------------------------------------------------------

FUSED_A = DATA / "lora_fused_a_2c6fa82"  # its README.md says how it was made


def _fused_a_run(tmp_path, *extra):
    """Resumes a copy of FUSED_A's run with today's code, on its data (ids of a repeating pattern)."""
    shutil.copytree(FUSED_A, tmp_path / "out", ignore=shutil.ignore_patterns("logits.npz", "README.md"))
    ids = tmp_path / "ids.bin"
    np.tile(np.arange(90, dtype=np.uint16) % 24, 200).tofile(ids)
    return _train(ids, tmp_path / "out", "--lora-rank", "2", "--steps", "4", "--checkpoint-interval", "2",
                  "--resume", *extra)


def test_lora_checkpoint_of_fused_adapters_resumes(tmp_path):
    """A LoRA checkpoint written before adapters were one per Hugging Face module (one adapter of Llama's q/k/v,
    its A shared) resumes: the same model, each part's A and moments starting from the shared A's."""
    ckpt = FUSED_A / "ckpt-0000002"
    finetune = lora.FineTune(lora=lora.LoRASettings(2, 4.0))
    model, _ = finetune.build(lambda: families.from_hf(DATA / "hf_tiny_llama", batch_size=2, seq_len=16), "float32")
    _, params, _ = step_mod.split(model, finetune)
    opt_state, record = checkpoint.restore(ckpt, model=model, opt_state=jnntile.optim.adamw(1e-2).init(params),
                                           finetune=finetune)
    assert record["step"] == 2
    old = np.load(FUSED_A / "logits.npz")
    logits = np.asarray(jnntile.to_array(model(model.token_tensor(old["idx"]))[0]))
    np.testing.assert_allclose(logits, old["logits"], rtol=1e-5, atol=1e-5)
    # The old optimizer file's leaves: the step count, then mu and nu each in sorted names, 8 leaves a layer:
    # mlp.down_proj.lora_a, lora_b, mlp.gate_up_proj.lora_a, lora_b, self_attn.o_proj.lora_a, lora_b,
    # self_attn.qkv_proj.lora_a, lora_b. B (q 2 rows, k 1, v 1, of 2 kv heads x 8, rank 2).
    saved = _tensors(ckpt / checkpoint.OPTIMIZER_FILE)
    flat = {".".join(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(opt_state.mu)}
    read = lambda path: np.asarray(jnntile.to_array(flat["layers.1.self_attn.qkv_proj.adapters." + path]))  # noqa
    mu_a, mu_b = saved["leaf.00015"], saved["leaf.00016"]  # layer 1's qkv_proj
    assert mu_b.shape == (4, 2, 8, 2) and np.abs(mu_b).max() > 0
    for part, rows in (("q_proj", slice(0, 2)), ("k_proj", slice(2, 3)), ("v_proj", slice(3, 4))):
        np.testing.assert_array_equal(read(part + ".lora_a"), mu_a)
        np.testing.assert_array_equal(read(part + ".lora_b"), mu_b[rows])
    assert int(opt_state.count) == 2

    summary = _fused_a_run(tmp_path, "--export-lora", str(tmp_path / "adapter"))
    old_losses = [json.loads(line)["loss"] for line in (FUSED_A / "metrics.jsonl").read_text().splitlines()]
    assert np.all(np.isfinite(summary["losses"])) and len(summary["losses"]) == 2
    assert summary["losses"][0] == pytest.approx(old_losses[2], rel=1e-6)  # the same weights, the same batch
    assert summary["losses"][1] == pytest.approx(old_losses[3], rel=0.02)  # the parts' A's now train apart
    adapter = _tensors(tmp_path / "adapter" / lora.ADAPTER_WEIGHTS)
    modules = {name.split(".lora_")[0].removeprefix("base_model.model.") for name in adapter}
    assert modules == {f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    q_a, k_a = (adapter[f"base_model.model.model.layers.0.self_attn.{m}.lora_A.weight"] for m in ("q_proj", "k_proj"))
    assert q_a.shape == k_a.shape == (2, 32) and not np.array_equal(q_a, k_a)


def test_optimizer_state_of_other_parameters_is_refused_naming_them(dataset, tmp_path):
    with pytest.raises(ValueError) as refused:  # the fused-A layout's leaves are not SGD's
        _fused_a_run(tmp_path / "sgd", "--optimizer", "sgd")
    assert "optimizer.safetensors holds 33 optimizer values, this run has 1 for its 28 trained parameters " \
           "(layers.0.mlp.down_proj.adapters.down_proj.lora_a, " in str(refused.value)
    assert "--optimizer" in str(refused.value)
    # A checkpoint names its trained parameters: one whose record says other adapters than its files hold.
    _train(dataset, tmp_path / "out", "--steps", "1", "--checkpoint-interval", "1", "--lora-rank", "2",
           "--lora-targets", "q_proj,v_proj")
    state = tmp_path / "out" / "ckpt-0000001" / checkpoint.STATE_FILE
    record = json.loads(state.read_text())
    record["finetune"]["lora"]["targets"] = ["q_proj", "k_proj", "v_proj"]
    state.write_text(json.dumps(record))
    with pytest.raises(ValueError) as refused:
        _train(dataset, tmp_path / "out", "--steps", "2", "--lora-rank", "2", "--lora-targets", "q_proj,k_proj,v_proj",
               "--resume")
    assert ("optimizer.safetensors is the optimizer state of other trained parameters: the checkpoint trained none "
            "(0 in all) that this run does not, this run trains layers.0.self_attn.qkv_proj.adapters.k_proj.lora_a, "
            "layers.0.self_attn.qkv_proj.adapters.k_proj.lora_b, layers.1.self_attn.qkv_proj.adapters.k_proj.lora_a "
            "(4 in all) that it did not") in str(refused.value)


@pytest.fixture(scope="module")
def hf_llama_64(tmp_path_factory):
    """A Llama checkpoint whose projections' input axes are multiples of 64, as NF4's blocks need (the tiny
    fixture's hidden size is 32; o_proj's input axis is the head dimension): hidden 128, two heads of 64,
    intermediate size 128, drawn with seed 3."""
    from jnntile.models.llama.config import LlamaConfig

    out = tmp_path_factory.mktemp("hf_llama_64")
    jnntile.runtime.start()
    families.save_hf(families.build(LlamaConfig(vocab_size=320, hidden_size=128, num_attention_heads=2,
                                                                num_key_value_heads=2, intermediate_size=128),
                                    batch_size=2, seq_len=16,
                                    seed=3), out)
    return out


def test_lora_on_an_nf4_base_trains_as_on_a_bfloat16_one(dataset, tmp_path, hf_llama_64):
    flags = ["--steps", "8", "--lora-rank", "4", "--dtype", "bfloat16", "--init-from-hf", str(hf_llama_64)]
    plain = _train(dataset, tmp_path / "bf16", *flags, hf=None)
    nf4 = _train(dataset, tmp_path / "nf4", *flags, "--quantize-base", "nf4", hf=None)
    assert nf4["losses"][-1] < nf4["losses"][0]
    assert nf4["losses"][-1] == pytest.approx(plain["losses"][-1], rel=0.05)
    assert nf4["losses"] != plain["losses"]  # the base is quantized indeed


def test_quantize_base_needs_lora_and_a_resume_keeps_it(dataset, tmp_path):
    flags = ["--lora-rank", "2", "--checkpoint-interval", "1"]
    with pytest.raises(ValueError, match="--quantize-base int8 quantizes frozen projection weights, and this run "
                                         "freezes none: give --lora-rank, --freeze or --train-only"):
        _train(dataset, tmp_path / "full", "--steps", "1", "--quantize-base", "int8")
    first = _train(dataset, tmp_path / "out", "--steps", "1", *flags, "--quantize-base", "int8")
    assert json.loads((tmp_path / "out" / "ckpt-0000001" / "state.json").read_text())["finetune"]["quantize_base"] \
        == "int8"
    with pytest.raises(ValueError, match="'quantize_base': 'int8'.*this run asks for"):
        _train(dataset, tmp_path / "out", "--steps", "2", *flags, "--resume")
    resumed = _train(dataset, tmp_path / "out", "--steps", "2", *flags, "--quantize-base", "int8", "--resume")
    assert np.isfinite(first["losses"] + resumed["losses"]).all()


@pytest.mark.parametrize("kind, quantize", [("nf4", ["--quantize-base", "nf4"]),
                                            ("nf4_dq", ["--quantize-base", "nf4", "--double-quant"])])
def test_frozen_layers_quantized_without_lora_train_as_their_dequantized_weights(dataset, tmp_path, hf_llama_64,
                                                                                 kind, quantize):
    """--freeze with --quantize-base nf4 (and --double-quant): the frozen projection weights are stored quantized
    (their biases, the norms and the trained weights stay float32), and training equals training the model whose
    frozen weights are those dequantized, stored in float32; a resume builds the quantized base again and
    continues the same."""
    freeze = ["--freeze", r"layers\.0\."]
    finetune = lora.FineTune(freeze=freeze[1], quantize_base=kind)
    model, _ = finetune.build(lambda: families.from_hf(hf_llama_64, batch_size=2, seq_len=16), "float32")
    stored = {name: p.get_value() for name, p in model.named_params().items()}
    quantized = sorted(name for name, value in stored.items() if isinstance(value, quant.Quantized))
    assert quantized == [f"layers.0.{m}.weight" for m in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj",
                                                          "self_attn.qkv_proj")]
    assert all(value.dtype == "float32" for name, value in stored.items() if name not in quantized)
    families.save_hf(model, tmp_path / "dequantized")

    flags = ["--checkpoint-interval", "2", *freeze]
    plain = [_train(dataset, tmp_path / "plain", "--steps", str(steps), *flags, *resume, "--init-from-hf",
                    str(tmp_path / "dequantized"), hf=None)["losses"] for steps, resume in ((2, []), (4, ["--resume"]))]
    nf4 = [*quantize, "--init-from-hf", str(hf_llama_64)]
    first = _train(dataset, tmp_path / "nf4", "--steps", "2", *flags, *nf4, hf=None)
    with pytest.raises(ValueError, match=f"'quantize_base': '{kind}'.*this run asks for"):
        _train(dataset, tmp_path / "nf4", "--steps", "4", *flags, "--init-from-hf", str(hf_llama_64), "--resume",
               hf=None)
    resumed = _train(dataset, tmp_path / "nf4", "--steps", "4", *flags, *nf4, "--resume", hf=None)
    losses = first["losses"] + resumed["losses"]
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, plain[0] + plain[1], rtol=1e-5)
    saved = _tensors(tmp_path / "nf4" / "ckpt-0000004" / "model.safetensors")
    for name, value in _tensors(tmp_path / "dequantized" / "model.safetensors").items():
        if "layers.0." in name and "layernorm" not in name:  # frozen: the dequantized values, unchanged
            np.testing.assert_array_equal(saved[name], value)
    with pytest.raises(ValueError, match="--freeze 'norm' freezes no projection weight to quantize; their paths "
                                         r"look like layers\.0\.mlp\.down_proj\.weight"):
        _train(dataset, tmp_path / "norms", "--steps", "1", "--freeze", "norm", *nf4, hf=None)


def test_generate_on_a_quantized_model(hf_llama_64, dataset, capsys):
    prompt = ["--prompt", "alpha beta", "--tokenizer", str(dataset.parent), "--max-new-tokens", "6", "--temperature",
              "0", "--quiet"]
    for kind in (["nf4"], ["nf4", "--double-quant"], ["int8"]):
        text = generate_mod.generate(generate_mod.parse_args(["--hf", str(hf_llama_64), *prompt,
                                                              "--quantize-base", *kind]))
        assert len(text) == 1 and text[0].startswith("alpha beta") and len(text[0]) > len("alpha beta")
    assert generate_mod.main(["--hf", str(hf_llama_64), *prompt, "--quantize-base", "int8", "--double-quant"]) == 2
    assert "--double-quant quantizes the scales of NF4 weights, and --quantize-base is int8: give --quantize-base " \
           "nf4" in capsys.readouterr().err
    assert generate_mod.main(["--hf", str(DATA / "hf_tiny_llama"), *prompt, "--quantize-base", "nf4"]) == 2
    assert "self_attn.qkv_proj.weight: quantize: nf4" in capsys.readouterr().err  # names the weight and the way out


def test_a_drawn_quantized_base_holds_one_weight_in_float32_at_a_time():
    """Each weight drawn for a quantized base (random initial values: llama-70b's shape in bench/qlora.py) is
    quantized before the next is drawn. Without the wait, the draws, which depend on nothing, ran ahead of the
    quantizations waiting for them, and every weight of the model existed in float32 at once: 8x the NF4 base,
    stalling the run without swap or writing all of it to swap and back."""
    jnntile.runtime.start()
    jnntile.runtime.wait_all()

    def ram():
        return next(node for node in jnntile.runtime.stats()["nodes"] if node["kind"] == "RAM")

    before = ram()["used_bytes"]
    jnntile.runtime.reset_peaks()
    with nn.quantized_base("nf4"):
        weights = [nn.Linear((2048,), (2048,), in_tiles=(512,), out_tiles=(512,), seed=0, name=f"w{i}",
                             use_bias=False) for i in range(8)]
    jnntile.runtime.wait_all()
    float32_mb, nf4_mb = 2048 * 2048 * 4 / 2**20, 2048 * 2048 * (0.5 + 4 / 64) / 2**20
    assert (ram()["peak_used_bytes"] - before) / 2**20 <= 2 * float32_mb + len(weights) * nf4_mb
