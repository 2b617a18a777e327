"""The StarPU runtime: configuration, statistics, idle behaviour, failures."""

import ctypes
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jnntile
from jnntile.ops import gemm


def test_statistics_count_tasks_workers_and_memory():
    jnntile.runtime.ensure_started()
    before = jnntile.runtime.stats()
    a = jnntile.random_normal((256, 256), seed=1, tile_shape=64)
    c = gemm.matmul(a, a)
    c.numpy()
    # A read returns when its tiles are there; the completion callback of the last task may still be running.
    jnntile.runtime.wait_all()
    after = jnntile.runtime.stats()
    # 16 random tiles + 16 C tiles (a task each, over its 4 K tiles) + 16 reads
    assert after["tasks_completed"] - before["tasks_completed"] >= 16 + 16 + 16
    assert after["tasks_pending"] == 0
    gemm_tasks = after["codelets"]["gemm"]["tasks"] - before["codelets"].get("gemm", {}).get("tasks", 0)
    assert gemm_tasks == 16 and after["codelets"]["gemm"]["seconds"] > 0
    if jnntile.runtime.config().placement == "cpu":  # the suite's default (tests/test_gpu.py checks "cuda")
        assert after["codelets"]["gemm"]["cuda_tasks"] == 0
    cpu_workers = [w for w in after["workers"] if w["name"].startswith("CPU")]  # CUDA workers come on top
    assert len(cpu_workers) == jnntile.runtime.config().workers
    assert sum(w["busy_s"] for w in after["workers"]) > 0
    assert sum(w["tasks"] for w in after["workers"]) > 0
    ram = [n for n in after["nodes"] if n["kind"] == "RAM"][0]
    # StarPU keeps the smaller of the limit and its own estimate of RAM.
    assert 0 < ram["total_bytes"] <= jnntile.runtime.config().memory_limit_mb * 2**20
    assert ram["used_bytes"] >= 2 * 256 * 256 * 4
    assert isinstance(after["bytes_moved"], dict)


def test_idle_process_does_not_spin():
    a = jnntile.random_normal((512, 512), seed=1, tile_shape=128)
    gemm.matmul(a, a).numpy()
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    cpu_per_s = (time.process_time() - start_cpu) / (time.perf_counter() - start_wall)
    assert cpu_per_s < 0.2, f"idle workers used {cpu_per_s:.2f} CPU-seconds per second"


MAX_WORKERS = jnntile.runtime.MAX_CPU_WORKERS


@pytest.mark.parametrize("settings, message", [
    ({"workers": MAX_WORKERS + 1}, f"1 to {MAX_WORKERS} CPU workers"),
    ({"workers": 0}, f"1 to {MAX_WORKERS} CPU workers"),
    ({"cuda_workers": -2}, "cuda_workers=-2"),
    ({"gpu_memory_limit_mb": -1}, "gpu_memory_limit_mb=-1"),
    ({"placement": "gpu"}, "placement='gpu'"),
    ({"matmul_precision": "fp16"}, "matmul_precision='fp16'"),
    ({"scheduler": "fastest"}, "not a StarPU scheduler"),
    ({"memory_limit_mb": 0}, "must be positive"),
    ({"swap_dir": "/tmp/x", "swap_size_mb": 0}, "at least 16"),
    ({"swap_dir": "/tmp/x", "swap_size_mb": 8}, "at least 16"),
    ({"swap_backend": "hdf5"}, "swap_backend='hdf5': use one of"),
])
def test_bad_configuration(settings, message):
    jnntile.runtime.stop()
    previous = jnntile.runtime.config()
    with pytest.raises(ValueError, match=message):
        jnntile.runtime.configure(**settings)
    assert jnntile.runtime.config() == previous


@pytest.mark.skipif(jnntile.runtime.HAS_CUDA, reason="this jnntile has CUDA kernels")
@pytest.mark.parametrize("settings", [{"cuda_workers": 1}, {"placement": "cuda"}])
def test_cuda_without_cuda_build_is_refused(settings):
    jnntile.runtime.stop()
    with pytest.raises(ValueError, match="make cuda"):
        jnntile.runtime.configure(**settings)


def test_no_cpu_worker_is_a_clear_error():
    # STARPU_NCPU in the environment overrides the configuration; jnntile needs CPU workers.
    code = "import jnntile\ntry:\n    jnntile.runtime.start()\nexcept RuntimeError as e:\n    print(e)\n"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "STARPU_NCPU": "0"},
                            capture_output=True, text=True, timeout=120)
    assert "without CPU workers" in result.stdout and "STARPU_NCPU" in result.stdout, result.stdout + result.stderr


def test_configure_while_running_is_refused():
    jnntile.runtime.ensure_started()
    with pytest.raises(RuntimeError, match="stop"):
        jnntile.runtime.configure(workers=1)


