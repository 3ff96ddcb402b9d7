"""AdamW parameter groups and the learning-rate schedule as a pure function of the optimizer step."""

from __future__ import annotations

import math

import torch
from torch import nn

from accel_gpt.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (>= 2-D); never biases or LayerNorm gains (1-D)."""
    params = [p for p in model.parameters() if p.requires_grad]  # .parameters() lists the tied wte once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW; the fused CUDA kernel updates all parameters in a few launches instead of one per tensor."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        fused=device_type == "cuda",
    )


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from 1 down to `min_lr_ratio` at `max_steps`.

    `step` counts optimizer steps already taken: the update of step k (0-based) uses lr_multiplier(k).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return cfg.min_lr_ratio
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_multiplier`. Build the Accelerator with `step_scheduler_with_optimizer=False`:
    a prepared scheduler otherwise steps once per process per optimizer step (W times too fast)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
