"""The process side of a run: the Accelerator every command builds, CPU memory settings, and stop signals.

`make_accelerator` forms one process group of the size the launch asked for, on whatever devices the
launch gave (the Accelerate config decides; nothing here names a rank or a device).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import GradientAccumulationPlugin

from accel_gpt.workarounds import check_group, cpu_only


def make_accelerator(accumulation: Callable[[int], int] | None = None, **kwargs: Any) -> Accelerator:
    """An Accelerator on the launch's devices; `accumulation(world_size)` gives the micro-steps per optimizer step.

    Raises if the group is smaller than WORLD_SIZE. The training stream is endless, so gradients sync on
    the accumulation count alone, never at "the end of the dataloader".
    """
    cpu = cpu_only()
    if cpu:
        keep_freed_memory()
    state = PartialState(cpu=cpu)
    check_group(state)
    steps = accumulation(state.num_processes) if accumulation else 1
    plugin = GradientAccumulationPlugin(num_steps=steps, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_plugin=plugin, **kwargs)
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (TF32)
        torch.backends.cudnn.allow_tf32 = True
    return accelerator


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


class StopSignal:
    """SIGTERM/SIGINT ask the run to finish its current step, save and exit 0; a second SIGINT aborts at once.

    A signal may reach the ranks at different steps (or only some of them), so `requested()` makes every
    rank agree after each step: a one-number all-reduce over a CPU (gloo) group, which adds no device sync.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.flag = False
        self.speak = accelerator.is_main_process
        self.group: Any = None
        self.world = accelerator.num_processes
        if self.world > 1:
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.flag and signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the second Ctrl-C: stop now, no save
            return
        self.flag = True
        if self.speak:
            name = signal.Signals(signum).name
            sys.stderr.write(f"\n{name}: finishing the current step, then saving and exiting (Ctrl-C again: abort)\n")

    def requested(self) -> bool:
        """Whether any rank was signalled; the same answer on every rank."""
        if self.world == 1:
            return self.flag
        flag = torch.tensor([int(self.flag)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
