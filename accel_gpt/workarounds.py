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
- `check_fsdp_can_run`: on a machine without GPUs an FSDP launch silently trains as plain data parallelism
  (accelerate/state.py, `AcceleratorState.__init__` switches to FSDP only in its branch for accelerator devices).
- `check_claims_can_hold`: on a CPU Accelerate accepts `mixed_precision: fp16` and then computes in fp32 (no
  autocast, no scaler: accelerate/accelerator.py, `Accelerator.__init__` enables native AMP for fp16 only on
  accelerator devices), so a run would record fp16 and train in fp32; and a `distributed_type: DEEPSPEED` launch
  hands the trainer a ZeRO engine it never prepares for (its checkpoints, spike guard and exports are DDP's and
  FSDP's), which on a CPU even trains on as plain data parallelism without a word.
- `check_pickles_are_safe`: `load_state` unpickles registered objects with `weights_only=False`
  (accelerate/checkpointing.py, `load_custom_state`), which runs any code a crafted file names; under FSDP it
  reads torch distributed checkpoints, whose index is a plain pickle (torch/distributed/checkpoint/filesystem.py,
  `FileSystemReader.read_metadata`) and whose non-tensor items are loaded with `weights_only=False`
  (torch/distributed/checkpoint/default_planner.py, `DefaultLoadPlanner.load_bytes`).
- `drop_tied_head`: `save_state` drops the alias of a tied weight itself but warns at every save
  (accelerate/utils/other.py, `clean_state_dict_for_safetensors`: "Removed shared tensor ...").
- `forget_previous_precision`: Accelerate keeps the first Accelerator's mixed precision process-wide and refuses
  another ("AcceleratorState has already been initialized and cannot be changed": accelerate/state.py,
  `AcceleratorState._check_initialized`), so a second run in one process (a notebook, the tests) that chooses
  another precision for its device and size would fail at start.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

from accel_gpt.errors import UserError

PICKLE_SUFFIXES = (".bin", ".pkl", ".pt")
DCP_INDEX = ".metadata"  # a torch distributed checkpoint folder's index (FSDP's sharded model and optimizer)
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


def check_fsdp_can_run(cpu: bool) -> None:
    """Refuse an FSDP launch (ACCELERATE_USE_FSDP, set by `accelerate launch` from `distributed_type: FSDP`) on a
    machine without GPUs, where Accelerate would train plain data parallelism without a word."""
    if cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise UserError(
            "the launch asks for FSDP (ACCELERATE_USE_FSDP=true, e.g. accelerate_configs/fsdp.yaml) but this machine "
            "has no GPU, and on a CPU Accelerate would silently train without FSDP; launch with "
            "--config_file accelerate_configs/cpu_2proc.yaml instead"
        )


def check_claims_can_hold(cpu: bool, mixed_precision: str) -> None:
    """Refuse fp16 on a CPU and any DeepSpeed launch (ACCELERATE_USE_DEEPSPEED), in one line each, before anything is
    built: what the run would record is not what it would do (see the module)."""
    if cpu and mixed_precision == "fp16":
        raise UserError(
            "mixed_precision fp16 on a CPU: Accelerate would train in fp32 while the run records fp16; use bf16 "
            "(CPUs with bf16 support) or no, e.g. --mixed_precision bf16, or an accelerate config with bf16 or no"
        )
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise UserError(
            "the launch asks for DeepSpeed (distributed_type: DEEPSPEED), which accel_gpt does not support: shard "
            "parameters, gradients and optimizer state with FSDP instead (accelerate_configs/fsdp.yaml), or train "
            "with DDP (accelerate_configs/multi_gpu.yaml)"
        )


def forget_previous_precision(mixed_precision: str | None) -> None:
    """Clear the settings an earlier run in this process left in Accelerate's process-wide state where this run
    trains in another precision (None: the launch's, as a new process would read it); the process group
    (PartialState) stays. Not under FSDP, whose state Accelerate rebuilds only in a new process."""
    state = AcceleratorState._shared_state
    earlier = state.get("_mixed_precision")
    wanted = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if earlier is None or earlier == wanted:
        return
    if state.get("distributed_type") == DistributedType.FSDP:
        raise UserError(
            f"this process already ran under FSDP in mixed precision {earlier}, and Accelerate cannot change that "
            f"within a process: run the {wanted} one in a new process"
        )
    AcceleratorState._reset_state()


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
    truncated or garbage files are reported here too, in one line. The folders of an FSDP checkpoint are torch
    distributed checkpoints: their pickles are found through each folder's index (`check_distributed_checkpoint`).
    """
    for p in sorted(q for q in Path(path).rglob("*") if q.is_file()):
        if p.name.endswith(DCP_INDEX):
            check_distributed_checkpoint(p)
        elif p.suffix in PICKLE_SUFFIXES:
            _load_weights_only(p, p)


def _load_weights_only(source: Any, p: Path, what: str = "") -> None:
    """`torch.load(source, weights_only=True)`, its refusal or failure as one line about checkpoint file `p`."""
    from accelerate.utils.other import load

    try:
        load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"checkpoint file {p}{what} holds something other than tensors and numbers ({_refusal_reason(e)}); "
            "refusing to unpickle it, as that could run arbitrary code"
        ) from None
    except Exception as e:
        raise UserError(f"checkpoint file {p}{what} is corrupt or truncated: {first_line(e)}") from None


def check_distributed_checkpoint(index: Path) -> None:
    """The pickles of a torch distributed checkpoint folder, given its index file.

    torch unpickles the index with plain `pickle.load`, and each non-tensor item of the state (e.g. an optimizer's
    learning rate) with `torch.load(weights_only=False)`; tensors it reads with `weights_only=True` itself. So the
    index is read here admitting only the classes an index is made of, then each non-tensor item with
    `weights_only=True`, at the file and offset the index names.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    try:
        with open(index, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except _ForbiddenGlobal as e:
        raise UserError(
            f"checkpoint file {index} holds something other than a distributed checkpoint index "
            f"({_refusal_reason(e)}); refusing to unpickle it, as that could run arbitrary code"
        ) from None
    except Exception as e:
        raise UserError(f"checkpoint file {index} is corrupt or truncated: {first_line(e)}") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"checkpoint file {index} is not a distributed checkpoint index ({type(metadata).__name__})")
    for key, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
            continue
        name = str(getattr(info, "relative_path", ""))
        item, what = index.parent / name, f" (item {key.fqn})"
        if Path(name).name != name or not item.is_file() or getattr(info, "transform_descriptors", None):
            raise UserError(f"checkpoint file {index} names an item this check cannot read: {key.fqn} in {name!r}")
        with open(item, "rb") as f:
            f.seek(info.offset)
            _load_weights_only(io.BytesIO(f.read(info.length)), item, what)


class _ForbiddenGlobal(pickle.UnpicklingError):
    """A global that a distributed checkpoint index does not hold (anything else wrong with it is corruption)."""


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles only what a distributed checkpoint index holds: torch's metadata dataclasses, sizes, dtypes,
    layouts and the checkpoint's path."""

    ALLOWED = {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata")
        ),
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in ("BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *((module, cls) for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "WindowsPath")),
    }

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in self.ALLOWED and not dtype:
            raise _ForbiddenGlobal(f"Unsupported global: GLOBAL {module}.{name}")
        return super().find_class(module, name)


def first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _refusal_reason(e: BaseException) -> str:
    """torch's weights_only refusal is a paragraph; keep the line that names what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return named[0] if named else first_line(e)
