"""A GPU's memory and tasks through StarPU's CUDA driver, on a machine without a GPU: `make test-emulated-gpu`
runs this file with tools/emulated_gpu preloaded (elsewhere it skips, with the reason).

The emulated GPU's CUDA worker runs the CPU kernels on "device" memory that is host memory, so a run on it must
give the bits of a run on CPU workers: what these tests check is everything between the kernels, which is what
a GPU run adds (tiles moved to and evicted from GPU memory, the CUDA worker's pipeline, GPU memory limits with
RAM and disk behind them). The CUDA kernels themselves need a GPU (tests/test_gpu.py and the ops' tests).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_trained_params_close, emulated_gpu, rel_err, restart_runtime, train_steps
from test_distributed import STEPS, WORKER, _skip_reason as _mpi_skip_reason, mpirun

import distributed_worker

import jnntile
from jnntile.models.gpt2.config import GPT2Config
from jnntile.ops import gemm

pytestmark = pytest.mark.skipif(
    not (jnntile.runtime.HAS_CUDA and emulated_gpu()),
    reason="needs the CUDA build with tools/emulated_gpu preloaded: `make test-emulated-gpu`")

B, T = 2, 32
# 2.7M parameters, 42 MB of parameters, gradients and AdamW state; several tiles on every axis.
CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=4096, n_positions=T, tile_batch=1, tile_seq=16,
                    tile_embd=128, tile_heads=2, tile_hidden=256, tile_vocab=1024)


def test_the_runtime_runs_a_cuda_worker_on_the_emulated_gpu(restore_runtime):
    restart_runtime(placement="cuda")
    jnntile.runtime.ensure_started()
    assert jnntile.runtime.cuda_worker_count() == 1 and "emulated GPU" in jnntile.runtime.describe()
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    a = jnntile.from_array(x, 4)
    np.testing.assert_array_equal(gemm.matmul(a, a).numpy(), x @ x)
    gemm_tasks = jnntile.runtime.stats()["codelets"]["gemm"]
    assert gemm_tasks["cuda_tasks"] == gemm_tasks["tasks"] == 4  # a task per C tile, over its 2 K tiles


def _cpu_run(steps: int):
    """Losses and parameters of `steps` training steps on CPU workers alone."""
    restart_runtime(placement="cpu", cuda_workers=0, gpu_memory_limit_mb=0, memory_limit_mb=1024, swap_dir=None)
    return train_steps(CONFIG, steps=steps, batch_size=B, seq_len=T)


def _assert_same_run(run, reference):
    (losses, params), (ref_losses, ref_params) = run, reference
    np.testing.assert_array_equal(losses, ref_losses)
    for name in ref_params:
        np.testing.assert_array_equal(params[name], ref_params[name], err_msg=name)


def test_training_under_a_gpu_limit_gives_the_bits_of_cpu_workers(restore_runtime):
    """A GPU limit of a tenth of the state: tiles leave the GPU for RAM and come back, the numbers do not change."""
    reference = _cpu_run(3)
    restart_runtime(placement="cuda", cuda_workers=-1, gpu_memory_limit_mb=4)
    jnntile.runtime.reset_peaks()
    _assert_same_run(train_steps(CONFIG, steps=3, batch_size=B, seq_len=T), reference)
    stats = jnntile.runtime.stats()
    assert stats["bytes_moved"]["CUDA->RAM"] > 0 and stats["bytes_moved"]["RAM->CUDA"] > 0
    assert all(n["peak_used_bytes"] <= 4 * 2**20 for n in stats["nodes"] if n["kind"] == "CUDA")


@pytest.mark.parametrize("peer_copies", [False, True], ids=["through-ram", "peer-copies"])
def test_two_gpus_train_with_the_bits_of_cpu_workers(peer_copies, monkeypatch, restore_runtime):
    """Two emulated GPUs of 4 MB each (EMULATED_GPU_COUNT): both CUDA workers run the step's tasks, tiles go
    from one GPU to the other (directly with peer copies, else through RAM) and out to RAM, and the run gives
    the bits of CPU workers alone. Before tools/starpu-patches/prefetch-count-before-the-copy.patch, stopping
    the runtime after this run failed a StarPU assertion and aborted the process, through RAM in every run."""
    reference = _cpu_run(3)
    monkeypatch.setenv("EMULATED_GPU_COUNT", "2")
    monkeypatch.setenv("EMULATED_GPU_PEER", "1" if peer_copies else "0")
    restart_runtime(placement="cuda", cuda_workers=-1, gpu_memory_limit_mb=4)
    jnntile.runtime.ensure_started()
    assert jnntile.runtime.cuda_worker_count() == 2
    run = train_steps(CONFIG, steps=3, batch_size=B, seq_len=T)
    stats = jnntile.runtime.stats()
    jnntile.runtime.stop()  # unregisters every tile: where the leaked prefetch count aborted
    _assert_same_run(run, reference)
    cuda_tasks = [w["tasks"] for w in stats["workers"] if w["name"].startswith("CUDA")]
    assert len(cuda_tasks) == 2 and min(cuda_tasks) > 0, stats["workers"]
    assert all(n["peak_used_bytes"] <= 4 * 2**20 for n in stats["nodes"] if n["kind"] == "CUDA")


def test_without_a_limit_every_gpu_gets_what_the_fullest_one_has_free(monkeypatch, restore_runtime):
    """One GPU memory limit serves every GPU, so its default is the memory free on the GPU with the least of it
    (another process may hold part of one), less the reserve: a limit above a GPU's free memory would have
    StarPU's allocations fail there. Only the GPUs StarPU uses count (cuda_workers N: the first N)."""
    monkeypatch.setenv("EMULATED_GPU_COUNT", "2")
    monkeypatch.setenv("EMULATED_GPU_MB", "64,32")
    reserve = 1 - jnntile.runtime.GPU_MEMORY_RESERVE
    restart_runtime(placement="cuda", cuda_workers=1, gpu_memory_limit_mb=0)
    assert jnntile.runtime.gpu_memory_mb() == int(64 * reserve)
    restart_runtime(placement="cuda", cuda_workers=-1, gpu_memory_limit_mb=0)
    assert jnntile.runtime.gpu_memory_mb() == int(32 * reserve)
    jnntile.runtime.ensure_started()
    assert jnntile.runtime.cuda_worker_count() == 2
    assert f"GPU memory limit {jnntile.runtime.gpu_memory_mb()} MB per GPU" in jnntile.runtime.describe()


