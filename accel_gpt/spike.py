"""The loss-spike guard: an optimizer step whose loss or gradient norm is an outlier is not applied.

The outlier test is llm.c's: a value more than z standard deviations above the mean of the last `spike_window`
applied steps (a skipped step's values never enter the window, so one spike cannot widen it for the next). Until
the window holds `SPIKE_MIN_HISTORY` values nothing is judged: a mean over a handful of warm-up steps says little.

Everything happens on the device, so the training step gains no host sync: the window is a tensor ring, the
decision a 0-dim bool tensor, and the update is cancelled by fused AdamW's `found_inf` flag (the one GradScaler
sets after an overflow): the kernel leaves the weights and both moments as they were and the step counter is put
back, so a skipped step changes no parameter or optimizer state, while the schedule and the data position advance
as usual. It costs nothing when nothing is skipped: with `bench/spike_guard.py` the guarded step takes the time of
fused AdamW alone, while copying the weights and moments aside to restore them took 7-17x that step on CPU.
The loss and the norm are those of the global batch, so every rank takes the same decision.
"""

from __future__ import annotations

from typing import Any

import torch

from accel_gpt.config import SPIKE_MIN_HISTORY, TrainConfig
from accel_gpt.errors import ConfigError
from accel_gpt.optim import can_skip_steps

# Skipped steps in a row that stop the run (`tracking.MetricsLogger`): a guard that skips a bad batch sees the next
# one pass; when every batch is an outlier, an earlier update has broken the weights and skipping only keeps them so
# (measured on tiny-cpu: skipping its step-32 spike, caused by step 31's update, left 69 of 100 steps skipped).
MAX_SKIPPED_IN_A_ROW = 16


class SpikeGuard:
    """The window of the last `spike_window` applied steps' (loss, grad norm), and the decision against it.

    Its `state_dict` rides in the checkpoint's trainer state, so a resumed run judges its next step exactly as an
    uninterrupted one would (the ring keeps its slot order: the same sums, bit for bit).
    """

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.zscores = torch.tensor([cfg.spike_loss_zscore, cfg.spike_grad_zscore], device=device)
        self.size = cfg.spike_window
        self.values = torch.zeros(self.size, 2, device=device)  # slot i: the newest applied step numbered i mod size
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # applied steps recorded since the guard began

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether this step is an outlier (a 0-dim bool tensor); if not, its values join the window."""
        value = torch.stack([loss.detach().float().reshape(()), grad_norm.float().reshape(())])
        slots = torch.arange(self.size, device=self.values.device)
        held = slots < self.count  # the ring's filled slots (all of them once count >= size)
        n = held.sum().clamp(min=1)
        mean = torch.where(held[:, None], self.values, 0.0).sum(0) / n
        std = (torch.where(held[:, None], self.values - mean, 0.0).square().sum(0) / n).sqrt()
        outlier = (self.zscores > 0) & (value - mean > self.zscores * std)  # a NaN is no outlier: it stops the run
        skip = outlier.any() & (self.count >= SPIKE_MIN_HISTORY)
        slot = (slots == self.count % self.size) & ~skip
        self.values = torch.where(slot[:, None], value, self.values)
        self.count = self.count + (~skip).long()
        return skip

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (float32 values are exact as Python floats), read at save time: no sync in the step."""
        return {"values": self.values.tolist(), "count": int(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved window; under another `spike_window` its newest values, oldest first from slot 0."""
        values, count = torch.tensor(state["values"], dtype=torch.float32), int(state["count"])
        if len(values) != self.size:
            held = min(count, len(values))
            newest = [(count - held + i) % len(values) for i in range(held)][-self.size :]
            values, count = values[newest], len(newest)
            values = torch.cat([values, torch.zeros(self.size - count, 2)])
        self.values = values.to(self.values.device)
        self.count = torch.tensor(count, dtype=torch.int64, device=self.values.device)


def check_can_skip(optimizer: torch.optim.Optimizer, scaler: Any) -> None:
    """The guard cancels a step through fused AdamW's `found_inf`: refuse a setup where that flag is not ours."""
    if not can_skip_steps(optimizer):
        raise ConfigError(
            "the spike guard skips steps through fused AdamW, which this device lacks; set spike_*_zscore 0"
        )
    if scaler is not None:
        raise ConfigError(
            "the spike guard cannot run under fp16 mixed precision (its GradScaler owns the skip): use bf16"
        )


def optimizer_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
    """`optimizer.step()`, a no-op for the weights and the optimizer state where `skip` is true.

    `found_inf` is read by the fused kernel on the device (GradScaler's route; `optim.MuonAdamW` honours it too); it
    is set on the torch optimizer, which Accelerate's wrapper holds as `.optimizer`.
    """
    if skip is None:
        optimizer.step()
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.found_inf = skip.float()
    try:
        optimizer.step()
    finally:
        del inner.found_inf
