"""Pick OpenBLAS's kernels before the native module loads it.

Debian 12's OpenBLAS 0.3.21 does not recognise newer CPUs under virtualisation
and falls back to its Prescott (SSE3) kernels, 4-8x slower than what the CPU
can do (measured: 20 vs 130 GFLOP/s per core on a Sapphire Rapids VM). When
OPENBLAS_CORETYPE is not set we choose a core type from the CPU flags; a value
set by the user or the machine is always kept (some machines set it on purpose).
"""

import os


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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
