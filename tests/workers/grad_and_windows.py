"""Worker launched as W processes: one accumulated step's gradient and the windows each rank reads.

Uses the trainer's own `build_accelerator`, `build` and `accumulate_gradients`, so the test checks the
real code path. Writes `grads.pt` (rank 0, the synced gradient after step 1) and `windows_{rank}.json`.
"""

import json
import sys
from pathlib import Path

import torch

from accel_gpt.config import load_config, parse_flags
from accel_gpt.train import accumulate_gradients, build, build_accelerator

out = Path(sys.argv[1])
steps = int(sys.argv[2])
cfg = load_config(None, parse_flags(sys.argv[3:]))
accelerator = build_accelerator(cfg)
run = build(cfg, accelerator)
dataset = run.train_dl.dataset
dataset.touched = []
batches = iter(run.train_dl)
per_step = []
for step in range(steps):
    accumulate_gradients(run.model, batches, accelerator)
    per_step.append(list(dataset.touched))
    dataset.touched.clear()
    if step == 0 and accelerator.is_main_process:
        model = accelerator.unwrap_model(run.model)
        torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters()}, out / "grads.pt")
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
info = {
    "num_processes": accelerator.num_processes,
    "accum": accelerator.gradient_accumulation_steps,
    "windows": per_step,
}
(out / f"windows_{accelerator.process_index}.json").write_text(json.dumps(info))
