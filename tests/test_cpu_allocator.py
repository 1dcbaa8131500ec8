"""glibc's malloc thresholds raised for an engine on the CPU (``roseinfer.cpu_allocator``)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

_MALLOC_PROBE = """
import ctypes, sys
from roseinfer.cpu_allocator import keep_freed_memory
print(keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(20 << 20)
# glibc marks an mmapped chunk in its size field (bit 1); a chunk of the heap has it clear.
print(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2 == 2)
libc.free(block)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_malloc_thresholds_keep_large_blocks_on_the_heap_unless_turned_off():
    # Each in a fresh process: a process's own frees move glibc's dynamic threshold.
    def probe(tuning: str) -> list[str]:
        env = {**os.environ, "ROSEINFER_MALLOC_TUNING": tuning}
        out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], env=env, capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert probe("0") == ["False", "True"]  # glibc's default: a 20 MB block is mapped afresh, and unmapped on free
    assert probe("1") == ["True", "False"]  # raised: it comes from the heap, and its pages stay for the next step


# Counted in 4 KiB pages: transparent huge pages are turned off for the probe (a host set to "always" faults an 8 MB
# mapping in with a few huge pages).
_CUSHION_PROBE = """
import ctypes, resource, sys
libc = ctypes.CDLL(None)
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
from roseinfer.cpu_allocator import reserve_heap
print(reserve_heap(int(sys.argv[1])))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(8 << 20)
ctypes.memset(block, 1, 8 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_the_heap_cushion_is_faulted_in_once_so_a_larger_step_later_takes_no_page_faults():
    def probe(nbytes: int, tuning: str = "1") -> tuple[str, int]:
        env = {**os.environ, "ROSEINFER_MALLOC_TUNING": tuning}
        out = subprocess.run(
            [sys.executable, "-c", _CUSHION_PROBE, str(nbytes)], env=env, capture_output=True, text=True, check=True
        )
        done, faults = out.stdout.split()
        return done, int(faults)

    done, faults = probe(32 << 20)
    assert done == "True" and faults < 256  # 8 MB of the cushion's pages, already in: (almost) no faults
    done, faults = probe(0)  # no cushion (nor raised thresholds): a fresh mapping, each of its 2,048 pages faulting in
    assert done == "False" and faults >= 2000
    assert probe(32 << 20, tuning="0")[0] == "False"  # thresholds left alone: a cushion would be trimmed at once
