"""The machine a figure or a timed choice was made on: the CPU's model name and the vector extensions
that change CPU timings (bfloat16 and int8 kernels)."""

from __future__ import annotations

import platform
from pathlib import Path

CPU_INFO = "/proc/cpuinfo"
# The extensions whose presence changes which form or precision runs fastest.
TIMING_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpu_info_line(prefix: str) -> str | None:
    try:
        for line in Path(CPU_INFO).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it ("AMD EPYC", "Intel(R) Xeon(R) ...")."""
    return _cpu_info_line("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The CPU's vendor as the kernel reports it ("AuthenticAMD", "GenuineIntel"): MKL picks its kernels by it."""
    return _cpu_info_line("vendor_id") or platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """Which of ``TIMING_FEATURES`` this CPU has."""
    flags = set((_cpu_info_line("flags") or "").split())
    return [flag for flag in TIMING_FEATURES if flag in flags]


def cpu_description() -> str:
    """"AMD EPYC (avx2, avx512f, ...)": the model and its timing features, as a record names a CPU."""
    features = cpu_features()
    return f"{cpu_model()} ({', '.join(features)})" if features else cpu_model()
