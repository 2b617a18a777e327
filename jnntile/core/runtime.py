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
import re
import shutil
import signal
from pathlib import Path

# With jax[cuda] installed, XLA would take 75% of the GPU's memory when it first
# starts, though jnntile's token graph runs on JAX's CPU device and StarPU needs
# the GPU memory: XLA allocates on demand instead (unless the user decided).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

from jnntile.core import _blas

_blas.configure_openblas()  # must run before the native module loads OpenBLAS
_blas.configure_mkl()

from jnntile import _xla_ffi  # noqa: E402

MAX_CPU_WORKERS = _xla_ffi.max_cpu_workers()  # the StarPU in use: 4 for Debian's, 64 for `make cuda`'s
HAS_CUDA = _xla_ffi.has_cuda()  # built against a StarPU with CUDA, with the CUDA kernels
# With the CUDA build, StarPU owns the GPU and jnntile's token graph runs on JAX's CPU device: XLA's GPU
# backend would only add a second GPU context and memory pool beside StarPU's (an earlier H100 run saw an
# XLA GPU op crash there). So JAX stays on the CPU unless the user chose (JAX_PLATFORMS or jax.config).
if HAS_CUDA and "JAX_PLATFORMS" not in os.environ and not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")
MIN_SWAP_MB = 16  # StarPU's disk nodes must be at least this large (it aborts otherwise)
# StarPU's schedulers (an unknown name would silently fall back to the default), and "auto" (resolved_scheduler).
SCHEDULERS = ("auto", "eager", "prio", "random", "lws", "ws", "dm", "dmda", "dmdap", "dmdar", "dmdas", "dmdasd",
              "pheft", "peager", "heteroprio")
PLACEMENTS = ("auto", *_xla_ffi.Placement.__members__)  # "auto", "any", "cpu", "cuda" (xla_ffi/runtime.h)
PLACEMENT_WORDS = {"any": "the workers the scheduler chooses", "cpu": "CPU workers", "cuda": "CUDA workers"}
# StarPU's disk backends for swap: "unistd" goes through the kernel's page cache (which then holds a
# second copy of the swap, outside RSS); "unistd_o_direct" bypasses it (direct I/O).
SWAP_BACKENDS = tuple(_xla_ffi.SwapBackend.__members__)
MATMUL_PRECISIONS = ("default", "highest", "tf32")
# How gradient tiles travel between MPI ranks (xla_ffi/ops/allreduce.cc, docs/distributed.md).
ALLREDUCE_SCHEDULES = {"tree": 0, "ring": 1}
HAS_MPI = _xla_ffi.mpi_available()  # built with StarPU-MPI: distributed training possible


def local_ranks() -> int:
    """Processes of this MPI job on this machine, from the launcher's environment (1 without one).

    Read before MPI starts, so that the defaults of workers and memory share the machine.
    """
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(name, "").isdigit():
            return max(1, int(os.environ[name]))
    return 1


