"""What the loss-spike guard costs per optimizer step, against the other way to cancel a step on the device.

    python bench/spike_guard.py                       # the tiny-cpu preset's model, on CUDA if there is one
    python bench/spike_guard.py --model gpt2-124m --repeats 10

AdamW's step over a GPT's parameters (the trainer's two parameter groups) with fixed random gradients; the
variants take turns in every round, so the machine's drift falls on all alike, and the median per variant is
reported:

- `adamw`: non-fused AdamW, torch's default implementation for the device (what the trainer used on CPU before);
- `fused`: fused AdamW (the trainer's optimizer);
- `fused + guard`: the guard's outlier check, then fused AdamW with the decision as its `found_inf` flag
  (`spike.optimizer_step`), nothing skipped; then fused AdamW told to skip every step;
- `fused + restore`: the alternative: copy the weights and both moments aside before the step and put them
  back with `torch.where(skip, ...)` after it (works for any optimizer, at the price of the copies).
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from accel_gpt.config import TrainConfig
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.optim import param_groups
from accel_gpt.spike import SpikeGuard, optimizer_step
from bench.benchlib import header

SHAPES = {
    "tiny-cpu": {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 1024},
}


def adamw(model: GPT, fused: bool) -> torch.optim.AdamW:
    groups = param_groups(list(model.parameters()), 0.1)
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def restore_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Step, then put every weight and moment back where `skip` is true, from copies taken before."""
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    saved = [t.detach().clone() for t in tensors]
    optimizer.step()
    with torch.no_grad():
        for t, old in zip(tensors, saved, strict=True):
            t.copy_(torch.where(skip, old, t))


def variants(model: GPT, device: torch.device) -> dict[str, Callable[[], None]]:
    cfg = TrainConfig(data_dir="unused", spike_grad_zscore=5.0, spike_loss_zscore=5.0)
    plain, fused, guarded, skipped, restored = (adamw(model, f) for f in (False, True, True, True, True))
    guard, params = SpikeGuard(cfg, device), [p for p in model.parameters() if p.grad is not None]
    loss, norm = torch.tensor(3.0, device=device), torch.tensor(1.0, device=device)
    skip, keep = torch.tensor(True, device=device), torch.tensor(False, device=device)
    return {
        "adamw": plain.step,
        "fused": fused.step,
        "fused + guard (applied)": lambda: optimizer_step(guarded, guard.apply(loss, norm, params, 1.0)[0]),
        "fused + guard (skipped)": lambda: optimizer_step(skipped, skip),
        "fused + restore (applied)": lambda: restore_step(restored, keep),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(SHAPES), default="tiny-cpu")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (after 5 untimed ones)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPES[args.model], vocab_size=50_304)).to(device)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    steps = variants(model, device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(5 + args.repeats):
        for name, step in steps.items():
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            if round_ >= 5:
                times[name].append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{device.type}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"
    print(header("spike_guard"))
    print(f"{args.model} ({n_params / 1e6:.1f}M parameters), {where}")
    base = statistics.median(times["fused"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:27s} {median * 1e3:9.3f} ms   {median / base:5.2f}x fused")


if __name__ == "__main__":
    main()
