"""Building the Accelerator so that W launched processes always form one W-process group.

On a machine without an accelerator device, accelerate 1.15 gives each of W launched processes its own
1-process state unless it is told to use the CPU (FACTS.md): W copies would then train independently
and overwrite each other's files. `make_accelerator` picks CPU/gloo there and refuses any group that
does not match the launch.
"""

from __future__ import annotations

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


def make_accelerator(**kwargs: Any) -> Accelerator:
    """An Accelerator on the devices the launch gave us; raises if the group is smaller than WORLD_SIZE."""
    accelerator = Accelerator(cpu=not has_accelerator_device(), **kwargs)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise UserError(
            f"launched {launched} processes (WORLD_SIZE) but the Accelerator formed a group of "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); check the accelerate config"
        )
    return accelerator