def _default_memory_limit_mb() -> int:
    """Half of the memory available now: room for XLA, Python and the page cache."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available_kb = int(fields["MemAvailable"].split()[0])
        return max(256, available_kb // 1024 // 2 // local_ranks())
    except (OSError, KeyError, ValueError):
        return 4096


def gpu_count() -> int:
    """GPUs this jnntile can use: 0 unless built with CUDA (`make cuda`) on a machine with a GPU driver."""
    return _xla_ffi.cuda_device_count() if HAS_CUDA else 0


# GPU memory left to the CUDA runtime, cuBLAS and StarPU's own buffers when no limit is given.
GPU_MEMORY_RESERVE = 0.05


def gpu_memory_mb(config: "RuntimeConfig | None" = None) -> int:
    """GPU memory tiles may use under `config` (the current one by default), per GPU: its limit, else
    what is free on the fullest GPU it will use less a 5% reserve; 0 when no CUDA worker will run."""
    config = config or _config
    if config.cuda_workers == 0 or gpu_count() == 0:
        return 0
    if config.gpu_memory_limit_mb:
        return config.gpu_memory_limit_mb
    free_bytes = _xla_ffi.cuda_device_free_bytes(config.cuda_workers)  # on the GPUs StarPU will use (-1: all)
    return int(free_bytes * (1 - GPU_MEMORY_RESERVE) / 2**20)


def gpu_tasks_in_flight() -> int:
    """Tasks whose tiles one GPU holds at once: StarPU's CUDA pipeline (runtime.cc's cuda_pipeline_depth, which
    task_group_bytes_limit counts too) on each of its CUDA workers (STARPU_NWORKER_PER_CUDA, 1)."""
    return _xla_ffi.cuda_pipeline_depth() * max(1, int(os.environ.get("STARPU_NWORKER_PER_CUDA", "1")))


def gpu_memory_in_use_limit_mb() -> int:
    """The GPU memory limit the running runtime started with (0: no CUDA worker)."""
    return _started_gpu_limit_mb if is_running() and cuda_worker_count() else 0


def _default_workers() -> int:
    # StarPU drives each GPU from a CPU core of its own; ranks on one machine share its cores.
    cores = ((os.cpu_count() or 1) - gpu_count()) // local_ranks()
    return max(1, min(cores, MAX_CPU_WORKERS))


def setting(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, flag: str | None = None,
            choices=None):
    """A RuntimeConfig field; with `flag` (its help text) also the command-line flag --<field name> of every command
    (`choices`: the values the flag accepts)."""
    metadata = {"flag": flag, "choices": choices} if flag else {}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclasses.dataclass
class RuntimeConfig:
    """How StarPU runs. Every default is stated; the GPU ones matter only with `make cuda` and a GPU."""

    # A setting with `flag(...)` is also a flag of every command (jnntile.flags.add_runtime_flags), whose help
    # is written here, beside its default.
    workers: int = setting(default_factory=_default_workers,  # CPU workers
                           flag=f"StarPU CPU workers (default: every core less one per GPU, at most {MAX_CPU_WORKERS} "
                                "with this StarPU)")
    cuda_workers: int = setting(-1 if HAS_CUDA else 0,  # -1: one per GPU found; 0: none
                                flag="GPUs to use (default: all; 0: CPU only)")
    scheduler: str = "auto"  # a StarPU scheduler, or "auto": see resolved_scheduler
    memory_limit_mb: int = setting(default_factory=_default_memory_limit_mb,
                                   flag="RAM for tiles; beyond it tiles go to --swap-dir (default: half of the RAM "
                                        "available)")
    gpu_memory_limit_mb: int = setting(0,  # per GPU; 0: StarPU's default (nearly all of it); beyond it tiles go to RAM
                                       flag="GPU memory for tiles, per GPU; beyond it tiles go to RAM (default: the "
                                            "free memory of the GPU with the least of it, less 5%%)")
    swap_dir: str | None = setting(None,  # where tiles go when RAM is over the limit; None: no swap
                                   flag="directory for tiles evicted from RAM (created if missing; a private "
                                        "subdirectory is made in it and removed at exit)")
    swap_size_mb: int = setting(16384, flag="disk swap size with --swap-dir (default: 16384); its file system must "
                                            "have that much free")
    # Direct I/O by default, so that a run under memory_limit_mb uses about that much RAM. Through the
    # page cache (bench/memory.py, 51M-parameter GPT-2 under a 256 MB limit on a machine with RAM to
    # spare) steps ran 1.6-1.7x faster, but the cache held 1.3 GB of swap: 1.8 GB of RAM in use against
    # 0.6 GB, more than the same run without a limit (1.6 GB). Choose "unistd" where RAM is to spare.
    swap_backend: str = setting("unistd_o_direct", choices=sorted(SWAP_BACKENDS),
                                flag="how tiles go to --swap-dir: unistd_o_direct bypasses the page cache, unistd goes "
                                     "through it (default: unistd_o_direct)")
    watchdog_s: float = 120.0  # a wait with no task completing for this long is an error
    # Where tasks of kernels that have a CPU and a CUDA version run: "any", wherever the scheduler chooses;
    # "cpu" or "cuda", only there (tests compare one with the other); "auto", "cuda" when there is a GPU
    # and gpu_memory_limit_mb is 0, else "any". Measured on an H100 (bench/gpu.py --placement): GPT-2
    # 124M bfloat16 steps took 0.19 s on the GPU alone against 0.27 s with CPU workers choosing too (and
    # 5 s while the scheduler calibrated), but with the GPU limited to a quarter of the step's memory
    # 1.5 s against 0.67 s, CPU workers computing on the tiles spilled to RAM.
    placement: str = "auto"
    # float32 matrix products on the GPU: "highest" (FP32) or "tf32" (tensor
    # cores); "default" is JAX's default on GPUs jnntile builds for (sm_80 and
    # newer): tf32. CPU kernels always compute in FP32.
    matmul_precision: str = setting("default", choices=MATMUL_PRECISIONS,
                                    flag="float32 products on the GPU: highest (FP32) or tf32 (default: tf32 on a GPU, "
                                         "as JAX)")
    # bfloat16 attention with head_dim 64 on the GPU in fused kernels (scores in registers, tensor cores)
    # instead of cuBLAS products through float32 score blocks in memory. On an H200, GPT-2 124M 8 x 1024: 66
    # ms per step against 92 with cuBLAS (attention 11 ms against 38).
    fused_attention: bool = setting(True, flag="bfloat16 attention (head_dim 64) on the GPU in fused kernels, or in "
                                               "cuBLAS products through float32 score blocks (default: fused)")
    pin_host_memory: bool = True  # page-lock RAM tiles when a GPU is used: asynchronous copies
    perf_model_dir: str | None = None  # StarPU's performance models; None: under STARPU_HOME
    # One of several processes (MPI ranks, e.g. under mpirun) training one model; see docs/distributed.md.
    distributed: bool = False
    allreduce: str = "tree"  # how gradient tiles are summed across ranks: "tree" or "ring"
    # With distributed: each tile of the training state has one owner rank (jnntile.distributed.sharded_state).
    shard_state: bool = False
    # With shard_state: a rank keeps the parameter tiles it fetched until their owner writes them (the next
    # update), so a step fetches each once instead of once per op that reads it (the forward, the backward, a
    # recomputation, each micro-batch): the bytes of data parallel, at the memory of every parameter read, frozen
    # ones too, on every rank. `train --shard-state` keeps them when the memory plan says they fit.
    shard_keep_fetched: bool = False

    def validate(self) -> None:
        if not 1 <= self.workers <= MAX_CPU_WORKERS:
            raise ValueError(
                f"workers={self.workers}: the StarPU in use allows 1 to {MAX_CPU_WORKERS} CPU workers")
        if self.cuda_workers < -1:
            raise ValueError(f"cuda_workers={self.cuda_workers} must be -1 (every GPU), 0 or a count")
        if (self.cuda_workers > 0 or self.placement == "cuda") and not HAS_CUDA:
            raise ValueError("CUDA workers were asked for, but this jnntile is built against a StarPU without "
                             "CUDA (Debian's StarPU has none): build it with `make cuda` and use .venv-cuda")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r} is not a StarPU scheduler; use one of {SCHEDULERS}")
        if self.memory_limit_mb <= 0:
            raise ValueError(f"memory_limit_mb={self.memory_limit_mb} must be positive")
        if self.gpu_memory_limit_mb < 0:
            raise ValueError(f"gpu_memory_limit_mb={self.gpu_memory_limit_mb} must be 0 (no limit) or positive")
        if self.swap_dir is not None and self.swap_size_mb < MIN_SWAP_MB:
            raise ValueError(f"swap_size_mb={self.swap_size_mb} must be at least {MIN_SWAP_MB} when swap_dir is set "
                             "(StarPU's smallest disk)")
        if self.swap_backend not in SWAP_BACKENDS:
            raise ValueError(f"swap_backend={self.swap_backend!r}: use one of {sorted(SWAP_BACKENDS)}")
        if self.watchdog_s <= 0:
            raise ValueError(f"watchdog_s={self.watchdog_s} must be positive")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r}: use one of {sorted(PLACEMENTS)}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision={self.matmul_precision!r}: use one of {MATMUL_PRECISIONS}")
        if self.distributed and not HAS_MPI:
            raise ValueError(f"distributed=True: {_xla_ffi.mpi_unavailable_reason()}")
        if self.shard_keep_fetched and not self.shard_state:
            raise ValueError("shard_keep_fetched=True keeps the parameter tiles a rank fetched with sharded state: "
                             "start the runtime with shard_state=True (and distributed=True) too")
        if self.shard_state and not self.distributed:
            raise ValueError("shard_state=True shards the training state across the ranks of a distributed run: "
                             "start the runtime with distributed=True too (under mpirun)")
        if self.allreduce not in ALLREDUCE_SCHEDULES:
            raise ValueError(f"allreduce={self.allreduce!r}: use one of {sorted(ALLREDUCE_SCHEDULES)}")

    @property
    def tf32(self) -> bool:
        """Whether cuBLAS may use TF32 for float32 products (matmul_precision resolved)."""
        return self.matmul_precision == "tf32" or (self.matmul_precision == "default" and gpu_count() > 0)


_config = RuntimeConfig()
_started = False
_started_gpu_limit_mb = 0  # the GPU memory limit StarPU started with

# What modules above the runtime do at its transitions: jnntile.tensor forgets every tile id at stop and
# frees the tiles of unreachable tensors at safe points (stats, wait_all); jnntile.distributed checks
# that every rank agrees on its settings at start. The runtime itself knows nothing of tensors or ranks.
_after_start: list = []
_before_stop: list = []
_at_safe_point: list = []


def after_start(hook) -> None:
    """Runs `hook()` each time the runtime has started."""
    _after_start.append(hook)


def before_stop(hook) -> None:
    """Runs `hook()` each time before the runtime stops (every tile id becomes invalid)."""
    _before_stop.append(hook)


def at_safe_point(hook) -> None:
    """Runs `hook()` where waiting for tasks is safe: before `wait_all` and `stats`."""
    _at_safe_point.append(hook)


def _register_ffi_targets() -> None:
    for name, capsule in _xla_ffi.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")


_register_ffi_targets()


# The native runtime's swap subdirectories: jnntile-swap-<pid>-XXXXXX (xla_ffi/swap.cc).
_SWAP_SUBDIR = re.compile(r"jnntile-swap-(\d+)-\w{6}")


def _remove_dead_swap_dirs(path: Path) -> None:
    """Removes the swap subdirectories in `path` of jnntile processes that no longer run (killed, or ended
    without stopping the runtime), whose files would count against the free space the next run needs."""
    for child in path.iterdir():
        match = _SWAP_SUBDIR.fullmatch(child.name)
        if match is None or not child.is_dir() or int(match[1]) == os.getpid():
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(child, ignore_errors=True)
        except PermissionError:  # another user's process lives
            pass


def _prepare_swap_dir(config: RuntimeConfig) -> None:
    """Creates the swap directory, removes the swap left by dead runs and checks that the file system can
    hold `swap_size_mb`, which the native runtime then reserves (so another process cannot take it)."""
    if not config.swap_dir:
        return
    path = Path(config.swap_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"swap directory {path} cannot be created ({e.strerror}); choose another "
                         "--swap-dir (swap_dir)") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"swap directory {path} is not writable; choose another --swap-dir (swap_dir)")
    _remove_dead_swap_dirs(path)
    free_mb = shutil.disk_usage(path).free // 2**20
    if free_mb < config.swap_size_mb:
        smaller = (f"give --swap-size-mb (swap_size_mb) at most {free_mb} (python -m jnntile.memory says how much "
                   "the step needs), " if free_mb >= MIN_SWAP_MB else "")
        raise ValueError(
            f"swap directory {path} has {free_mb} MB free, less than the swap size of {config.swap_size_mb} MB: "
            f"{smaller}free space there, or choose another --swap-dir (swap_dir)")


class SwapFailure(RuntimeError):
    """Disk swap could not take a tile (its disk filled): the tasks in flight will not complete."""


def swap_failure() -> str | None:
    """Why disk swap could not take a tile since the runtime started (the runtime is then failed), or None."""
    return _xla_ffi.swap_failure() or None


def raise_if_swap_failed(error: BaseException, consequence: str = "") -> None:
    """Raises SwapFailure, with `consequence` after the reason, when `error` (a failed wait, which JAX may
    carry as its own RuntimeError) came from a tile the disk swap could not take."""
    if swap_failure() is not None:
        raise SwapFailure(f"{swap_failure()}{f'. {consequence}' if consequence else ''}") from error


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
    global _started, _started_gpu_limit_mb
    if settings:
        configure(**settings)
    if is_running():
        return
    _config.validate()
    _prepare_swap_dir(_config)
    # Bus calibration and performance models go here instead of ~/.starpu; StarPU reads it at init.
    os.environ.setdefault("STARPU_HOME", str(Path.home() / ".cache" / "jnntile" / "starpu"))
    if _config.perf_model_dir:
        os.environ["STARPU_PERF_MODEL_DIR"] = _config.perf_model_dir
    if _config.distributed:
        _mpi_world()
        if local_ranks() > 1:
            # StarPU binds worker i of every process to core i, and its MPI thread to the next core:
            # ranks sharing a machine would all crowd onto its first cores.
            os.environ.setdefault("STARPU_WORKERS_NOBIND", "1")
            os.environ.setdefault("STARPU_MPI_NOBIND", "1")
    # StarPU would count on the GPU's whole memory; take what is free (another
    # library in this process, XLA for one, may hold some).
    gpu_limit_mb = gpu_memory_mb(_config)
    _xla_ffi.runtime_start(_native(_config, gpu_limit_mb))
    _started = True
    _started_gpu_limit_mb = gpu_limit_mb
    for hook in _after_start:
        hook()


def resolved_scheduler(config: RuntimeConfig) -> str:
    """config.scheduler with "auto" resolved. With a GPU, dmdas: a model-based scheduler, it learns which worker
    runs a kernel fastest and moved 2.6x fewer bytes than lws when GPU memory was short. On CPUs with disk swap,
    eager: its one queue runs tasks in the order they were submitted, the order the memory planner replays, and
    lws's per-worker queues ran a worker ahead along one row of tiles while the weights it left behind went to
    swap and came back (GPT-2 medium's shape at 4 x 1024, tiles split on embd, heads and hidden, 600 MB + swap:
    8554 MB read per step under lws, 6703 under eager, 6145 planned; 47.3 -> 44.8 s per step). Only with Debian's
    StarPU 1.3, where that was measured: the CUDA build's StarPU 1.4 run without a GPU under eager with swap
    aborted at unregistration ("!local->nb_tasks_prefetch", tests/test_grad_accumulation.py's 1 MB limit; a
    StarPU defect since patched, tools/starpu-patches), so it keeps lws there (not measured under eager since).
    On CPUs in RAM, lws, the lowest per-task overhead of the work-stealing ones."""
    if config.scheduler != "auto":
        return config.scheduler
    if config.cuda_workers != 0 and gpu_count() > 0:
        return "dmdas"
    return "eager" if config.swap_dir and not HAS_CUDA else "lws"


def resolved_placement(config: RuntimeConfig) -> str:
    """config.placement with "auto" resolved: "cuda" when a CUDA worker will run and the user set no GPU
    memory limit (gpu_memory_limit_mb 0), else "any". The native runtime sees the resolved GPU limit, never
    0 with a GPU, so the choice is made here (until this was found on an H100, "auto" ran as "any")."""
    if config.placement != "auto":
        return config.placement
    return "cuda" if gpu_memory_mb(config) > 0 and config.gpu_memory_limit_mb == 0 else "any"


def cpu_kernels_beside_gpu(config: RuntimeConfig) -> bool:
    """Whether CPU workers also run the kernels that have a CUDA version (placement "any"), so that the step's
    tasks hold RAM beside the GPU's (the planner counts them: `MemoryPlan.verdict`)."""
    return resolved_placement(config) == "any"


