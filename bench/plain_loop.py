"""The yardstick: the training loop a nanoGPT user writes, on the same model, data and batch, without Accelerate.

    python bench/plain_loop.py --config tiny-cpu --data_dir D --out_dir O --max_steps 20   # run.py train's flags

It takes `run.py train`'s flags (parsed by the trainer's own parser, so both sides resolve the same settings)
and writes the same `metrics.jsonl` rows (`step`, `loss`, `tokens_per_sec`), so the benchmark reads both sides
alike. The loop: model.to(device), `torch.autocast` to bf16 on CUDA, loss / accumulation, clip, AdamW (fused
on CUDA), the learning rate set from the step, and one host sync per `log_every` window, the trainer's cadence.
It keeps only what such a loop has: `compile` in torch's default mode; `compile_mode` and
`activation_checkpointing` are the trainer's and stay off here. On CPU it applies the glibc settings the trainer
applies to itself (`keep_freed_memory`). It reuses accel_gpt's model, token windows, param groups and schedule
on purpose: the ratio accel_gpt / plain then measures what the trainer and Accelerate add around the same work.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.data import DataLoader

from accel_gpt.allocator import keep_freed_memory
from accel_gpt.cli import parse
from accel_gpt.config import MODEL_FIELDS, TrainConfig
from accel_gpt.data.loader import WindowSampler, train_windows
from accel_gpt.metrics import METRICS, MetricsFile
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.optim import lr_multiplier, make_optimizer

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def batches(cfg: TrainConfig, device: torch.device) -> Batches:
    """The trainer's windows in the trainer's order, through a bare DataLoader."""
    dataset = train_windows(cfg.data_dir, cfg.seq_len)
    loader = DataLoader(
        dataset,
        sampler=WindowSampler(len(dataset), cfg.seed),
        batch_size=cfg.micro_batch_size,
        drop_last=True,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train_step(
    model: GPT, optimizer: torch.optim.Optimizer, data: Batches, cfg: TrainConfig, step: int, bf16: bool
) -> torch.Tensor:
    """One optimizer step over `total_batch_size` tokens; returns the mean loss on the device, unread."""
    accum = cfg.grad_accum_steps(1)
    for group in optimizer.param_groups:
        group["lr"] = cfg.learning_rate * lr_multiplier(step, cfg)
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    for _ in range(accum):
        x, y = next(data)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, y, return_logits=False)
        (loss / accum).backward()
        loss_sum += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum


def train(cfg: TrainConfig) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        keep_freed_memory()
    data = batches(cfg, device)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**{name: getattr(cfg, name) for name in MODEL_FIELDS})).to(device)
    if cfg.compile:
        model.compile()
    optimizer = make_optimizer(model, cfg, device.type)
    model.train()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = MetricsFile(out / METRICS, enabled=True)
    window: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for step in range(cfg.max_steps):
        window.append(train_step(model, optimizer, data, cfg, step, bf16=device.type == "cuda"))
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps:
            losses = torch.stack(window).tolist()  # the window's one host sync
            tokens_per_sec = len(window) * cfg.total_batch_size / (time.perf_counter() - t0)
            first = step + 2 - len(window)
            metrics.write(
                [{"step": first + i, "loss": loss, "tokens_per_sec": tokens_per_sec} for i, loss in enumerate(losses)]
            )
            window = []
            t0 = time.perf_counter()


if __name__ == "__main__":
    train(parse(["train", *sys.argv[1:]])[1])
