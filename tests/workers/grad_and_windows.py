"""Worker launched as W processes: one accumulated step's gradient and the windows each rank reads.

Uses the trainer's own `build_accelerator`, `build`, `Run.batches` and `accumulate_gradients`, so the test
checks the real code path. Writes `grads.pt` (rank 0, the synced gradient after step 1) and
`windows_{rank}.json`. The dataset has no recording hook, so this script wraps `TokenWindows.__getitem__`.

It ends the way `train()` does, with `accelerator.end_training()` on every rank after a barrier: a process
that leaves its gloo process group to interpreter shutdown can abort there ("terminate called without an
active exception") while its peer has already exited.
"""

import json
import sys
from pathlib import Path

import torch

from accel_gpt.choices import RunChoices
from accel_gpt.cli import parse
from accel_gpt.data.loader import TokenWindows
from accel_gpt.train import accumulate_gradients, build, build_accelerator

touched: list[int] = []
read_window = TokenWindows.__getitem__


def recording_getitem(self: TokenWindows, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    touched.append(int(i))
    return read_window(self, i)


TokenWindows.__getitem__ = recording_getitem

out = Path(sys.argv[1])
steps = int(sys.argv[2])
_, cfg = parse(["train", *sys.argv[3:]])
accelerator, precision = build_accelerator(cfg, resumed={})
run = build(cfg, accelerator, RunChoices(precision), resumed={})
batches = run.batches(0)
per_step = []
for step in range(steps):
    accumulate_gradients(run.model, batches, accelerator)
    per_step.append(list(touched))
    touched.clear()
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
accelerator.wait_for_everyone()
accelerator.end_training()