def _native(config: RuntimeConfig, gpu_limit_mb: int):
    """The whole configuration as the native runtime takes it (every field set: the defaults live here only),
    with what Python resolves: the GPU memory limit, TF32, and no swap size without a swap directory."""
    native = _xla_ffi.RuntimeConfig()
    for name in ("workers", "cuda_workers", "memory_limit_mb", "watchdog_s", "pin_host_memory", "distributed",
                 "fused_attention", "shard_keep_fetched"):
        setattr(native, name, getattr(config, name))
    native.scheduler = resolved_scheduler(config)
    native.gpu_memory_limit_mb = gpu_limit_mb
    native.swap_dir = config.swap_dir or ""
    native.swap_size_mb = config.swap_size_mb if config.swap_dir else 0
    native.swap_backend = _xla_ffi.SwapBackend[config.swap_backend]
    native.placement = _xla_ffi.Placement[resolved_placement(config)]
    native.tf32 = config.tf32
    return native


def ensure_started() -> None:
    if not is_running():
        start()


def is_running() -> bool:
    return _xla_ffi.runtime_running()


def stop() -> None:
    """Waits for pending tasks, frees every tensor and stops StarPU."""
    if not is_running():
        return
    for hook in _before_stop:
        hook()
    _xla_ffi.runtime_stop()


