"""GPUs: the CUDA kernels against the CPU ones, GPU memory levels, JAX with a GPU backend.

Each op's CUDA codelet also meets the pure-JAX reference in the op's own test
file (the `placement` fixture runs those tests on CUDA workers). Tests here
that need a GPU skip without one, with the reason; the placement of the token
graph on JAX's CPU device is tested everywhere.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import (SUITE_RUNTIME, TRAIN_STEPS_LR, assert_trained_params_close, cuda_skip_reason,
                      gpu_kernels_skip_reason, rel_err, restart_runtime, train_steps)

import jnntile
from jnntile.models.gpt2.config import GPT2Config
from jnntile.ops import _ffi, gemm

needs_gpu = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
needs_gpu_kernels = pytest.mark.skipif(gpu_kernels_skip_reason() is not None, reason=str(gpu_kernels_skip_reason()))

B, T = 2, 32
# 2.7M parameters, 42 MB of parameters, gradients and AdamW state; several tiles on every axis.
CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=4096, n_positions=T, tile_batch=1, tile_seq=16,
                    tile_embd=128, tile_heads=2, tile_hidden=256, tile_vocab=1024)


def test_tokens_are_committed_to_the_cpu_device(monkeypatch):
    """Where JAX defaults to a GPU, tokens live on the CPU device, so jitted steps taking Tensors run there."""
    monkeypatch.setattr(_ffi, "COMMIT_TO_HOST", True)
    cpu = jax.devices("cpu")[0]
    a = jnntile.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), tile_shape=(2, 2))
    b = gemm.matmul(a, a, trans_b=True)
    for token in (a.token, b.token):
        assert token.committed and token.devices() == {cpu}
    out = jax.jit(lambda t: jnntile.to_array(gemm.matmul(t, t, trans_b=True)))(a)
    assert out.devices() == {cpu}
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(np.asarray(out), x @ x.T, rtol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="JAX's default backend is not a GPU here")
def test_training_with_jax_on_the_gpu_backend():
    """The same training code runs when JAX's default device is a GPU; the loss is a JAX array on the CPU."""
    losses, _ = train_steps(CONFIG, steps=2, batch_size=B, seq_len=T)
    assert np.all(np.isfinite(losses)) and losses[0] == pytest.approx(np.log(CONFIG.vocab_size), rel=0.05)


@needs_gpu
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_training_on_cuda_workers_matches_cpu_workers(optimizer, restore_runtime):
    restart_runtime(placement="cpu", matmul_precision="highest")
    cpu_losses, cpu_params = train_steps(CONFIG, steps=3, batch_size=B, seq_len=T, optimizer=optimizer)
    restart_runtime(placement="cuda", matmul_precision="highest")
    cuda_losses, cuda_params = train_steps(CONFIG, steps=3, batch_size=B, seq_len=T, optimizer=optimizer)
    assert rel_err(cuda_losses, cpu_losses) < 1e-5
    stats = jnntile.runtime.stats()
    assert sum(w["tasks"] for w in stats["workers"] if w["name"].startswith("CUDA")) > 0
    # Every gemm task has a CUDA version, so with placement "cuda" every one ran on a CUDA worker.
    assert stats["codelets"]["gemm"]["cuda_tasks"] == stats["codelets"]["gemm"]["tasks"] > 0
    if optimizer == "sgd":
        # Other kernels sum in another order; SGD's parameters are linear in the gradients, so they differ as
        # little (the key biases, zero gradient in exact arithmetic, by rounding noise: see
        # assert_trained_params_close). AdamW's are not compared: it divides each gradient element by its own
        # magnitude, so a last-bit difference in a small element becomes a difference of its update (on an
        # H200, 2.2e-4 relative on wpe after 3 steps while the losses agreed to 4e-7; 1e-5 on an H100).
        assert_trained_params_close(cuda_params, cpu_params, 3, TRAIN_STEPS_LR, 1e-5)


@needs_gpu
def test_gpu_memory_limit_far_below_the_state_gives_identical_losses(restore_runtime):
    """Tiles spill GPU -> RAM under a GPU limit of a quarter of the state; the numbers do not change."""
    restart_runtime(placement="cuda", matmul_precision="highest", gpu_memory_limit_mb=0)
    losses, params = train_steps(CONFIG, steps=3, batch_size=B, seq_len=T)
    restart_runtime(placement="cuda", matmul_precision="highest", gpu_memory_limit_mb=12)
    jnntile.runtime.reset_peaks()
    limited_losses, limited_params = train_steps(CONFIG, steps=3, batch_size=B, seq_len=T)
    np.testing.assert_array_equal(limited_losses, losses)
    for name in params:
        np.testing.assert_array_equal(limited_params[name], params[name], err_msg=name)
    stats = jnntile.runtime.stats()
    assert stats["bytes_moved"].get("CUDA->RAM", 0) > 0 and stats["bytes_moved"].get("RAM->CUDA", 0) > 0
    gpu_nodes = [n for n in stats["nodes"] if n["kind"] == "CUDA"]
    assert gpu_nodes and all(n["peak_used_bytes"] <= 12 * 2**20 for n in gpu_nodes)


