"""Pick the CPU's BLAS before the native module loads it.

On an Intel CPU where the `mkl` package is installed in this Python's environment (`make build` installs
it there), matrix products use oneMKL (xla_ffi/kernels/cpu/gemm.cc loads the library JNNTILE_MKL
names): its sgemm, and its bfloat16 product on AMX / AVX512-BF16, which needs no widening to float32. MKL
runs sequential (each StarPU worker is one thread) and in its strict reproducible mode, so results are
bitwise the same from run to run. Other CPUs keep OpenBLAS: on an AMD EPYC (AVX2) MKL's sgemm took 31%
longer than OpenBLAS's Haswell kernels over GPT-2 124M's products (10.6 against 8.1 s of a training step's
gemm tasks, `bench/train_step.py --profile`). Setting JNNTILE_MKL to a library path uses it on any CPU; an
empty string keeps OpenBLAS.

Debian 12's OpenBLAS 0.3.21 does not recognise newer CPUs under virtualisation
and falls back to its Prescott (SSE3) kernels, 4-8x slower than what the CPU
can do (measured: 20 vs 130 GFLOP/s per core on a Sapphire Rapids VM). When
OPENBLAS_CORETYPE is not set we choose a core type from the CPU flags; a value
set by the user or the machine is always kept (some machines set it on purpose).
"""

import os
import sys
from pathlib import Path


def _cpuinfo(field: str) -> str:
    """The value of `field` for the first CPU in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def choose_core_type(flags: set[str]) -> str | None:
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        return "Cooperlake"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def configure_openblas() -> None:
    if "OPENBLAS_CORETYPE" in os.environ:
        return
    core_type = choose_core_type(_cpu_flags())
    if core_type is not None:
        os.environ["OPENBLAS_CORETYPE"] = core_type


def mkl_library() -> str | None:
    """The oneMKL runtime library of this environment's `mkl` package, if it is installed."""
    found = sorted(Path(sys.prefix, "lib").glob("libmkl_rt.so*"))
    return str(found[-1]) if found else None


def configure_mkl() -> None:
    if "JNNTILE_MKL" not in os.environ:
        library = mkl_library() if _cpuinfo("vendor_id") == "GenuineIntel" else None
        if library is None:
            return
        os.environ["JNNTILE_MKL"] = library
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