def _mpi_world() -> tuple[int, int]:
    """(rank, size), starting MPI on first use."""
    # Open MPI polls for messages without yielding the core unless told to, and StarPU-MPI's thread polls
    # while any transfer is in flight: 0.2 cores per rank of 2 on 2 cores (bench/multinode.py), 0.03 when
    # yielding, the workers getting the rest. Read by MPI_Init.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return _xla_ffi.mpi_world()


def rank() -> int:
    """This process's rank among the processes training one model (0 unless configured distributed).

    With distributed=True this starts MPI (not StarPU), so it is known before the runtime starts.
    """
    return _mpi_world()[0] if _config.distributed else 0


def world_size() -> int:
    """How many processes train one model (1 unless configured distributed; see `rank`)."""
    return _mpi_world()[1] if _config.distributed else 1


def abort(code: int) -> None:
    """Ends every rank of a distributed run at once (MPI_Abort), e.g. after an error only this rank saw."""
    _xla_ffi.mpi_abort(code)


def wait_all() -> None:
    """Blocks until every submitted task has completed (with the watchdog)."""
    if is_running():
        for hook in _at_safe_point:
            hook()
        _xla_ffi.wait_all()


def cuda_worker_count() -> int:
    """CUDA workers of the running runtime (0 when stopped, without CUDA or without a GPU)."""
    return _xla_ffi.cuda_worker_count()