# Two steps under the limits of argv: swap dir ("" for none), output file, GPU MB (0: unlimited), RAM MB.
LIMITED_RUN = """
import sys
import numpy as np
import jnntile
from conftest import train_steps
from test_emulated_gpu import B, CONFIG, T
jnntile.runtime.start(placement="cuda", gpu_memory_limit_mb=int(sys.argv[3]), memory_limit_mb=int(sys.argv[4]),
                      swap_dir=sys.argv[1] or None, swap_size_mb=128, watchdog_s=60)
print(jnntile.runtime.describe(), flush=True)
losses, params = train_steps(CONFIG, steps=2, batch_size=B, seq_len=T)
np.savez(sys.argv[2], losses=losses, moved=[jnntile.runtime.stats()["bytes_moved"].get(k, 0)
                                            for k in ("CUDA->RAM", "RAM->DISK", "DISK->RAM")], **params)
"""


@pytest.mark.parametrize("gpu_mb, ram_mb, copy_delay_us", [(8, 8, None), (4, 4, None), (8, 8, 300)],
                         ids=["8-8", "4-4", "8-8-slow-copies"])
def test_gpu_ram_and_disk_limits_together(gpu_mb, ram_mb, copy_delay_us, restore_runtime, tmp_path):
    """All three levels, each holding part of the 42 MB of state: tiles go GPU -> RAM -> disk and back, in a
    process of its own, and the run gives the bits of CPU workers alone. 4 MB is the least one AdamW task of
    CONFIG needs on two workers. With copy_delay_us, copies to and from the GPU complete that much later than
    they were queued (EMULATED_GPU_ASYNC_US): what reads a copy before StarPU knows it is done reads stale bytes.

    Before tools/starpu-patches/bounded-nested-writebacks.patch, 8/8 and 4/8 MB stopped making progress in
    every run (StarPU's evictions nested in each other on the GPU's worker); with StarPU's prefetches forced back
    on they still do (docs/design.md, "GPU, RAM and disk limits together")."""
    stdout, run = _limited_run(str(tmp_path), tmp_path / "run.npz", gpu_mb, ram_mb, copy_delay_us)
    assert "no prefetching (GPU with disk swap)" in stdout
    assert all(run["moved"] > 0)  # CUDA->RAM, RAM->DISK, DISK->RAM
    _assert_same_run((run["losses"], {name: run[name] for name in run.files}), _cpu_run(2))


