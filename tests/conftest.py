"""Shared test helpers: tilings to sweep, a relative-error check, reference attention, a small corpus."""

import collections

import numpy as np
import pytest


# The suite's one default, for tests that do not ask for a placement: kernels on CPU workers and FP32
# products. Under the GPU defaults (CUDA workers, dmdas, TF32) the scheduler moves each GEMM between
# FP32 OpenBLAS and TF32 cuBLAS while it calibrates, and neither 1e-5 comparisons nor bitwise run-to-run
# comparisons could hold. GPU tests opt in with the `placement` fixture or restart_runtime(placement=...).
SUITE_RUNTIME = {"placement": "cpu", "matmul_precision": "highest"}
# References in plain JAX compute their products in FP32 too: on Ampere and Hopper JAX's default is TF32,
# 1e-4 to 1e-3 off.
REFERENCE_MATMUL_PRECISION = "highest"


def pytest_configure(config):
    import jax

    from jnntile.core import runtime

    jax.config.update("jax_default_matmul_precision", REFERENCE_MATMUL_PRECISION)
    runtime.configure(**SUITE_RUNTIME)


def plain_llama_tokenizer(directory):
    """`directory` (created) holding the Llama fixture's tokenizer without its chat template; returned."""
    import json
    import shutil
    from pathlib import Path

    llama = Path(__file__).parent / "data" / "hf_tiny_llama"
    directory.mkdir()
    shutil.copy(llama / "tokenizer.json", directory)
    config = json.loads((llama / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def rel_err(actual, expected) -> float:
    """Relative Frobenius error ||actual - expected|| / ||expected||."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / (denom if denom > 0 else 1.0))


def tasks_run() -> collections.Counter:
    """The tasks each codelet has run since the runtime started (0 for any other name), once every task submitted
    has completed: a task is counted in its completion callback, which can run after a read of its output has
    returned."""
    import jnntile
    jnntile.runtime.wait_all()
    return collections.Counter({name: c["tasks"] for name, c in jnntile.runtime.stats()["codelets"].items()})


def normal(shape, seed):
    """Standard normal float32 values of `shape`, reproducible by `seed`."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def check_value_and_grads(loss, reference, tensors, arrays, jit):
    """The value and every gradient of jnntile loss(*tensors) against JAX's of reference(*arrays), within 1e-5."""
    import jax

    import jnntile

    argnums = tuple(range(len(tensors)))
    fn = jnntile.value_and_grad(loss, argnums=argnums)
    value, grads = (jax.jit(fn) if jit else fn)(*tensors)
    ref_value, ref_grads = jax.value_and_grad(reference, argnums=argnums)(*arrays)
    assert rel_err(value, ref_value) <= 1e-5
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


def causal_attention_reference(qkv):
    """Softmax attention with a causal mask, in plain jnp, on qkv of shape (B, T, G + 2, H, D): the G query
    heads of group h (axis 2 index g < G) attend with its keys (index G) and values (G + 1). Returns
    (B, T, G, H, D), or (B, T, H, D) where G = 1 (multi-head attention)."""
    import jax
    import jax.numpy as jnp

    groups = qkv.shape[2] - 2
    q, k, v = qkv[:, :, :groups], qkv[:, :, groups], qkv[:, :, groups + 1]
    t = qkv.shape[1]
    scores = jnp.einsum("bqghd,bkhd->bghqk", q, k) / np.sqrt(qkv.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    out = jnp.einsum("bghqk,bkhd->bqghd", jax.nn.softmax(scores, axis=-1), v)
    return out[:, :, 0] if groups == 1 else out


def counter_uniform01(seed: int, counter) -> np.ndarray:
    """The kernels' uniform in (0, 1) of (seed, counter) (kernels/values.h), in numpy uint64 arithmetic."""

    def splitmix64(x):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    bits = splitmix64(np.uint64(seed % 2**64) ^ splitmix64(np.asarray(counter, np.uint64))) >> np.uint64(40)
    return (bits.astype(np.float64) + 0.5) / 2.0**24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small prepared corpus (vocabulary 300) for the training command; its train.bin."""
    from jnntile import data as data_mod

    root = tmp_path_factory.mktemp("corpus")
    text = root / "text.txt"
    words = ["alpha", "beta", "gamma", "delta", "tiles", "tasks", "memory", "disk"]
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
    out = root / "prepared"
    data_mod.prepare_dataset(text, out, vocab_size=300, progress=False)
    return out / "train.bin"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 17 MB file system (a tmpfs), for disks that fill up; skipped with the reason where none can be mounted."""
    import subprocess

    mount = tmp_path / "tmpfs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=17m", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# One bfloat16 ulp is 2^-8 of a value (0.4%): a result rounded once differs from the reference's by at
# most half an ulp per element, and by an ulp where the two sum in another order before rounding.
BFLOAT16_TOL = 1e-2
# A whole model in bfloat16 against the float32 reference: rounding only the weights to bfloat16 (the
# compute copies) already moves the reference's own gradients by up to 1.5e-2 (normwise) on the Llama and
# Qwen2 fixtures, and each op rounds its output again (up to 2^-9 per element, about ten ops per block).
# Measured: 5e-3 to 1.5e-2 for most gradients, 3e-2 at most (Qwen2's key bias, a gradient whose terms nearly
# cancel); float32 stays within 1e-5 in the same tests, so a bfloat16 path that drops a gradient term or
# loses the float32 accumulation (errors of 1e-1 and more) still fails.
BFLOAT16_MODEL_TOL = 5e-2


def check_op(op, reference, arrays, tile_shapes, *, jit, tol=1e-5, seed=0, dtype="float32"):
    """Checks op(*tensors) against reference(*arrays): values and the gradients of every input.

    The scalar being differentiated is sum(output * weights) with fixed random
    weights, so every output element has a distinct cotangent. With
    dtype="bfloat16" (or a dtype per input) the inputs are bfloat16 tensors and
    `reference` gets them as bfloat16 JAX arrays: the pure-JAX op in the same
    mixed precision (bfloat16 storage, float32 arithmetic), returning bfloat16.
    """
    import jax
    import jax.numpy as jnp

    import jnntile

    dtypes = [dtype] * len(arrays) if isinstance(dtype, str) else dtype
    arrays = [jnp.asarray(a, jnp.bfloat16) if d == "bfloat16" else a for a, d in zip(arrays, dtypes)]
    tensors = [jnntile.from_array(a, t) for a, t in zip(arrays, tile_shapes)]
    expected = np.asarray(reference(*arrays), np.float32)
    weights = np.random.default_rng(seed).standard_normal(expected.shape).astype(np.float32)

    def loss(*ts):
        # The output is read inside the differentiated function: afterwards it
        # is invalidated (DESIGN invariant 7).
        out = op(*ts)
        out = jnntile.to_array(out if out.dtype == "float32" else jnntile.convert(out, "float32"))
        return jnp.sum(out * weights), out

    def reference_loss(*xs):
        return jnp.sum(reference(*xs).astype(jnp.float32) * weights)

    argnums = tuple(range(len(tensors)))
    fn = jnntile.value_and_grad(loss, argnums=argnums, has_aux=True)
    if jit:
        fn = jax.jit(fn)
    (value, out), grads = fn(*tensors)
    ref_value, ref_grads = jax.value_and_grad(reference_loss, argnums=argnums)(*arrays)
    assert rel_err(out, expected) <= tol, "forward values differ"
    # The loss sums terms of either sign, which may nearly cancel: its error is measured against the sum of the
    # terms' magnitudes, as a sum's rounding error is bounded (a bfloat16 attention's loss came to 10.03 against
    # 10.29, 2.5% apart, from terms whose magnitudes sum to 96,560, with the outputs within 1.1e-3 normwise).
    scale = float(np.sum(np.abs(expected * weights)))
    assert abs(float(value) - float(ref_value)) <= tol * scale, "loss differs"
    for i, (g, ref_g) in enumerate(zip(grads, ref_grads)):
        assert g.id == tensors[i].id, "gradients come back with the argument's id"
        assert rel_err(jnntile.grad_of(g).numpy(), ref_g) <= tol, f"gradient of input {i} differs"


def mlp_problem(rng, batches: int = 1):
    """A two-layer MLP's weights (numpy) and `batches` inputs of shape (5, 6)."""
    arrays = {"w1": rng.standard_normal((6, 8)).astype(np.float32) * 0.5,
              "w2": rng.standard_normal((8, 3)).astype(np.float32) * 0.5}
    return arrays, [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(batches)]


def mlp_params(arrays):
    """The MLP's weights as Tensors with uneven tiles."""
    import jnntile

    return {"w1": jnntile.from_array(arrays["w1"], (4, 3)), "w2": jnntile.from_array(arrays["w2"], (3, 2))}


def mlp_loss(params, x):
    """sum(mlp(x)^2) on jnntile ops (the loss of `mlp_problem`)."""
    import jax.numpy as jnp

    import jnntile
    from jnntile.ops import elementwise as ew
    from jnntile.ops import gemm

    h = ew.gelu_tanh(gemm.matmul(x, params["w1"]))
    return jnp.sum(jnntile.to_array(gemm.matmul(h, params["w2"])) ** 2)


def mlp_reference_loss(params, x):
    """The same loss in plain JAX."""
    import jax
    import jax.numpy as jnp

    h = jax.nn.gelu(x @ params["w1"], approximate=True)
    return jnp.sum((h @ params["w2"]) ** 2)


TRAIN_STEPS_LR = 1e-2  # train_steps' AdamW learning rate


def assert_trained_params_close(params: dict, reference: dict, steps: int, lr: float, tol: float) -> None:
    """GPT-2 parameters after `steps` AdamW steps at `lr` against a reference run's, to `tol` (rel_err).

    AdamW divides each gradient by its own magnitude, so a gradient that is zero in exact arithmetic moves its
    parameter by up to lr per step in whichever direction its float32 rounding points, and another order of
    summation (other devices, other ranks) changes that rounding: the key biases (part 1 of c_attn.bias,
    which softmax ignores) are held to that bound instead."""
    for name in reference:
        mine, expected = params[name], reference[name]
        if name.endswith("attn.c_attn.bias"):
            assert np.abs(mine[1] - expected[1]).max() <= 2 * lr * steps, name
            mine, expected = np.delete(mine, 1, axis=0), np.delete(expected, 1, axis=0)
        assert rel_err(mine, expected) <= tol, name


def train_steps(config, steps: int, batch_size: int, seq_len: int, seed: int = 0, optimizer: str = "adamw"):
    """Losses and final parameters of `steps` AdamW (or SGD) steps at TRAIN_STEPS_LR (jnntile.step.make_steps)
    of a GPT-2 on random tokens."""
    from flax import nnx

    from jnntile.training import optim
    from jnntile.models import gpt2
    from jnntile.training.step import make_steps

    model = gpt2.GPT2(config, batch_size=batch_size, seq_len=seq_len, seed=seed)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = {"adamw": optim.adamw, "sgd": optim.sgd}[optimizer](TRAIN_STEPS_LR)
    opt_state = tx.init(params)
    train_step, _ = make_steps(graphdef, tx)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        idx, targets = (rng.integers(0, config.vocab_size, (1, batch_size, seq_len)).astype(np.int32) for _ in range(2))
        params, opt_state, loss = train_step(params, opt_state, idx, targets, [None])  # one micro-batch, no dropout
        losses.append(np.asarray(loss))
    nnx.update(model, params)
    return np.array(losses), {name: p.get_value().numpy() for name, p in model.named_params().items()}


# ---- CPU and CUDA kernels ---------------------------------------------------------------

def cuda_skip_reason() -> str | None:
    """Why CUDA kernels cannot run here, or None when a GPU can run them."""
    from jnntile.core import runtime

    if not runtime.HAS_CUDA:
        return "jnntile is built against a StarPU without CUDA (`make test-gpu` builds one with CUDA)"
    if runtime.gpu_count() == 0:
        return "no GPU: this jnntile has CUDA kernels but the CUDA runtime sees no device"
    return None


def emulated_gpu() -> bool:
    """Whether this process runs on tools/emulated_gpu (`make test-emulated-gpu`): a CUDA worker on host memory
    that runs the CPU kernels."""
    from jnntile import _xla_ffi

    return _xla_ffi.emulated_gpu()


def gpu_kernels_skip_reason() -> str | None:
    """Why the GPU's own kernels (cuBLAS, TF32 products, the fused attention) cannot run here, or None."""
    if cuda_skip_reason() is None and emulated_gpu():
        return "an emulated GPU (tools/emulated_gpu) runs the CPU kernels on its CUDA worker"
    return cuda_skip_reason()


@pytest.fixture
def restore_runtime():
    """Puts the runtime configuration back after a test that changes it."""
    import dataclasses

    import jnntile

    previous = jnntile.runtime.config()
    yield
    jnntile.runtime.stop()
    jnntile.release_traced()
    jnntile.runtime.configure(**dataclasses.asdict(previous))


def restart_runtime(**settings) -> None:
    """Restarts the runtime with `settings` changed (nothing happens when they are already in force)."""
    import dataclasses

    from jnntile.core import runtime

    if dataclasses.replace(runtime.config(), **settings) == runtime.config():
        return
    runtime.stop()
    runtime.configure(**settings)


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def placement(request):
    """Runs a test module's tests with every kernel on CPU workers, then on CUDA workers.

    Op and model tests use it (`pytestmark = pytest.mark.usefixtures("placement")`),
    so the CUDA kernels meet the same references, tilings and tolerances as the CPU
    ones; CUDA products run in FP32 (matmul_precision="highest") for that. Without
    a GPU the "cuda" half is skipped with the reason.
    """
    from jnntile.core import runtime

    if request.param == "cuda" and cuda_skip_reason():
        pytest.skip(cuda_skip_reason())
    if not runtime.HAS_CUDA:  # CPU kernels only: nothing to switch
        yield request.param
        return
    previous = runtime.config()
    restart_runtime(placement=request.param if runtime.HAS_CUDA else "auto", matmul_precision="highest")
    yield request.param
    restart_runtime(placement=previous.placement, matmul_precision=previous.matmul_precision)


# A packed batch of a (2, 12) model: examples of 3, 5 and 2 tokens then 2 of padding, and of 7 and 5, their
# boundaries inside and across sequence tiles of 4 and 5.
PACKED_LENGTHS = [[3, 5, 2], [7, 5]]
PACKED_TILE_SEQS = {"one_tile": 12, "many_tiles": 4, "uneven_tiles": 5}


def check_packed_against_alone(make_model, vocab_size, tol=1e-5):
    """A model's packed batch (PACKED_LENGTHS) against each example alone at the start of a row: the logits of
    every example's tokens and the gradients of the summed loss over the examples' targets, within `tol`."""
    import jax.numpy as jnp

    import jnntile
    from jnntile import nn
    from jnntile.models import loss_and_grads

    rng = np.random.default_rng(11)
    B, T = 2, 12
    examples = [rng.integers(0, vocab_size, n + 1) for row in PACKED_LENGTHS for n in row]  # ids, then the target
    idx, targets = np.zeros((B, T), np.int32), np.full((B, T), -100, np.int32)
    segments, positions = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    places, e = [], 0
    for b, row in enumerate(PACKED_LENGTHS):
        t = 0
        for s, n in enumerate(row):
            idx[b, t:t + n], targets[b, t:t + n] = examples[e][:-1], examples[e][1:]
            segments[b, t:t + n], positions[b, t:t + n] = s + 1, np.arange(n)
            places.append((b, t, n))
            t, e = t + n, e + 1
    model = make_model(B, T)
    packed_logits = model(model.token_tensor(idx), packing=model.packing_tensors(segments, positions))[0].numpy()
    loss, grads = loss_and_grads(model, idx, targets, segments=segments, positions=positions)
    packed_grads = [float((targets != -100).sum()) * jnntile.grad_of(g).numpy() for g in nn.tensors(grads)]
    # Alone: example e at the start of row e % B of a batch of its own, the other positions padding.
    alone_grads = [np.zeros_like(g) for g in packed_grads]
    for first in range(0, len(examples), B):
        a_idx, a_targets = np.zeros((B, T), np.int32), np.full((B, T), -100, np.int32)
        batch = list(enumerate(range(first, min(first + B, len(examples)))))
        for row, e in batch:
            n = places[e][2]
            a_idx[row, :n], a_targets[row, :n] = examples[e][:-1], examples[e][1:]
        logits = model(model.token_tensor(a_idx))[0].numpy()
        for row, e in batch:
            b, t, n = places[e]
            assert rel_err(packed_logits[b, t:t + n], logits[row, :n]) <= tol, f"logits of example {e}"
        _, grads = loss_and_grads(model, a_idx, a_targets)
        for total, g in zip(alone_grads, nn.tensors(grads)):
            total += float((a_targets != -100).sum()) * jnntile.grad_of(g).numpy()
    for packed, alone in zip(packed_grads, alone_grads):
        assert rel_err(packed, alone) <= tol
    assert jnp.isfinite(loss)