def describe() -> str:
    """One line on the hardware in use, e.g. for the start of a training run."""
    ensure_started()
    cuda = cuda_worker_count()
    gpus = ""
    if cuda:
        names = sorted({w["name"] for w in stats()["workers"] if w["name"].startswith("CUDA")})
        precision = "tf32" if _config.tf32 else "highest (FP32)"
        attention = "fused" if _config.fused_attention else "cuBLAS"
        gpus = (f"{cuda} CUDA worker(s) ({'; '.join(names)}), matmul precision {precision}, {attention} bfloat16 "
                f"attention, kernels with a CUDA version on {PLACEMENT_WORDS[resolved_placement(_config)]}, ")
    elif HAS_CUDA:
        gpus = "no GPU found (StarPU has CUDA), "
    swap = (f", swap {_config.swap_size_mb} MB in {_config.swap_dir} ({_config.swap_backend})"
            if _config.swap_dir else "")
    ranks = (f", rank {rank()} of {world_size()} (StarPU-MPI, gradients summed by a {_config.allreduce})"
             if _config.distributed else "")
    # Under GPU, RAM and disk limits StarPU prefetches nothing (runtime.cc: its prefetches stalled there).
    prefetch = ", no prefetching (GPU with disk swap)" if cuda and _config.swap_dir and not _xla_ffi.prefetch() else ""
    gpu_limit = f", GPU memory limit {_started_gpu_limit_mb} MB{' per GPU' if cuda > 1 else ''}" if cuda else ""
    return (f"{gpus}{_config.workers} CPU workers, scheduler {resolved_scheduler(_config)}, memory limit "
            f"{_config.memory_limit_mb} MB{gpu_limit}{swap}{prefetch}{ranks}")


