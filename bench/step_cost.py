"""What one optimizer step of nanoGPT's CPU recipe costs, by part: forward + backward, clipping, the optimizer step.

Each side is the model and optimizer alone (no trainer, data loader or logging), on one batch of nanoGPT's CPU recipe
(4 layers x 4 heads x 128 wide, 12 x 64 characters, vocabulary 65), one thread, timed with `time.process_time` over
`--steps` steps after 10, each run in a fresh child process, the sides alternated over `--rounds` (A B, B A, ...).

    python bench/step_cost.py --sides gpt2-adamw,nanochat-adamw,gpt2-muon,nanochat-muon --rounds 3
    python bench/step_cost.py --sides nanochat-muon,nanochat-muon:torch_norm --rounds 6 --steps 150
    python bench/step_cost.py --sides nanochat-muon:ns5,nanochat-muon:ns4,nanochat-muon:ns3 --rounds 2
    python bench/step_cost.py --sides gpt2-adamw,gpt2-muon,gpt2-muon:float32,gpt2-muon:bfloat16,gpt2-muon:torch_muon
    python bench/step_cost.py --nanogpt PATH/TO/nanoGPT --sides nanogpt,gpt2-adamw --rounds 3

Sides: ARCH-OPTIMIZER (accel_gpt's GPT and its optimizer as the trainer builds them), with variants after a colon:
`torch_norm` (nanochat's norm through `F.rms_norm` on the CPU too, instead of accel_gpt's backward), `nsN` (Muon's
`ns_steps`), `float32` / `bfloat16` (`muon_ns_dtype`; unset: auto), `torch_muon` (torch.optim.Muon's own step, bf16
and one matrix at a time, instead of accel_gpt's); `nanogpt` (its model.py and `configure_optimizers`, from
`--nanogpt DIR`). Prints the median per part.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchlib import REPO, child_env, header
from bench.peers import CPU_MALLOC

PARTS = ("fwd_bwd", "clip", "step")


def build(side: str, nanogpt: str | None):
    """(model, optimizer, schedule or None) of a side, seeded."""
    import torch

    torch.manual_seed(0)
    if side == "nanogpt":
        sys.path.insert(0, nanogpt)
        from model import GPT as NanoGPT
        from model import GPTConfig as NanoConfig

        model = NanoGPT(
            NanoConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
        )
        return model, model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu"), None
    import torch.nn.functional as F

    from accel_gpt import model as M
    from accel_gpt.config import TrainConfig
    from accel_gpt.optim import make_optimizer, make_scheduler

    name, _, variant = side.partition(":")
    arch, optimizer = name.split("-")
    if variant == "torch_norm":
        M.norm = lambda x: F.rms_norm(x, (x.size(-1),))
    shape = dict(n_layer=4, n_head=4, n_embd=128, seq_len=64, vocab_size=65, micro_batch_size=12, total_batch_size=768)
    cfg = TrainConfig(data_dir="-", arch=arch, optimizer=optimizer, bias=False if arch == "gpt2" else None, **shape)
    if variant.startswith("ns"):
        cfg.muon_ns_steps = int(variant[2:])
    if variant in ("float32", "bfloat16"):
        cfg.muon_ns_dtype = variant
    if variant == "torch_muon":
        import accel_gpt.optim

        accel_gpt.optim.Muon = lambda params, precision, coefficients, **options: torch.optim.Muon(params, **options)
    model = M.GPT(M.GPTConfig(**cfg.model_settings()))
    opt = make_optimizer(model, cfg, "cpu")
    return model, opt, make_scheduler(opt, cfg)


def measure(side: str, steps: int, nanogpt: str | None) -> dict[str, float]:
    """Milliseconds per step of each part (run in the child)."""
    import torch

    torch.set_num_threads(1)
    model, optimizer, schedule = build(side, nanogpt)
    tokens = torch.randint(0, 65, (12, 65), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    spent = dict.fromkeys(PARTS, 0.0)
    for i in range(steps + 10):
        a = time.process_time()
        model(x, y)[1].backward()
        b = time.process_time()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        c = time.process_time()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        optimizer.zero_grad(set_to_none=True)
        d = time.process_time()
        if i >= 10:
            for part, seconds in zip(PARTS, (b - a, c - b, d - c), strict=True):
                spent[part] += seconds
    return {part: 1000 * seconds / steps for part, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default="gpt2-adamw,nanochat-adamw,gpt2-muon,nanochat-muon")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating A B, B A, ...")
    parser.add_argument("--steps", type=int, default=80, help="timed steps per run, after 10")
    parser.add_argument("--nanogpt", help="nanoGPT's folder (model.py), for the nanogpt side")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.steps, args.nanogpt)))
        return
    print(header("step_cost"))
    sides = args.sides.split(",")
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            cmd = [sys.executable, __file__, "--child", side, "--steps", str(args.steps)]
            cmd += ["--nanogpt", args.nanogpt] if args.nanogpt else []
            out = subprocess.run(cmd, cwd=REPO, env={**child_env(1), **CPU_MALLOC}, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {round_} {side:28} " + " ".join(f"{p} {runs[side][-1][p]:7.2f}" for p in PARTS), flush=True)
    print(f"\n{'side':28} " + " ".join(f"{p:>8}" for p in PARTS) + f" {'total':>8}  (ms per step, medians)")
    for side, rows in runs.items():
        medians = {p: statistics.median(r[p] for r in rows) for p in PARTS}
        total = statistics.median(sum(r.values()) for r in rows)
        print(f"{side:28} " + " ".join(f"{medians[p]:8.2f}" for p in PARTS) + f" {total:8.2f}")


if __name__ == "__main__":
    main()