@needs_gpu
@pytest.mark.parametrize("placement", ["auto", "any"])
def test_auto_placement_runs_every_kernel_that_has_a_cuda_version_on_the_gpu(placement, restore_runtime):
    """"auto" (the default) keeps kernels with a CUDA version off the CPU workers; "any" lets dmdas choose."""
    restart_runtime(placement=placement, matmul_precision="highest")
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    a = jnntile.from_array(x, 128)
    assert rel_err(gemm.matmul(a, a).numpy(), x.astype(np.float64) @ x) < 1e-6
    jnntile.runtime.wait_all()
    gemm_tasks = jnntile.runtime.stats()["codelets"]["gemm"]
    assert gemm_tasks["tasks"] == 16  # a task per C tile, over its 4 K tiles
    if placement == "auto":
        assert gemm_tasks["cuda_tasks"] == 16


@needs_gpu_kernels
def test_matmul_precision(restore_runtime):
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((512, 512)).astype(np.float32) for _ in range(2))
    expected = a.astype(np.float64) @ b.astype(np.float64)

    def product(precision):
        restart_runtime(placement="cuda", matmul_precision=precision)
        return gemm.matmul(jnntile.from_array(a, 256), jnntile.from_array(b, 256)).numpy()

    assert rel_err(product("highest"), expected) < 1e-6
    assert 1e-5 < rel_err(product("tf32"), expected) < 1e-2  # TF32 keeps a 10-bit mantissa


@needs_gpu
def test_tile_larger_than_the_gpu_limit_is_refused(restore_runtime):
    restart_runtime(gpu_memory_limit_mb=4)
    with pytest.raises(ValueError, match="GPU memory limit of 4 MB"):
        jnntile.zeros((2048, 1024), tile_shape=(2048, 1024))  # 8 MB tiles


def test_the_suite_compares_fp32_products_on_cpu_workers_unless_a_test_opts_in():
    """Plain-JAX references compute FP32 products (JAX's GPU default is TF32), and tests without a placement
    run every kernel on CPU workers in FP32, so 1e-5 and bitwise comparisons hold on a GPU machine too."""
    assert jax.config.jax_default_matmul_precision == "highest"
    config = jnntile.runtime.config()
    assert {name: getattr(config, name) for name in SUITE_RUNTIME} == {"placement": "cpu",
                                                                       "matmul_precision": "highest"}


def test_describe_states_the_hardware():
    text = jnntile.runtime.describe()
    assert f"{jnntile.runtime.config().workers} CPU workers" in text and "scheduler" in text
    if cuda_skip_reason() is None:
        assert "CUDA worker" in text and "matmul precision" in text


def test_matmul_precision_default_is_tf32_only_with_a_gpu():
    config = jnntile.runtime.config()
    assert dataclasses.replace(config, matmul_precision="default").tf32 == (jnntile.runtime.gpu_count() > 0)
    assert not dataclasses.replace(config, matmul_precision="highest").tf32
    assert dataclasses.replace(config, matmul_precision="tf32").tf32


@pytest.mark.skipif(not jnntile.runtime.HAS_CUDA, reason="bench/gpu.py is the CUDA build's: its smoke run is "
                    "checked by that build's suite (make test-gpu)")
def test_gpu_benchmark_runs_every_section_in_smoke_mode(tmp_path):
    """bench/gpu.py --smoke goes through every section with tiny sizes on any hardware (no speed asserted)."""
    script = Path(__file__).parents[1] / "bench" / "gpu.py"
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert all(r["jnntile_gflops"] > 0 for r in report["gemm"]["rows"])
    assert report["train"]["ratio"] > 0 and report["train"]["jnntile"]["workers"]["CPU"]["tasks"] > 0
    kernels = report["train"]["jnntile"]["kernels_per_step"]
    assert "gemm" in {k["kernel"] for k in kernels} and all(k["cpu_tasks"] + k["cuda_tasks"] > 0 for k in kernels)
    assert report["train_bf16"]["ratio"] > 0 and report["train_bf16"]["jnntile"]["config"]["dtype"] == "bfloat16"
    variants = report["variants"]
    assert "default" in variants["runs"] and all(r["ratio"] > 0 for r in variants["runs"].values())
    overhead = variants["overhead"]["us_per_task"]
    assert {"dmdas", "eager"} <= set(overhead)
    assert all(row["chain"] > 0 for rows in overhead.values() for row in rows.values())
    assert report["limited"]["tokens_per_s"] > 0
    capacity = report["capacity"]
    assert capacity["verdict"].startswith("needs") and capacity["bytes_per_step"]["RAM->DISK"] > 0
    assert all(np.isfinite(capacity["losses"]))
