"""AdamW parameter groups and the learning-rate schedule as a pure function of (optimizer step, config).

Only the step is resumed (`StepSchedule`): a resumed run computes every rate from its step and the config it
runs with now, so a changed `schedule_steps` (a longer horizon for a run stopped in wsd's stable phase) or
`learning_rate` takes effect from the first resumed update.
"""

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


# Devices with torch's fused AdamW kernel that this project runs on (CUDA, and the CPU of tests and laptops).
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def make_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW; the fused kernel updates all parameters in a few launches instead of one per tensor (on CPU, 3.2-5.1x
    faster than the default implementation: `bench/spike_guard.py`), and its `found_inf` flag is how the spike
    guard cancels a step."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        fused=device_type in FUSED_ADAMW_DEVICES,
    )


def schedule_horizon(cfg: TrainConfig) -> int:
    """The step the schedule ends at: `schedule_steps`, or `max_steps` when it is 0.

    Keeping it apart from `max_steps` lets a run stop part-way through its schedule and be continued: a run
    to step 4 of an 8-step horizon, resumed with `--max_steps 8`, takes the 8 steps of one straight run. A
    horizon shorter than `max_steps` is allowed: the steps past it train at the floor.
    """
    return cfg.schedule_steps or cfg.max_steps


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """The learning rate of the update of step `step` (0-based: optimizer steps already taken), over the peak.

    Linear warm-up over `warmup_steps` (the first update uses 1/warmup_steps), then by `lr_schedule`, over the
    horizon H = `schedule_horizon(cfg)` with floor m = `min_lr_ratio`:

    - cosine: from 1 at the end of warm-up down to m at H (half a cosine period);
    - linear: from 1 down to m at H in equal steps;
    - wsd: warm-up, stable at 1, then the last `decay_fraction` of H (D = round(decay_fraction * H) steps, not
      before warm-up ends) decays linearly from 1 to m at H. Linear, not cosine or 1-sqrt: it is the shape of
      the WSD papers' default, and a decay whose length is a fixed share of the horizon can be started from
      any checkpoint of the stable phase, which is what makes the horizon extendable;
    - constant: 1 after warm-up, whatever H (m is unused).

    At and past H every decaying schedule stays at m. `progress` is (steps since the decay began) over (decay
    length), so the first decayed update is at the peak and the value at H is m exactly, as the cosine always was.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    horizon, floor = schedule_horizon(cfg), cfg.min_lr_ratio
    if step >= horizon:
        return floor
    decay_start = cfg.warmup_steps
    if cfg.lr_schedule == "wsd":
        decay_start = max(cfg.warmup_steps, horizon - wsd_decay_steps(cfg))
        if step < decay_start:
            return 1.0
    progress = (step - decay_start) / max(1, horizon - decay_start)
    if cfg.lr_schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1 - floor) * progress  # linear, and wsd's decay


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """Steps of wsd's decay: `decay_fraction` of the horizon, rounded half up (at least 1)."""
    return max(1, math.floor(cfg.decay_fraction * schedule_horizon(cfg) + 0.5))


class StepSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose only resumed state is the step: the rates come from this run's config, never the checkpoint's.

    A plain LambdaLR restores the saved `base_lrs` and last rate (and the optimizer restores each group's `lr`),
    so the first update after a resume would use the rate the old config computed, and a changed learning_rate
    would never apply. Recomputing from (step, config) gives the same floats when nothing changed (the same
    expression as `get_lr`), so an unchanged resume stays bit-identical.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        base_lrs = self.base_lrs
        super().load_state_dict(state_dict)
        self.base_lrs = base_lrs
        self._last_lr = [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs, strict=True)]
        for group, base, lr in zip(self.optimizer.param_groups, self.base_lrs, self._last_lr, strict=True):
            group["initial_lr"], group["lr"] = base, lr


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> StepSchedule:
    """The schedule over `lr_multiplier`. Build the Accelerator with `step_scheduler_with_optimizer=False`:
    a prepared scheduler otherwise steps once per process per optimizer step (W times too fast)."""
    return StepSchedule(optimizer, lambda step: lr_multiplier(step, cfg))