def test_other_scheduler_runs_ops():
    jnntile.runtime.stop()
    jnntile.runtime.start(scheduler="eager", workers=1)
    try:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        a = jnntile.from_array(x, (2, 2))
        np.testing.assert_allclose(gemm.matmul(a, a, trans_b=True).numpy(), x @ x.T)
    finally:
        jnntile.runtime.stop()
        jnntile.runtime.configure(scheduler="auto", workers=2)


@pytest.mark.parametrize("kind", ["round_trip", "chain", "independent"])
def test_empty_task_measurement_runs_its_tasks_and_reports_a_time(kind):
    """bench/overhead.py's measurement: each kind runs its tasks (one warm-up task per tile, then `count`) and
    reports a positive time per task; on CUDA workers where there are none it names what is missing."""
    jnntile.runtime.ensure_started()
    count, measure, kind = 50, jnntile._xla_ffi.measure_empty_tasks, getattr(jnntile._xla_ffi.EmptyTasks, kind)
    warm_up = count if kind == jnntile._xla_ffi.EmptyTasks.independent else 1
    for on_cuda in [False] + ([True] if jnntile.runtime.cuda_worker_count() > 0 else []):
        before = jnntile.runtime.stats()["tasks_completed"]
        assert 0 < measure(count, kind, on_cuda) < 1
        assert jnntile.runtime.stats()["tasks_completed"] - before == count + warm_up
    if jnntile.runtime.cuda_worker_count() == 0:
        with pytest.raises(RuntimeError, match="CUDA workers: this runtime has none"):
            measure(count, kind, True)
    with pytest.raises(ValueError, match="count must be positive"):
        measure(0, kind, False)


def test_runtime_that_fails_to_start_gives_a_clear_error(tmp_path):
    jnntile.runtime.stop()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the swap directory should be")
    jnntile.runtime.configure(swap_dir=str(blocker / "swap"))
    try:
        with pytest.raises(ValueError, match=r"swap directory .*not-a-dir/swap cannot be created \(Not a directory\)"):
            jnntile.zeros((2, 2))
        assert not jnntile.runtime.is_running()
    finally:
        jnntile.runtime.configure(swap_dir=None)
    assert jnntile.zeros((2, 2)).numpy().sum() == 0


def test_stuck_tasks_raise_instead_of_hanging():
    # 4 tiles of 1 MB must all stay in RAM (no disk swap) under a 2 MB limit:
    # StarPU can never run the last writes. The watchdog turns that into an error.
    script = textwrap.dedent("""
        import numpy as np, jnntile
        jnntile.runtime.start(memory_limit_mb=2, watchdog_s=2)
        t = jnntile.from_array(np.ones((1024, 1024), np.float32), (256, 1024))
    """)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "no StarPU task completed" in result.stderr
    assert "memory limit 2 MB" in result.stderr
    assert time.perf_counter() - started < 60


def _run_stuck(submit_stuck_work: str) -> list[str]:
    """Runs `submit_stuck_work` under a 2 MB limit without swap, then stop() and a fresh start; the lines printed.
    CPU workers only: a GPU would run the products in its own memory."""
    script = textwrap.dedent("""
        import numpy as np, jnntile
        from jnntile.ops import gemm
        jnntile.runtime.start(memory_limit_mb=2, watchdog_s=2, cuda_workers=0)
        try:
            {work}
        except RuntimeError as e:
            print("watchdog:", "no StarPU task completed" in str(e))
        jnntile.runtime.stop()
        print("stopped:", not jnntile.runtime.is_running())
        try:
            jnntile.runtime.start(memory_limit_mb=64)
            print("restarted:", jnntile.from_array(np.ones((4, 4), np.float32)).numpy().sum() == 16)
        except RuntimeError as e:
            print("restart refused:", "cannot start again in this process" in str(e) and "memory limit 2 MB" in str(e))
    """).format(work=submit_stuck_work)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def test_after_the_watchdog_the_stuck_tasks_drain_and_the_runtime_starts_again():
    # The last two 1 MB writes wait for memory; once stop() releases the first tiles they run, as no-ops
    # (their host array is gone), and StarPU shuts down cleanly.
    lines = _run_stuck("jnntile.from_array(np.ones((1024, 1024), np.float32), (256, 1024))")
    assert lines == ["watchdog: True", "stopped: True", "restarted: True"]


def test_tasks_that_can_never_run_leave_a_clear_refusal_to_start_again():
    # One product of three 1 MB tiles can never fit a 2 MB limit, even with everything else released.
    lines = _run_stuck("a, b = jnntile.full((512, 512), 1.0), jnntile.full((512, 512), 2.0); gemm.matmul(a, b).numpy()")
    assert lines == ["watchdog: True", "stopped: True", "restart refused: True"]


def test_starpu_environment_disables_the_sub_allocator():
    """StarPU 1.4's 32 MiB chunks for small buffers would break limits below 32 MB (xla_ffi/runtime.cc)."""
    jnntile.runtime.ensure_started()
    libc = ctypes.CDLL(None)  # StarPU reads the C environment, which os.environ does not reflect
    libc.getenv.restype = ctypes.c_char_p
    assert libc.getenv(b"STARPU_SUBALLOCATOR") == b"0"


