"""Checkpoints and Hugging Face files streamed chunk by chunk, bad files, and peak RSS end to end.

* Blocks of whole tiles move between tensors and host arrays (TileBox);
  `chunks` cuts a tensor into tile rows, split on the next axis while too large.
* Safetensors files written from tiles load with the safetensors library and
  read back bit-exactly in any chunking; other float dtypes widen to float32.
* Truncated or damaged checkpoints are refused, naming the file and the
  problem, before any tile is overwritten.
* End to end, each in a subprocess: training a GPT-2 whose state is over 4x
  the memory limit, checkpointing, resuming (bit-identical) and exporting for
  Hugging Face each peak within the limit plus the fixed RSS of an idle
  process plus a stated allowance.
"""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import emulated_gpu
from flax import nnx

import jnntile
from jnntile.training import checkpoint, optim
from jnntile import planning
from jnntile.io import tensorfile
from jnntile import data as data_mod
from jnntile.models import families, gpt2
from jnntile.models.gpt2.config import GPT2Config
from jnntile.models.families import load_hf, open_hf
from jnntile.ops import values

FIXTURE = Path(__file__).parent / "data" / "hf_tiny_gpt2"
B, T = 2, 16
SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32, tile_embd=12, tile_heads=1,
                   tile_hidden=40, tile_vocab=40, tile_seq=8)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of at most 256 bytes: every tensor of the small models streams in many pieces."""
    monkeypatch.setattr(values, "CHUNK_BYTES", 256)


# ---- blocks of tiles and chunks ----------------------------------------------------------------

def _covers_once(shape, found):
    seen = np.zeros(shape, np.int32)
    for chunk in found:
        seen[chunk.slices] += 1
    return bool((seen == 1).all())


def test_chunks_are_tile_rows_split_on_the_next_axis_while_too_large():
    shape, tiles = (100, 40), (30, 16)
    assert [c.shape for c in values.chunks(shape, tiles, 4, max_bytes=100 * 40 * 4)] == [(100, 40)]
    rows = list(values.chunks(shape, tiles, 4, max_bytes=30 * 40 * 4))
    assert [c.shape for c in rows] == [(30, 40)] * 3 + [(10, 40)] and _covers_once(shape, rows)
    single = list(values.chunks(shape, tiles, 4, max_bytes=1))  # down to single tiles
    assert len(single) == 4 * 3 and _covers_once(shape, single)
    assert single[2].start == (0, 32) and single[2].shape == (30, 8) and single[2].tile_hi == (1, 3)
    # A vocabulary in one tile row, an (H, D, C) weight in one tile on H and D: cut on the later axes.
    vocab = list(values.chunks((50, 12), (50, 4), 4, max_bytes=50 * 4 * 4))
    assert [c.shape for c in vocab] == [(50, 4)] * 3 and _covers_once((50, 12), vocab)
    hdc = list(values.chunks((3, 4, 10), (3, 4, 5), 4, max_bytes=3 * 4 * 5 * 4))
    assert [c.start for c in hdc] == [(0, 0, 0), (0, 0, 5)]
    assert [c.shape for c in values.chunks((), (), 4, max_bytes=1)] == [()]


def test_blocks_of_tiles_are_read_and_written_in_place(rng):
    a = rng.standard_normal((7, 5, 6)).astype(np.float32)
    t = jnntile.from_array(a, (3, 2, 4))
    fresh = jnntile.zeros(a.shape, tile_shape=(3, 2, 4))
    pieces = list(values.read_chunks(t, max_bytes=2 * 6 * 4))
    assert len(pieces) > 3
    for chunk, block in pieces:
        np.testing.assert_array_equal(block, a[chunk.slices])
    fresh = values.write_chunks(fresh, lambda chunk: a[chunk.slices], max_bytes=2 * 6 * 4)
    np.testing.assert_array_equal(fresh.numpy(), a)

    with pytest.raises(ValueError, match=r"tiles from \(0, 0, 2\) to \(1, 1, 3\) are not a block of tensor"):
        jnntile._xla_ffi.tensor_read(t.id, np.empty((3, 2, 4), np.float32), [0, 0, 2], [1, 1, 3])
    with pytest.raises(ValueError, match="a block of tiles of tensor .* holds 96 bytes but the host array has 4"):
        jnntile._xla_ffi.tensor_read(t.id, np.empty(1, np.float32), [0, 0, 0], [1, 1, 1])


# ---- safetensors files --------------------------------------------------------------------------

def test_tiled_tensors_stream_into_files_the_safetensors_library_loads(tmp_path, rng, small_chunks):
    a = rng.standard_normal((10, 3, 4, 6)).astype(np.float32)
    t = jnntile.from_array(a, (4, 1, 3, 6))
    half = rng.standard_normal((5, 7)).astype(np.float16)
    path = tmp_path / "x.safetensors"
    tensorfile.write_file(path, {"t": tensorfile.Reshaped(t, (10, 72)), "count": np.int32(7), "half": half},
                          metadata={"format": "pt"})
    loaded = safetensors.numpy.load_file(path)
    np.testing.assert_array_equal(loaded["t"], a.reshape(10, 72))
    assert loaded["count"].shape == () and loaded["count"] == 7
    np.testing.assert_array_equal(loaded["half"], half)

    file = tensorfile.SafetensorsFile(path)
    assert file.metadata == {"format": "pt"} and file["t"].shape == (10, 72) and file["t"].code == "F32"
    back = tensorfile.load_into(jnntile.zeros(a.shape, tile_shape=(3, 3, 2, 5)), file["t"])  # other tiles
    np.testing.assert_array_equal(back.numpy(), a)
    np.testing.assert_array_equal(file["t"].read((10, 3, 4, 6), (2, 1, 0, 3), (5, 3, 4, 6)), a[2:5, 1:, :, 3:])
    np.testing.assert_array_equal(np.asarray(file["half"]), half)


def _raw_safetensors(path, tensors: dict):
    """A safetensors file of (code, shape, raw bytes) entries, for dtypes numpy lacks."""
    header, data_bytes = {}, b""
    for name, (code, shape, raw) in tensors.items():
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [len(data_bytes), len(data_bytes) + len(raw)]}
        data_bytes += raw
    text = json.dumps(header).encode()
    Path(path).write_bytes(len(text).to_bytes(8, "little") + text + data_bytes)


def test_half_bfloat16_and_double_widen_to_float32(tmp_path, rng):
    values = rng.standard_normal((4, 6)).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
    path = tmp_path / "x.safetensors"
    _raw_safetensors(path, {"bf16": ("BF16", (4, 6), bf16.tobytes()),
                            "f16": ("F16", (4, 6), values.astype(np.float16).tobytes()),
                            "f64": ("F64", (4, 6), values.astype(np.float64).tobytes())})
    file = tensorfile.SafetensorsFile(path)
    np.testing.assert_array_equal(file["bf16"].read(), (bf16.astype(np.uint32) << 16).view(np.float32))
    t = tensorfile.load_into(jnntile.zeros((4, 6), tile_shape=(3, 4)), file["f16"])
    np.testing.assert_array_equal(t.numpy(), values.astype(np.float16).astype(np.float32))
    t = tensorfile.load_into(jnntile.zeros((4, 6), tile_shape=(3, 4)), file["f64"])
    np.testing.assert_array_equal(t.numpy(), values)


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:5], "is truncated: 5 bytes, not even the 8-byte header length"),
    (lambda raw: raw[:-3], r"is truncated: its tensors need 96 bytes of data after the header, the file holds 93"),
    (lambda raw: raw + b"xx", "has 2 bytes after its last tensor"),
    (lambda raw: (10**6).to_bytes(8, "little") + raw[8:], "its header length field says 1000000 bytes"),
    (lambda raw: raw[:8] + b"#" + raw[9:], "the header of .* does not parse as JSON"),
    (lambda raw: raw.replace(b'"F32"', b'"F31"', 1), "tensor 'a' has the unknown dtype 'F31'"),
    (lambda raw: raw.replace(b"[4,6]", b"[4,7]", 1), r"tensor 'a' spans 96 bytes, but F32 \(4, 7\) needs 112"),
])
def test_damaged_files_are_refused_naming_the_file_and_the_problem(tmp_path, damage, message):
    path = tmp_path / "x.safetensors"
    tensorfile.write_file(path, {"a": np.zeros((4, 6), np.float32)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as error:
        tensorfile.SafetensorsFile(path)
    assert str(path) in str(error.value)


# ---- Hugging Face files ----------------------------------------------------------------------------

def test_hugging_face_round_trip_is_bit_exact_in_small_chunks(tmp_path, small_chunks):
    model = families.from_hf(FIXTURE, batch_size=B, seq_len=T, tile_seq=8, tile_embd=12, tile_heads=1,
                         tile_hidden=40, tile_vocab=40)
    families.save_hf(model, tmp_path / "out")
    original, saved = safetensors.numpy.load_file(FIXTURE / "model.safetensors"), \
        safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert set(saved) == set(original)
    for name, value in original.items():
        assert saved[name].dtype == value.dtype and saved[name].tobytes() == value.tobytes(), name
    config, _ = open_hf(tmp_path / "out")
    assert config == open_hf(FIXTURE)[0]
    views = model.to_hf_params()
    np.testing.assert_array_equal(np.asarray(views["h.0.attn.c_attn.weight"]), original["transformer.h.0.attn.c_attn.weight"])


def test_bad_hugging_face_tensor_overwrites_nothing(tmp_path):
    model = gpt2.GPT2(SMALL, batch_size=B, seq_len=T, seed=1)
    before = {name: np.asarray(value) for name, value in model.to_hf_params().items()}
    _, params = load_hf(FIXTURE)
    params = dict(params, **{"h.1.mlp.c_proj.weight": params["h.1.mlp.c_proj.weight"][:, :-1]})
    with pytest.raises(ValueError, match=r"h.1.mlp.c_proj.weight' has shape \(128, 31\)"):
        model.load_hf_params(params)
    for name, value in model.to_hf_params().items():
        np.testing.assert_array_equal(np.asarray(value), before[name])


# ---- training checkpoints ------------------------------------------------------------------------

def _saved_checkpoint(tmp_path):
    model = gpt2.GPT2(SMALL, batch_size=B, seq_len=T, seed=2)
    tx = optim.adamw(1e-3)
    opt_state = tx.init(nnx.state(model, nnx.Param))
    path = checkpoint.save(tmp_path, model=model, opt_state=opt_state, step=5, state={"data_position": 0})
    return path, tx


def _rewrite(path, change):
    tensors = safetensors.numpy.load_file(path)
    change(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def _truncate(path, n):
    path.write_bytes(path.read_bytes()[:-n])


CORRUPTIONS = {
    "state.json not JSON": (lambda c: (c / "state.json").write_text("{\"step\": 5,"),
                            r"state.json does not parse as JSON"),
    "state.json without step": (lambda c: (c / "state.json").write_text(json.dumps({"config": {}})),
                                r"state.json lacks 'step'"),
    "model truncated": (lambda c: _truncate(c / "model.safetensors", 10), r"model.safetensors is truncated"),
    "optimizer truncated": (lambda c: _truncate(c / "optimizer.safetensors", 1),
                            r"optimizer.safetensors is truncated"),
    "header garbage": (lambda c: (c / "model.safetensors").write_bytes(
        (c / "model.safetensors").read_bytes()[:9] + b"\xff" + (c / "model.safetensors").read_bytes()[10:]),
        r"the header of .*model.safetensors does not parse as JSON"),
    "misshapen tensor": (lambda c: _rewrite(c / "model.safetensors", lambda t: t.update(
        {"transformer.wpe.weight": t["transformer.wpe.weight"][:, :-1].copy()})),
        r"tensor 'wpe.weight' has shape \(32, 31\) in .*model.safetensors, expected \(32, 32\)"),
    "half-precision tensor": (lambda c: _rewrite(c / "model.safetensors", lambda t: t.update(
        {"transformer.ln_f.bias": t["transformer.ln_f.bias"].astype(np.float16)})),
        r"model.safetensors: tensor 'ln_f.bias' is F16, a training checkpoint holds F32"),
    "missing tensor": (lambda c: _rewrite(c / "model.safetensors", lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")),
                       r"tensor 'h.1.mlp.c_fc.bias' \(expected shape \(128,\)\) is missing from .*model.safetensors"),
    "misshapen moment": (lambda c: _rewrite(c / "optimizer.safetensors", lambda t: t.update(
        {"leaf.00003": np.zeros((3,), np.float32)})),
        r"optimizer.safetensors: optimizer value 'leaf.00003' is F32 \(3,\), expected F32"),
    "missing moment": (lambda c: _rewrite(c / "optimizer.safetensors", lambda t: t.pop("leaf.00007")),
                       r"optimizer.safetensors holds \d+ optimizer values, this run has \d+"),
}


def test_nan_weights_are_refused_naming_the_tensor(tmp_path):
    path, tx = _saved_checkpoint(tmp_path)
    _rewrite(path / "model.safetensors", lambda t: t["transformer.h.0.ln_1.weight"].__setitem__(3, np.nan))
    model = gpt2.GPT2(SMALL, batch_size=B, seq_len=T, seed=3)
    with pytest.raises(ValueError, match=r"'transformer.h.0.ln_1.weight' .*model.safetensors holds NaN or infinite"):
        checkpoint.restore(path, model=model, opt_state=tx.init(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("corruption", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_damaged_checkpoint_is_refused_before_anything_is_overwritten(tmp_path, corruption):
    damage, message = corruption
    path, tx = _saved_checkpoint(tmp_path)
    damage(path)
    model = gpt2.GPT2(SMALL, batch_size=B, seq_len=T, seed=3)
    opt_state = tx.init(nnx.state(model, nnx.Param))
    opt_state = opt_state._replace(mu=jax.tree.map(lambda t: values.fill(t, 0.5), opt_state.mu,
                                                   is_leaf=lambda x: isinstance(x, jnntile.Tensor)))
    before = {name: np.asarray(value) for name, value in model.to_hf_params().items()}
    with pytest.raises(ValueError, match=message):
        checkpoint.restore(path, model=model, opt_state=opt_state)
    for name, value in model.to_hf_params().items():
        np.testing.assert_array_equal(np.asarray(value), before[name], err_msg=name)
    for moment in jnntile.nn.tensors(opt_state.mu):
        np.testing.assert_array_equal(moment.numpy(), np.full(moment.shape, 0.5, np.float32))


def test_checkpoint_round_trip_in_small_chunks(tmp_path, small_chunks):
    path, tx = _saved_checkpoint(tmp_path)
    saved = gpt2.GPT2(SMALL, batch_size=B, seq_len=T, seed=2)
    model = gpt2.GPT2(SMALL, batch_size=B, seq_len=T, seed=4)
    opt_state = tx.init(nnx.state(model, nnx.Param))
    opt_state, record = checkpoint.restore(path, model=model, opt_state=opt_state)
    assert record["step"] == 5 and record["data_position"] == 0
    for name, value in model.to_hf_params().items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(saved.to_hf_params()[name]), err_msg=name)
    assert int(opt_state.count) == 0


def test_rotation_keeps_the_checkpoint_it_writes_whatever_newer_ones_the_directory_holds(tmp_path):
    path, _ = _saved_checkpoint(tmp_path)
    for step in (20, 30):  # of a later step: another run's, or those a resume from an older one writes again
        shutil.copytree(path, tmp_path / f"ckpt-{step:07d}")
    model = gpt2.GPT2(SMALL, batch_size=B, seq_len=T, seed=2)
    opt_state = optim.adamw(1e-3).init(nnx.state(model, nnx.Param))
    for step in (10, 12):
        checkpoint.save(tmp_path, model=model, opt_state=opt_state, step=step, state={"data_position": 0})
    assert (tmp_path / checkpoint.LATEST).read_text() == "ckpt-0000012"
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-0000012"
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-0000010", "ckpt-0000012", "ckpt-0000020",
                                                                 "ckpt-0000030"]


def test_fingerprint_tells_weights_of_one_layout_apart_without_the_path(tmp_path):
    copy, tuned = tmp_path / "copy", tmp_path / "tuned"
    shutil.copytree(FIXTURE, copy)
    shutil.copytree(FIXTURE, tuned)
    _rewrite(tuned / "model.safetensors", lambda t: t["transformer.h.1.mlp.c_fc.weight"].__imul__(1.01))
    assert checkpoint.hf_fingerprint(copy) == checkpoint.hf_fingerprint(FIXTURE)
    assert checkpoint.hf_fingerprint(tuned) != checkpoint.hf_fingerprint(FIXTURE)


# ---- end to end: peak RSS of the command line ------------------------------------------------------

# Prints the peak RSS (VmHWM) of this process at exit: `idle` imports jnntile and
# starts the runtime under the limit; anything else runs `python -m jnntile.train`.
_PEAK_RSS_SCRIPT = textwrap.dedent("""
    import sys

    def peak_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))

    if sys.argv[1] == "idle":
        import jnntile
        jnntile.runtime.start(memory_limit_mb=int(sys.argv[2]))
        jnntile.zeros((4, 4)).numpy()
        code = 0
    else:
        from jnntile import train
        code = train.main(sys.argv[1:])
    print(f"peak RSS MB {peak_mb():.1f}", flush=True)
    sys.exit(code)
