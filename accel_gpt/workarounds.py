"""The places where accel_gpt steps around Accelerate (1.15) instead of using it as designed, all here.

Each is small and says why, and where upstream the behaviour comes from, so that it can be dropped
when Accelerate changes:

- `cpu_only` + `check_group`: on a machine without GPUs, W processes launched with `--multi_gpu`
  each get a 1-process state unless the Accelerator is told `cpu=True` (accelerate/state.py,
  `PartialState.__init__` picks the gloo backend only for CPU states); they would train W
  independent copies and overwrite each other's files. And on such a machine `accelerate launch
  --num_processes N` without `--multi_gpu`, or the multi-CPU config of the `accelerate config` wizard
  without mpirun, starts ONE process (accelerate/commands/launch.py, `launch_command` falls through to
  `simple_launcher`), which would train alone while N were asked for.
- `reset_micro_step`: `load_state` restores the saving run's micro-step counter
  (accelerate/accelerator.py, `Accelerator.load_state`: `self.step = override_attributes["step"]`),
  which under another accumulation puts gradient syncs off the optimizer-step boundaries.
- `check_pickles_are_safe`: `load_state` unpickles registered objects with `weights_only=False`
  (accelerate/checkpointing.py, `load_custom_state`), which runs any code a crafted file names.
- `drop_tied_head`: `save_state` drops the alias of a tied weight itself but warns at every save
  (accelerate/utils/other.py, `clean_state_dict_for_safetensors`: "Removed shared tensor ...").
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState

from accel_gpt.errors import UserError

PICKLE_SUFFIXES = (".bin", ".pkl", ".pt")
_HEAD, _WTE = "lm_head.weight", "transformer.wte.weight"


def cpu_only() -> bool:
    """No CUDA, XPU or MPS device here: the Accelerator must be built with `cpu=True` to form a gloo group."""
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return not (
        torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or (mps is not None and mps.is_available())
    )


def check_group(state: PartialState) -> None:
    """Refuse a group smaller than the launch: W copies training side by side look like success."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != launched:
        raise UserError(
            f"launched {launched} processes (WORLD_SIZE) but the Accelerator formed a group of "
            f"{state.num_processes} ({state.distributed_type}); check the accelerate config"
        )
    if started_one_of_several():
        raise UserError(
            "accelerate launch asked for several processes but started one (on a machine without GPUs, "
            "--num_processes N without --multi_gpu, or a multi-CPU config without mpirun, runs a single process); "
            "launch with --config_file accelerate_configs/cpu_2proc.yaml (or --multi_gpu --num_processes N) instead "
            "(if one process was meant, unset MASTER_PORT)"
        )


# Set by the process launchers that start several processes (torchrun; MPI's mpirun in its three dialects).
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def started_one_of_several() -> bool:
    """`accelerate launch`'s one-process launcher, told to start several: it sets MASTER_ADDR/MASTER_PORT only
    when asked for more than one process (accelerate/utils/launch.py, `prepare_simple_launcher_cmd_env`), but
    no launcher that really starts several processes is in between to set a world size. ACCELERATE_DYNAMO_BACKEND
    shows that `accelerate launch` started this process; a MASTER_PORT the user exported for a one-process launch
    looks the same, so the message says what to do in that case too."""
    launched_by_accelerate = "ACCELERATE_DYNAMO_BACKEND" in os.environ
    asked_for_several = "MASTER_PORT" in os.environ
    return launched_by_accelerate and asked_for_several and not any(v in os.environ for v in _WORLD_SIZE_VARIABLES)


def reset_micro_step(accelerator: Accelerator) -> None:
    """After `load_state`: a checkpoint sits on an optimizer-step boundary, so the micro-step count starts at 0.

    Saved by W=2 (accumulation 1) at step 3 and resumed by W=1 (accumulation 2), the restored count 3 would
    sync after one micro-step and then skip every update.
    """
    accelerator.step = 0


def drop_tied_head(models: list, weights: list[dict[str, Any]], output_dir: str) -> None:
    """`save_state` pre-hook: store the tied LM head once, as wte (loading re-ties it)."""
    for sd in weights:
        head, wte = sd.get(_HEAD), sd.get(_WTE)
        if head is not None and wte is not None and head.data_ptr() == wte.data_ptr():
            del sd[_HEAD]


def check_pickles_are_safe(path: Path) -> None:
    """Prove that every pickle in a checkpoint holds only tensors and plain values before Accelerate reads it.

    Loading each with `weights_only=True` first means a crafted file is refused before anything executes;
    truncated or garbage files are reported here too, in one line.
    """
    from accelerate.utils.other import load

    for p in sorted(q for q in Path(path).rglob("*") if q.suffix in PICKLE_SUFFIXES and q.is_file()):
        try:
            load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserError(
                f"checkpoint file {p} holds something other than tensors and numbers ({_refusal_reason(e)}); "
                "refusing to unpickle it, as that could run arbitrary code"
            ) from None
        except Exception as e:
            raise UserError(f"checkpoint file {p} is corrupt or truncated: {first_line(e)}") from None


def first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _refusal_reason(e: BaseException) -> str:
    """torch's weights_only refusal is a paragraph; keep the line that names what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return named[0] if named else first_line(e)
