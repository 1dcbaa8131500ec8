"""glibc malloc settings for a process that runs the engine on the CPU.

PyTorch's CPU tensors come straight from malloc, and a step allocates and frees tensors of megabytes (a prefill's
activations, a decode step's logits: 64 x 49,152 floats are 12.6 MB). glibc hands a block above its mmap threshold
back to the system when it is freed, and trims the top of its heap once more than its trim threshold lies free
there, so the next step faults every page of it in again: a fresh worker's first prefill of 64 chat prompts took
1.1 s against 0.56 s once the same process had run one (2-core AMD EPYC, float32). vLLM's CPU guide preloads
TCMalloc for the same reason; raising glibc's two thresholds once is enough here and needs nothing installed. A
cushion of pages faulted in at the heap's top once the engine is built (``reserve_heap``) covers the heap a first
large burst adds.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

from roseinfer.config import env_switch

log = logging.getLogger("roseinfer")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit: blocks up to 32 MB come from the heap
# Freed memory kept at the heap's top for the next step, at most: a step's working set is well under it, and a
# huge prompt's activations above it still go back to the system.
TRIM_THRESHOLD = 256 << 20
# Touched pages left free at the heap's top once the engine is built (``reserve_heap``): a tiny model's first burst
# after its warm-up grew the heap by 8 MB and faulted it in (its first step 22 ms against 7 ms); 64 MB held it all.
HEAP_CUSHION = 64 << 20
_CHUNK = 8 << 20  # under the mmap threshold: each piece comes from the heap


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once; whether they were set). Off with
    ``ROSEINFER_MALLOC_TUNING=0``, and where the C library is not glibc."""
    if not env_switch("ROSEINFER_MALLOC_TUNING", True) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("could not raise glibc's malloc thresholds: large CPU tensors are mapped afresh each step")
    return done


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``, which frees whole free pages inside
    the heap too, not only at its top): once, after a load that let go of a large part of it (int8 weights in
    place of float ones). Whether it ran."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


@functools.cache
def reserve_heap(nbytes: int = HEAP_CUSHION) -> bool:
    """Grow the heap by ``nbytes`` of pages faulted in now, then free them: under the trim threshold they stay at
    the heap's top, so a step that needs more heap than any before it (a fresh worker's first burst, once its
    fragments of long-lived objects leave no hole big enough) takes pages already in, not faults. Once a process,
    after the weights are loaded (they would take the cushion); whether it was done (glibc, thresholds raised)."""
    if nbytes <= 0 or nbytes >= TRIM_THRESHOLD or not keep_freed_memory():
        return False
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(_CHUNK) for _ in range(-(-nbytes // _CHUNK))]
    for block in blocks:
        if block:
            ctypes.memset(block, 0, _CHUNK)
    for block in reversed(blocks):  # the top one first: they merge into one free top chunk
        libc.free(block)
    return all(blocks)