""")
LIMIT_MB = 64
# 40M parameters: 630 MB of parameters, gradients and AdamW state, 10x the limit. Two
# layers keep the compiled step small; the width makes the state large.
E2E = ["--n-layer", "2", "--n-head", "10", "--n-embd", "1280", "--batch-size", "2", "--seq-len", "32",
       "--tile-embd", "256", "--tile-hidden", "1280", "--tile-vocab", "128", "--eval-interval", "0",
       "--samples", "0", "--quiet", "--memory-limit-mb", str(LIMIT_MB), "--swap-size-mb", "2048"]
# What a training process holds beyond an idle one and its memory limit, whatever the size
# of the model's state: jnntile.train's imports (matplotlib draws the loss curve), the
# compiled step, the batches, and a chunk of a checkpoint (here a tile row of 1.3 MB).
# Measured: about 165 MB here; checkpoints that read whole tensors took it to 420 MB.
ALLOWANCE_MB = 250


def _peak_rss_mb(*args) -> float:
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS_SCRIPT, *args], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.rsplit("peak RSS MB", 1)[1])


@pytest.fixture(scope="module")
def e2e_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    text = root / "text.txt"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "tiles", "tasks", "memory", "disk"]
    text.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
    data_mod.prepare_dataset(text, root / "prepared", vocab_size=300, progress=False)
    return root / "prepared" / "train.bin"


@pytest.mark.skipif(emulated_gpu(), reason="an emulated GPU's memory is host memory: it counts in the peak RSS")
def test_train_checkpoint_resume_export_peak_within_limit(e2e_data, tmp_path):
    out, swap, hf = tmp_path / "out", tmp_path / "swap", tmp_path / "hf"
    config = GPT2Config(n_layer=2, n_head=10, n_embd=1280, n_positions=32,
                        vocab_size=data_mod.TokenDataset(e2e_data).vocab_size)
    assert planning.plan(planning.StepSpec(config, 2, 32)).state > 4 * LIMIT_MB * 2**20
    idle = _peak_rss_mb("idle", str(LIMIT_MB))
    run = ["--data", str(e2e_data), "--out", str(out), "--swap-dir", str(swap), *E2E]
    peaks = {"train + checkpoints": _peak_rss_mb(*run, "--steps", "3", "--checkpoint-interval", "2")}
    straight = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = safetensors.numpy.load_file(out / "ckpt-0000003" / "model.safetensors")
    (out / "latest").write_text("ckpt-0000002")  # as if interrupted after step 2
    peaks["resume + export"] = _peak_rss_mb(*run, "--steps", "3", "--resume", "--export-hf", str(hf))
    resumed = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert resumed == straight
    exported = safetensors.numpy.load_file(hf / "model.safetensors")
    assert exported.keys() == final.keys()
    for name, value in final.items():
        assert exported[name].tobytes() == value.tobytes(), name
    for what, peak in peaks.items():
        assert peak <= idle + LIMIT_MB + ALLOWANCE_MB, (
            f"{what}: peak RSS {peak:.0f} MB > idle {idle:.0f} + limit {LIMIT_MB} + allowance {ALLOWANCE_MB} MB")
