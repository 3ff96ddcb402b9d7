"""The loss-spike guard: a step whose loss is an outlier is not applied; a gradient whose norm is one is scaled down.

The outlier test is llm.c's and OLMo's: a value more than z standard deviations above the mean of the last
`spike_window` steps. Every step's values enter the window, the judged ones too, as in both: a lone bad batch
only widens the window a little, while a lasting change of level (weights an update broke, which the next updates
repair) is judged against itself within a few steps and trained through. A window of applied steps only, tried
first, could never take in such a level: every later step was skipped and the run had to be stopped (tiny-cpu's
spike at step 32). Until the window holds `SPIKE_MIN_HISTORY` values nothing is judged.

The two outliers are treated apart, by what they mean:
- a loss far above the window's is a bad batch (corrupt or degenerate data): its gradient points nowhere useful,
  so the step is skipped;
- a gradient norm far above the window's, with an ordinary loss, is most often the run's own signal (the step that
  repairs what the previous update did): skipping it kept it out of AdamW's second moment, which then damped the
  next large gradients less and left the run worse (tiny-cpu, 5 seeds: bench/spike_seeds.py). It is scaled down to
  the window's bound instead (mean + z std), as ZClip does: the step is taken, no larger than the ones before it.

Everything happens on the device, so the training step gains no host sync: the window is a tensor ring, the
decisions 0-dim tensors, a skipped update is cancelled by fused AdamW's `found_inf` flag (the one GradScaler sets
after an overflow: the kernel leaves the weights and both moments as they were and the step counter is put back,
so a skipped step changes no parameter or optimizer state, while the schedule and the data position advance as
usual), and the scaling is one multiply of the gradients by a device scalar (1 where nothing is clipped). With
`bench/spike_guard.py` the skip costs nothing measurable beside fused AdamW, while copying the weights and moments
aside to restore them took 7-17x that step on CPU. The loss and the norm are those of the global batch, so every
rank takes the same decisions.
"""

from __future__ import annotations

from typing import Any

import torch

from accel_gpt.config import SPIKE_MIN_HISTORY, TrainConfig
from accel_gpt.errors import ConfigError
from accel_gpt.optim import can_skip_steps


class SpikeGuard:
    """The window of the last `spike_window` steps' (loss, grad norm), and the decision against it.

    Its `state_dict` rides in the checkpoint's trainer state, so a resumed run judges its next step exactly as an
    uninterrupted one would (the ring keeps its slot order: the same sums, bit for bit).
    """

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.zscores = torch.tensor([cfg.spike_loss_zscore, cfg.spike_grad_zscore], device=device)
        self.size = cfg.spike_window
        self.values = torch.zeros(self.size, 2, device=device)  # slot i: the newest step numbered i mod size
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # steps recorded since the guard began

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(skip, bound) for this step, judged against the window, whose values it then joins: whether its loss is an
        outlier (a 0-dim bool tensor), and the most its gradient norm may be (inf where the norm is no outlier)."""
        value = torch.stack([loss.detach().float().reshape(()), grad_norm.float().reshape(())])
        slots = torch.arange(self.size, device=self.values.device)
        held = slots < self.count  # the ring's filled slots (all of them once count >= size)
        n = held.sum().clamp(min=1)
        mean = torch.where(held[:, None], self.values, 0.0).sum(0) / n
        std = (torch.where(held[:, None], self.values - mean, 0.0).square().sum(0) / n).sqrt()
        bounds = mean + self.zscores * std
        # a NaN is no outlier: it stops the run
        outlier = (self.zscores > 0) & (value > bounds) & (self.count >= SPIKE_MIN_HISTORY)
        self.values = torch.where((slots == self.count % self.size)[:, None], value, self.values)
        self.count = self.count + 1
        return outlier[0], torch.where(outlier[1], bounds[1], torch.inf)

    def apply(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, params: list[torch.nn.Parameter], grad_clip: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Judge the step (`check`) and scale its gradients, already clipped to `grad_clip` (0: not clipped), down to
        the norm's bound; returns (skipped, clipped) as 0-dim bool tensors for the metrics row."""
        skip, bound = self.check(loss, grad_norm)
        norm = grad_norm.float().clamp(max=grad_clip) if grad_clip else grad_norm.float()
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, (bound / norm).clamp(max=1.0).to(grads[0].dtype))
        return skip, bound < norm

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