def test_ram_without_swap_takes_back_what_it_read_from_the_gpu(restore_runtime, tmp_path):
    """An unlimited GPU holds the step and RAM, limited to 4 MB without swap, receives every tile read back
    (train_steps reads all 10.8 MB of parameters, as a checkpoint does): RAM drops the copies the GPU also holds.
    Before tools/starpu-patches/drop-clean-ram-copies.patch RAM kept them all and the run stopped."""
    _, run = _limited_run("", tmp_path / "run.npz", 0, 4)
    assert run["moved"][0] > 0  # CUDA->RAM
    _assert_same_run((run["losses"], {name: run[name] for name in run.files}), _cpu_run(2))


def test_a_gpu_limit_beside_too_little_ram_without_swap_is_refused_before_training(dataset, tmp_path):
    """Under a GPU memory limit, CPU workers run kernels too and their results stay in RAM, which nothing takes
    back without swap: a RAM limit below the step's peak stopped with the watchdog's error (docs/troubleshooting.md,
    Troubleshooting), so the plan refuses it at once and names the RAM that suffices, which then runs."""
    import re

    def train(ram_mb: str, out: str):
        return subprocess.run([sys.executable, "-m", "jnntile.train", "--data", str(dataset), "--n-layer", "2",
                               "--n-embd", "256", "--n-head", "4", "--seq-len", "64", "--batch-size", "2", "--steps",
                               "2", "--gpu-memory-limit-mb", "256", "--memory-limit-mb", ram_mb, "--out",
                               str(tmp_path / out)], capture_output=True, text=True, timeout=300)

    refused = train("4", "refused")
    assert refused.returncode != 0 and "CPU workers run kernels too" in refused.stderr, refused.stderr[-2000:]
    enough = re.search(r"raise --memory-limit-mb to (\d+)", refused.stderr).group(1)
    ran = train(enough, "ran")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (tmp_path / "ran" / "metrics.jsonl").read_text().count("\n") >= 2


def _limited_run(swap_dir: str, out: Path, gpu_mb: int, ram_mb: int, copy_delay_us: int | None = None):
    """LIMITED_RUN in a process of its own (a run that stops leaves StarPU unable to start again there), with the
    emulated GPU's copies that much slower than they are queued when copy_delay_us is given."""
    env = dict(os.environ)
    if copy_delay_us is not None:
        env["EMULATED_GPU_ASYNC_US"] = str(copy_delay_us)
    result = subprocess.run([sys.executable, "-c", LIMITED_RUN, swap_dir, str(out), str(gpu_mb), str(ram_mb)],
                            cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout, np.load(out)


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=str(_mpi_skip_reason()))
@pytest.mark.parametrize("sharded", [False, True], ids=["data-parallel", "sharded"])
def test_two_ranks_on_emulated_gpus_train_like_one_process_on_cpu_workers(sharded, restore_runtime, tmp_path):
    """`mpirun -n 2` with the emulated GPU preloaded in each rank (passed on with -x, as on GPU nodes): the steps'
    tasks run on each rank's CUDA worker, StarPU-MPI of the CUDA build sends tiles that GPU memory holds, and the
    ranks give the losses and parameters of one process on CPU workers, data parallel and with sharded state."""
    restart_runtime(placement="cpu", cuda_workers=0)
    losses, params = distributed_worker.train(STEPS)
    passed_on = [arg for name in ("LD_PRELOAD", "EMULATED_GPU_ASYNC_US") if name in os.environ for arg in ("-x", name)]
    result = mpirun((2, WORKER, tmp_path, "--steps", STEPS, *(["--shard-state"] if sharded else [])),
                    options=passed_on)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for r, run in enumerate(runs):
        assert run["cuda_tasks"] > 0, f"rank {r} ran no task on its CUDA worker"
        assert rel_err(run["losses"], losses) <= 1e-5, (r, run["losses"], losses)
        assert_trained_params_close({name: run[f"param:{name}"] for name in params}, params, STEPS,
                                    distributed_worker.LEARNING_RATE, 1e-4)
