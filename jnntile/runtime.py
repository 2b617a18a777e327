"""The StarPU runtime: configuration, lazy start, clean stop, statistics.

StarPU starts on first use with the configuration given to `configure` (or
explicitly with `start`) and stops at interpreter exit. Every setting has a
stated default; a memory limit is always set because StarPU's own estimate of
RAM is wrong on virtual machines (DESIGN invariant 6).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from pathlib import Path

import jax

from jnntile import _blas

_blas.configure_openblas()  # must run before the native module loads OpenBLAS

from jnntile import _xla_ffi  # noqa: E402

MAX_CPU_WORKERS = 4  # Debian's StarPU is built with STARPU_MAXCPUS=4
MIN_SWAP_MB = 16  # StarPU's disk nodes must be at least this large (it aborts otherwise)
# StarPU 1.3's schedulers (an unknown name would silently fall back to the default).
SCHEDULERS = ("eager", "prio", "random", "lws", "ws", "dm", "dmda", "dmdap", "dmdar", "dmdas", "dmdasd",
              "pheft", "peager", "heteroprio")


def _default_memory_limit_mb() -> int:
    """Half of the memory available now: room for XLA, Python and the page cache."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available_kb = int(fields["MemAvailable"].split()[0])
        return max(256, available_kb // 1024 // 2)
    except (OSError, KeyError, ValueError):
        return 4096


@dataclasses.dataclass
class RuntimeConfig:
    """How StarPU runs. Defaults suit this 2-core machine class."""

    workers: int = dataclasses.field(default_factory=lambda: min(os.cpu_count() or 1, MAX_CPU_WORKERS))
    scheduler: str = "lws"  # lowest measured per-task overhead among the work-stealing ones
    memory_limit_mb: int = dataclasses.field(default_factory=_default_memory_limit_mb)
    swap_dir: str | None = None  # where tiles go when RAM is over the limit; None: no swap
    swap_size_mb: int = 16384
    watchdog_s: float = 120.0  # a wait with no task completing for this long is an error

    def validate(self) -> None:
        if not 1 <= self.workers <= MAX_CPU_WORKERS:
            raise ValueError(
                f"workers={self.workers}: Debian's StarPU allows 1 to {MAX_CPU_WORKERS} CPU workers")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r} is not a StarPU scheduler; use one of {SCHEDULERS}")
        if self.memory_limit_mb <= 0:
            raise ValueError(f"memory_limit_mb={self.memory_limit_mb} must be positive")
        if self.swap_dir is not None and self.swap_size_mb < MIN_SWAP_MB:
            raise ValueError(f"swap_size_mb={self.swap_size_mb} must be at least {MIN_SWAP_MB} when swap_dir is set "
                             "(StarPU's smallest disk)")
        if self.watchdog_s <= 0:
            raise ValueError(f"watchdog_s={self.watchdog_s} must be positive")


_config = RuntimeConfig()
_started = False


def _register_ffi_targets() -> None:
    for name, capsule in _xla_ffi.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")


_register_ffi_targets()


def configure(**settings) -> RuntimeConfig:
    """Sets fields of the configuration used by the next start (see RuntimeConfig)."""
    global _config
    if is_running():
        raise RuntimeError("configure() while the runtime is running: call jnntile.runtime.stop() first")
    candidate = dataclasses.replace(_config, **settings)
    candidate.validate()  # a bad setting leaves the configuration as it was
    _config = candidate
    return _config


def config() -> RuntimeConfig:
    return _config


def start(**settings) -> None:
    """Starts StarPU now (it otherwise starts on first use)."""
    global _started
    if settings:
        configure(**settings)
    if is_running():
        return
    _config.validate()
    # Calibration files go here instead of ~/.starpu; StarPU reads it at init.
    os.environ.setdefault("STARPU_HOME", str(Path.home() / ".cache" / "jnntile" / "starpu"))
    _xla_ffi.runtime_start(
        workers=_config.workers,
        scheduler=_config.scheduler,
        memory_limit_mb=_config.memory_limit_mb,
        swap_dir=_config.swap_dir or "",
        swap_size_mb=_config.swap_size_mb if _config.swap_dir else 0,
        watchdog_s=_config.watchdog_s,
    )
    _started = True


def ensure_started() -> None:
    if not is_running():
        start()


def is_running() -> bool:
    return _xla_ffi.runtime_running()


def stop() -> None:
    """Waits for pending tasks, frees every tensor and stops StarPU."""
    from jnntile import tensor  # tensor imports runtime

    if not is_running():
        return
    tensor._forget_all()
    _xla_ffi.runtime_stop()


def wait_all() -> None:
    """Blocks until every submitted task has completed (with the watchdog)."""
    if is_running():
        _xla_ffi.wait_all()


def blas_core() -> str:
    """The OpenBLAS kernel family in use (see jnntile/_blas.py)."""
    return _xla_ffi.blas_core()


def stats() -> dict:
    """Tasks run, busy time per worker, bytes moved between memory nodes, memory per node.

    `nodes` lists each memory node (RAM, and DISK when swapping) with
    `used_bytes`, `total_bytes` and `peak_used_bytes` (the most used at any task
    completion since start or `reset_peaks`). `bytes_moved` maps "src->dst"
    (e.g. "RAM->DISK", bytes written to swap) to bytes, cumulative since start;
    call `wait_all()` first to count the transfers of tasks still running.
    """
    return _xla_ffi.runtime_stats()


def reset_peaks() -> None:
    """Starts the peak memory use of every node (stats()["nodes"][i]["peak_used_bytes"]) over."""
    if is_running():
        _xla_ffi.reset_peaks()


atexit.register(stop)