def blas_core() -> str:
    """The CPU BLAS in use: "oneMKL", or the OpenBLAS kernel family (see jnntile/core/_blas.py)."""
    return _xla_ffi.blas_core()


def stats() -> dict:
    """Tasks run, busy time per worker, bytes moved between memory nodes, memory per node.

    `codelets` maps each kernel's name to its task count and busy seconds (`tasks`,
    `seconds`; `cuda_tasks`, `cuda_seconds` of those on CUDA workers), and
    `median_task_s` is the median task duration (both since start). `nodes` lists each memory node (RAM, and DISK when swapping) with
    `used_bytes`, `total_bytes` and `peak_used_bytes` (the most used at any task
    completion since start or `reset_peaks`). `bytes_moved` maps "src->dst"
    (e.g. "RAM->DISK", bytes written to swap) to bytes, cumulative since start;
    call `wait_all()` first to count the transfers of tasks still running.
    `mpi_bytes_sent` counts the tile bytes this rank sent to other ranks since start.
    """
    for hook in _at_safe_point:  # the tensor count then counts live tensors
        hook()
    stats = _xla_ffi.runtime_stats()
    stats["mpi_bytes_sent"] = _xla_ffi.mpi_bytes_sent()
    return stats


def swap_bytes() -> tuple[int, int]:
    """(bytes written to disk swap, bytes read from it) since start, from `stats()["bytes_moved"]`."""
    moved = stats()["bytes_moved"]
    return moved.get("RAM->DISK", 0), moved.get("DISK->RAM", 0)


def swap_peak_used_bytes() -> int:
    """The most bytes of tiles disk swap has held at once since start (0 without swap)."""
    return sum(node["peak_used_bytes"] for node in stats()["nodes"] if node["kind"] == "DISK")


def reset_peaks() -> None:
    """Starts the peak memory use of every node (stats()["nodes"][i]["peak_used_bytes"]) over."""
    if is_running():
        _xla_ffi.reset_peaks()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Makes SIGTERM end the process through Python's own exit (status 143), so that the exit handler stops
    StarPU and removes the swap files; by default SIGTERM ends the process at once and leaves them behind."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _at_exit() -> None:
    stop()
    _xla_ffi.mpi_finalize()  # after StarPU-MPI stopped; a no-op without MPI


atexit.register(_at_exit)
