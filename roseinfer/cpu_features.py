"""The CPU's instruction sets that matter to the math (read once from /proc/cpuinfo), for bench headers and for
choosing kernels: AVX2, AVX-512, AVX-512 BF16 / VNNI, AMX (bfloat16 and int8 tiles)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# What a bench header names, in the order it names them.
NAMED = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


@functools.cache
def flags() -> frozenset[str]:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


@functools.cache
def model_name() -> str:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def describe() -> str:
    """``AMD EPYC (avx2 fma)``: the CPU's name and the instruction sets of ``NAMED`` it has."""
    have = [f for f in NAMED if f in flags()]
    return f"{model_name()} ({' '.join(have) or 'none of ' + ', '.join(NAMED)})"
