"""`run.py train` through Accelerate's own FSDP2 path, on a CPU gloo group: how the tests run FSDP.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \\
        tests/workers/fsdp_on_cpu.py CONTROL_DIR train ...flags

Accelerate turns FSDP on only for accelerator devices (accelerate/state.py, `AcceleratorState.__init__` switches to
DistributedType.FSDP in its multi-device branch), and the trainer refuses an FSDP launch on a machine without GPUs
(`workarounds.check_fsdp_can_run`). This worker lifts both and nothing else: the refusal is skipped, and once the
Accelerator is built for the CPU group with the trainer's FSDP plugin, its state is switched to FSDP as that branch
does on GPUs. Preparing (fully_shard), clipping (a DTensor norm), save_state/load_state (torch distributed
checkpoints) and get_state_dict are then Accelerate's FSDP2 code, and the rest is the real trainer.

Each rank writes CONTROL_DIR/rank_{rank}.json: the group's size and type and the FSDP mixed-precision policy, and
once the model is prepared, which of its modules are FSDP units (`fsdp_units`: their names, "" for the root).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import accelerate
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

import accel_gpt.runtime as runtime
from accel_gpt.cli import main

control = Path(sys.argv[1])
build = accelerate.Accelerator.__init__


def build_with_fsdp_on_cpu(self: accelerate.Accelerator, *args, fsdp_plugin=None, **kwargs) -> None:
    build(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is None:
        return
    self.state.fsdp_plugin = fsdp_plugin
    self.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    policy = fsdp_plugin.mixed_precision_policy
    info = {
        "num_processes": self.num_processes,
        "distributed_type": str(self.distributed_type),
        "is_fsdp2": self.is_fsdp2,
        "dtypes": {name: str(getattr(policy, name)) for name in ("param_dtype", "reduce_dtype", "output_dtype")},
    }
    (control / f"rank_{self.process_index}.json").write_text(json.dumps(info))


prepare = accelerate.Accelerator.prepare


def prepare_and_record_units(self: accelerate.Accelerator, *args):
    prepared = prepare(self, *args)
    from torch.distributed.fsdp import FSDPModule

    model = next(obj for obj in prepared if isinstance(obj, torch.nn.Module))
    path = control / f"rank_{self.process_index}.json"
    info = json.loads(path.read_text())
    info["fsdp_units"] = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    path.write_text(json.dumps(info))
    return prepared


runtime.check_fsdp_can_run = lambda cpu: None
accelerate.Accelerator.__init__ = build_with_fsdp_on_cpu
accelerate.Accelerator.prepare = prepare_and_record_units

if __name__ == "__main__":
    main(sys.argv[2:])
