"""The yardstick: a hand-written PyTorch training loop of the same model, data and batch, without Accelerate.

It is the loop a nanoGPT user writes: model.to(device), `torch.autocast` for bf16, loss / accumulation,
clip, fused AdamW on CUDA, the learning rate set from the step, and one host sync per log window to read
the loss (the trainer syncs at the same cadence). It reuses accel_gpt's model and token-window dataset on
purpose: the ratio accel_gpt / plain then measures what the trainer and Accelerate add around the same
work, and the data loader is measured on its own (`worker.py loader`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from accel_gpt.config import MODEL_FIELDS, TrainConfig
from accel_gpt.data.loader import WindowSampler, train_windows
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.optim import lr_multiplier, param_groups


def make_batches(cfg: TrainConfig, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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


def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**{name: getattr(cfg, name) for name in MODEL_FIELDS})).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)  # as the trainer does: in place
    return model


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        fused=device.type == "cuda",
    )


def plain_step(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    cfg: TrainConfig,
    step: int,
    bf16: bool,
) -> torch.Tensor:
    """One optimizer step over `total_batch_size` tokens; returns (loss, grad_norm) on the device, unread."""
    accum = cfg.grad_accum_steps(1)
    for group in optimizer.param_groups:
        group["lr"] = cfg.learning_rate * lr_multiplier(step, cfg)
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    for _ in range(accum):
        x, y = next(batches)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, y, return_logits=False)
        (loss / accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack([loss_sum / accum, grad_norm.float()])


def train_plain(cfg: TrainConfig, steps: int, bf16: bool) -> tuple[list[float], list[float]]:
    """Run `steps` optimizer steps; return the wall and the CPU seconds of each (averaged over its log window)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    batches = make_batches(cfg, device)
    model = build_model(cfg, device)
    optimizer = make_optimizer(model, cfg, device)
    model.train()
    seconds: list[float] = []
    cpu_seconds: list[float] = []
    window: list[torch.Tensor] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(steps):
        window.append(plain_step(model, optimizer, batches, cfg, step, bf16))
        if (step + 1) % cfg.log_every == 0 or step + 1 == steps:
            torch.stack(window).tolist()  # the window's one host sync: wait for the GPU, read the losses
            seconds += [(time.perf_counter() - t0) / len(window)] * len(window)
            cpu_seconds += [(time.process_time() - c0) / len(window)] * len(window)
            window = []
            t0, c0 = time.perf_counter(), time.process_time()
    return seconds, cpu_seconds
