"""glibc's malloc kept from returning large freed buffers to the OS on a CPU. Standard library only, so that a
command that needs no process group (`sample`) sets it without importing Accelerate."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed large buffers for reuse instead of returning them to the OS.

    By default glibc serves every allocation over its mmap threshold (at most 32 MB) with a fresh mmap and
    unmaps it on free, so each training step on CPU page-faults its ~100 MB logits buffers in again. With
    mmap off and a high trim threshold, the tiny-cpu preset ran 100 steps in 40 s instead of 174 s (same
    losses, +31% peak memory). Returns False where the C library is not glibc, or where the user already set
    glibc's malloc tunables in the environment (theirs win).
    """
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, where the C library is glibc and the user set none of its malloc tunables (theirs win)."""
    if any(k in os.environ for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return None
    try:
        return ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


def keeps_freed_memory() -> bool:
    """Whether a CPU run here keeps freed buffers (`keep_freed_memory` takes effect): what the memory estimate
    counts the kept buffers for."""
    return _glibc_mallopt() is not None
