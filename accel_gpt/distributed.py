"""Building the Accelerator so that W launched processes always form one W-process group.

On a machine without an accelerator device, accelerate 1.15 gives each of W launched processes its own
1-process state unless it is told to use the CPU (FACTS.md): W copies would then train independently
and overwrite each other's files. `make_accelerator` picks CPU/gloo there and refuses any group that
does not match the launch.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
from accelerate import Accelerator

from accel_gpt.errors import UserError


def has_accelerator_device() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or (mps is not None and mps.is_available())
    )


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed large buffers for reuse instead of returning them to the OS.

    By default glibc serves every allocation over its mmap threshold (at most 32 MB) with a fresh mmap and
    unmaps it on free, so each training step on CPU page-faults its ~100 MB logits buffers in again. With
    mmap off and a high trim threshold, the tiny-cpu preset ran 100 steps in 40 s instead of 174 s (same
    losses, +31% peak memory). Returns False where the C library is not glibc, or where the user already set
    glibc's malloc tunables in the environment (theirs win).
    """
    if any(k in os.environ for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def make_accelerator(**kwargs: Any) -> Accelerator:
    """An Accelerator on the devices the launch gave us; raises if the group is smaller than WORLD_SIZE."""
    cpu = not has_accelerator_device()
    if cpu:
        keep_freed_memory()
    accelerator = Accelerator(cpu=cpu, **kwargs)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise UserError(
            f"launched {launched} processes (WORLD_SIZE) but the Accelerator formed a group of "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); check the accelerate config"
        )
    return accelerator