def test_the_whole_configuration_reaches_the_native_runtime():
    """One RuntimeConfig with its defaults in Python, handed whole to the native side as a bound struct."""
    config = dataclasses.replace(jnntile.runtime.config(), swap_dir="/tmp/x", swap_size_mb=64, placement="cpu",
                                 swap_backend="unistd", matmul_precision="tf32", watchdog_s=7.5,
                                 fused_attention=True)
    native = jnntile.runtime._native(config, gpu_limit_mb=123)
    fields = {name for name in dir(native) if not name.startswith("_")}
    assert fields == {"workers", "cuda_workers", "scheduler", "memory_limit_mb", "gpu_memory_limit_mb", "swap_dir",
                      "swap_size_mb", "swap_backend", "watchdog_s", "placement", "tf32", "pin_host_memory",
                      "distributed", "fused_attention", "shard_keep_fetched"}
    assert native.fused_attention
    assert (native.workers, native.memory_limit_mb) == (config.workers, config.memory_limit_mb)
    assert native.scheduler == jnntile.runtime.resolved_scheduler(config)
    assert (native.swap_dir, native.swap_size_mb, native.watchdog_s) == ("/tmp/x", 64, 7.5)
    assert native.swap_backend.name == "unistd" and native.placement.name == "cpu" and native.tf32
    assert native.gpu_memory_limit_mb == 123
    assert jnntile.runtime._native(dataclasses.replace(config, swap_dir=None), 0).swap_size_mb == 0


@pytest.mark.parametrize("gpus, swap_dir, cuda_build, expected", [
    (1, None, True, "dmdas"), (1, "/tmp/x", True, "dmdas"), (0, None, False, "lws"), (0, "/tmp/x", False, "eager"),
    (0, "/tmp/x", True, "lws")])
def test_auto_scheduler_is_resolved_from_the_gpus_and_the_swap(gpus, swap_dir, cuda_build, expected, monkeypatch):
    """"auto": dmdas with a GPU; on CPUs with Debian's StarPU, eager with disk swap (tasks in submission order,
    the order the planner replays: fewer bytes to and from swap than lws, measured in
    jnntile.runtime.resolved_scheduler's docstring), else lws. An explicit scheduler stays."""
    monkeypatch.setattr(jnntile.runtime, "gpu_count", lambda: gpus)
    monkeypatch.setattr(jnntile.runtime, "HAS_CUDA", cuda_build)
    config = dataclasses.replace(jnntile.runtime.config(), scheduler="auto", swap_dir=swap_dir, cuda_workers=-1)
    assert jnntile.runtime.resolved_scheduler(config) == expected
    assert jnntile.runtime._native(config, gpu_limit_mb=0).scheduler == expected
    assert jnntile.runtime.resolved_scheduler(dataclasses.replace(config, scheduler="ws")) == "ws"


@pytest.mark.parametrize("gpu_mb, user_limit_mb, expected", [(80000, 0, "cuda"), (80000, 500, "any"), (0, 0, "any")])
def test_auto_placement_is_resolved_from_the_users_gpu_limit(gpu_mb, user_limit_mb, expected, monkeypatch):
    """"auto" runs kernels with a CUDA version on the GPU unless the user limited its memory. The native side
    sees the resolved limit (nonzero whenever there is a GPU), so it gets "cuda" or "any", never "auto": on an
    H100 "auto" ran as "any" while the native side decided (CPU workers took 18% of a step's tasks)."""
    monkeypatch.setattr(jnntile.runtime, "gpu_memory_mb", lambda config=None: gpu_mb)
    config = dataclasses.replace(jnntile.runtime.config(), placement="auto", gpu_memory_limit_mb=user_limit_mb)
    assert jnntile.runtime.resolved_placement(config) == expected
    assert jnntile.runtime._native(config, gpu_limit_mb=gpu_mb).placement.name == expected
    assert jnntile.runtime.cpu_kernels_beside_gpu(config) == (expected == "any")
    for explicit in ("any", "cpu", "cuda"):
        assert jnntile.runtime.resolved_placement(dataclasses.replace(config, placement=explicit)) == explicit


def test_a_crash_in_native_code_prints_the_native_stack_then_the_python_one():
    # A fault inside StarPU or a kernel says where even without a debugger; Python's faulthandler still runs.
    crash = "import ctypes, jnntile; jnntile.runtime.start(); ctypes.string_at(0)"
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", crash], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -11, result.stderr
    native = result.stderr.index("jnntile: fatal signal; native stack (innermost first):")
    frames = result.stderr[native:].splitlines()[1:4]
    assert all(re.search(r"\(.*\)\[0x[0-9a-f]+\]$", frame) for frame in frames), frames
    assert result.stderr.index("Fatal Python error: Segmentation fault") > native
    assert 'line 1 in <module>' in result.stderr
