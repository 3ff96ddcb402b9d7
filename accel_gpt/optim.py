"""The optimizer (AdamW, or Muon + AdamW) and the learning-rate schedule as a pure function of (optimizer step, config).

This is the one module that knows there may be two optimizers: `MuonAdamW` holds both and is one
`torch.optim.Optimizer` to everything else (Accelerate's `prepare`, the schedule, the spike guard, the checkpoint).

Only the step is resumed (`StepSchedule`): a resumed run computes every rate from its step and the config it
runs with now, so a changed `schedule_steps` (a longer horizon for a run stopped in wsd's stable phase) or
`learning_rate` takes effect from the first resumed update.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel_gpt.config import TrainConfig
from accel_gpt.errors import ConfigError
from accel_gpt.muon import Muon
from accel_gpt.precision import NewtonSchulzPrecision, detect, newton_schulz_precision


def param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (>= 2-D); never biases or LayerNorm gains (1-D). Empty groups are left out."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, "role": "decay"},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "role": "no_decay"},
    ]
    return [group for group in groups if group["params"]]


def own_rate_groups(model: nn.Module, cfg: TrainConfig) -> tuple[list[dict], set[int]]:
    """nanochat's token embedding and untied head: AdamW groups with rates of their own (an untied head does not
    train well at the embedding's rate) and no weight decay (at the embedding's rate of 0.3 a decay of 0.1 would
    shrink it by 3% a step). Returns the groups and the ids of their parameters. GPT-2: none."""
    if cfg.arch != "nanochat":
        return [], set()
    embedding, head = model.transformer.wte.weight, model.lm_head.weight
    groups = [
        {"params": [embedding], "lr": cfg.embedding_lr, "weight_decay": 0.0, "role": "embedding"},
        {"params": [head], "lr": cfg.head_lr, "weight_decay": 0.0, "role": "head"},
    ]
    return groups, {id(embedding), id(head)}


# Devices with torch's fused AdamW kernel that this project runs on (CUDA, and the CPU of tests and laptops).
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def make_optimizer(
    model: nn.Module, cfg: TrainConfig, device_type: str, ns_precision: NewtonSchulzPrecision | None = None
) -> torch.optim.Optimizer:
    """AdamW over every parameter, or (`optimizer: muon`) Muon over the blocks' weight matrices and AdamW over the
    rest: embeddings, the LM head, biases and LayerNorm gains, which Muon's orthogonalized update does not suit
    (an embedding row is updated only where its token occurs; a 1-D gain has no matrix to orthogonalize).
    nanochat's embedding and head take their own rates (`own_rate_groups`) under either optimizer. `ns_precision`:
    Muon's Newton-Schulz dtype (None: `muon_ns_dtype` on this device type)."""
    fused = device_type in FUSED_ADAMW_DEVICES
    own, taken = own_rate_groups(model, cfg)
    params = [p for p in model.parameters() if id(p) not in taken]  # .parameters() lists a tied wte once
    if cfg.optimizer == "adamw":
        return make_adamw(param_groups(params, cfg.weight_decay) + own, cfg, fused)
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"optimizer=muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    matrices = {id(p) for p in model.transformer.h.parameters() if p.dim() == 2}
    if ns_precision is None:
        ns_precision = newton_schulz_precision(cfg.muon_ns_dtype, detect(torch.device(device_type)))
    muon = Muon(
        [p for p in params if id(p) in matrices],
        ns_precision,
        cfg.muon_ns_coefficients,
        lr=cfg.muon_lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=True,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr_fn,
    )
    rest = param_groups([p for p in params if id(p) not in matrices], cfg.weight_decay)
    return MuonAdamW(muon, make_adamw(rest + own, cfg, fused))


def make_adamw(groups: list[dict], cfg: TrainConfig, fused: bool) -> torch.optim.AdamW:
    """AdamW; the fused kernel updates all parameters in a few launches instead of one per tensor (on CPU, 3.2-5.1x
    faster than the default implementation: `bench/spike_guard.py`), and its `found_inf` flag is how the spike
    guard cancels a step. A group without its own `lr` takes `learning_rate`."""
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=fused)


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW as one optimizer: one `step`, one state_dict holding both states, and `param_groups` that list
    AdamW's groups, then Muon's. The schedule scales every group from its own peak (`learning_rate` for AdamW,
    `muon_lr` for Muon) by the same factor, and the first group's rate is AdamW's, the one the metrics log.

    `Optimizer.__init__` is not called: the groups and states stay the inner optimizers' own (their
    `load_state_dict` replaces their group dicts, so a copied list would go stale). Like fused AdamW, `step` honours
    a `found_inf` flag set on it (the spike guard's, GradScaler's protocol): AdamW's kernel skips on the device, and
    Muon's update is undone on the device too (weights and momentum put back), so a skipped step changes nothing.
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw
        self.defaults: dict = {}

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups

    @property
    def state(self) -> dict:
        return {**self.adamw.state, **self.muon.state}

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        skip = getattr(self, "found_inf", None)
        if skip is None:
            self.adamw.step()
            self.muon.step()
            return
        self.adamw.found_inf = skip
        try:
            self.adamw.step()
        finally:
            del self.adamw.found_inf
        self._muon_step_unless(skip.bool())

    def _muon_step_unless(self, skip: torch.Tensor) -> None:
        """Muon's step, then each weight and momentum buffer put back where `skip` (a 0-dim device bool) is true:
        a select on the device, no host sync. Costs a copy of the Muon weights and buffers per guarded step."""
        params = [p for group in self.muon.param_groups for p in group["params"] if p.grad is not None]
        tensors = []
        for p in params:  # the buffer Muon would create in this step, created now so that it can be put back
            buf = self.muon.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
            tensors += [p, buf]
        before = [t.clone() for t in tensors]
        self.muon.step()
        for old, new in zip(before, tensors, strict=True):
            new.copy_(torch.where(skip, old, new))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"adamw", "muon"}:
            raise ValueError(f"not a Muon + AdamW optimizer state (keys {sorted(state_dict)[:4]})")
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])


def can_skip_steps(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step` honours a `found_inf` flag: fused AdamW does, and so does `MuonAdamW` over a fused AdamW."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch optimizer
    adamw = inner.adamw if isinstance(inner, MuonAdamW) else inner
    return all(group.get("fused") for group in adamw.param_groups)


def apply_settings(optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> None:
    """After a resume's `load_state`: the optimizer restored the saved betas and weight decay; give it this run's
    (`config`: the run's config as a dict).

    AdamW's decayed group is the one of matrices (its `role`; checkpoints from before roles: the group whose
    parameters are all >= 2-D). The same values are written back when nothing changed, so an unchanged resume stays
    bit-identical. The learning rates and Muon's momentum are the schedule's (`StepSchedule` recomputes them from
    this run's config)."""
    for group in optimizer.param_groups:
        if "betas" not in group:  # a Muon group
            group["weight_decay"], group["adjust_lr_fn"] = config["muon_weight_decay"], config["muon_adjust_lr_fn"]
            group["ns_steps"] = config.get("muon_ns_steps", 5)  # 5: torch's, before the setting existed
            continue
        group["betas"] = (config["beta1"], config["beta2"])
        role = group.get("role") or ("decay" if all(p.dim() >= 2 for p in group["params"]) else "no_decay")
        if role == "decay":
            group["weight_decay"] = config["weight_decay"]


def schedule_horizon(cfg: TrainConfig) -> int:
    """The step the schedule ends at: `schedule_steps`, or `max_steps` when it is 0.

    Keeping it apart from `max_steps` lets a run stop part-way through its schedule and be continued: a run
    to step 4 of an 8-step horizon, resumed with `--max_steps 8`, takes the 8 steps of one straight run. A
    horizon shorter than `max_steps` is allowed: the steps past it train at the floor.
    """
    return cfg.schedule_steps or cfg.max_steps


def warmup_length(cfg: TrainConfig, horizon: float | None = None) -> float:
    """Steps of warm-up: `warmup_steps`; where it is unset (a time budget), `warmup_fraction` of the horizon, so
    that a budgeted run reaches its peak early and decays to its floor however fast the machine is. Until the first
    step is timed the horizon is the step cap, so those first updates take the smallest rates."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return cfg.warmup_fraction * min(schedule_horizon(cfg), horizon or math.inf)


def lr_multiplier(step: int, cfg: TrainConfig, horizon: float | None = None) -> float:
    """The learning rate of the update of step `step` (0-based: optimizer steps already taken), over the peak.

    Linear warm-up over `warmup_length` steps (the first update uses 1/warmup), then by `lr_schedule`, over the
    horizon H = `schedule_horizon(cfg)` with floor m = `min_lr_ratio`:

    - cosine: from 1 at the end of warm-up down to m at H (half a cosine period);
    - linear: from 1 down to m at H in equal steps;
    - wsd: warm-up, stable at 1, then the last `decay_fraction` of H (D = round(decay_fraction * H) steps, not
      before warm-up ends) decays linearly from 1 to m at H. Linear, not cosine or 1-sqrt: it is the shape of
      the WSD papers' default, and a decay whose length is a fixed share of the horizon can be started from
      any checkpoint of the stable phase, which is what makes the horizon extendable;
    - constant: 1 after warm-up, whatever H (m is unused).

    `horizon`, where given (a time budget's expected last step, `budget.TimeBudget.horizon`), replaces H when it
    comes first. At and past H every decaying schedule stays at m. `progress` is (steps since the decay began) over
    (decay length), so the first decayed update is at the peak and the value at H is m exactly, as the cosine always
    was.
    """
    warmup = warmup_length(cfg, horizon)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    horizon, floor = min(schedule_horizon(cfg), horizon or math.inf), cfg.min_lr_ratio
    if step >= horizon:
        return floor
    decay_start = warmup
    if cfg.lr_schedule == "wsd":
        decay_start = max(warmup, horizon - wsd_decay_steps(cfg, horizon))
        if step < decay_start:
            return 1.0
    progress = (step - decay_start) / max(1, horizon - decay_start)
    if cfg.lr_schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1 - floor) * progress  # linear, and wsd's decay


SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "lr_schedule", "schedule_steps", "max_steps", "min_lr_ratio",
                   "decay_fraction", "time_budget", "warmup_fraction")  # fmt: skip


def schedule_moved(cfg: TrainConfig, saved: dict[str, Any], step: int, budget: dict[str, float]) -> str | None:
    """What a resume at `step` with other schedule settings than the checkpoint's `saved` config does to the next
    update's rate, said with the way to keep the saved schedule; None where the rate is the same. A longer
    --max_steps moves a decaying schedule's end, so a finished run's floor jumps back up; so does a time budget
    dropped or changed. `budget`: the checkpoint's budget record (`TimeBudget.state`), from which a budget's horizon
    is what its clock computes right after a resume, for the saved settings and for these alike."""
    before = copy.copy(cfg)  # not validated again: the saved rate may not go with this config's other settings
    for name in SCHEDULE_FIELDS:
        setattr(before, name, saved.get(name, getattr(cfg, name)))
    old, new = (c.learning_rate * lr_multiplier(step, c, resumed_horizon(c, step, budget)) for c in (before, cfg))
    if math.isclose(old, new, rel_tol=1e-9):
        return None
    keep = ""
    horizon = resumed_horizon(before, step, budget) or schedule_horizon(before)
    if (
        horizon != schedule_horizon(cfg)
        and not (cfg.schedule_steps or cfg.time_budget)
        and cfg.lr_schedule != "constant"
    ):
        horizon = math.ceil(horizon)
        keep = f" (--schedule_steps {horizon} keeps its horizon: past step {horizon} the rate stays at the floor)"
    return (
        f"resume: the learning-rate schedule changed: step {step + 1} updates at {new:.3g}, where the checkpoint's "
        f"schedule gave {old:.3g}{keep}"
    )


def resumed_horizon(cfg: TrainConfig, step: int, budget: dict[str, float]) -> float | None:
    """The step `cfg`'s time budget ends at, as a clock resumed at `step` from the record `budget` first sees it
    (`TimeBudget.horizon`: the coming first step is not counted); None without a budget or a timed step."""
    seconds, per_step = cfg.budget_seconds(), budget.get("budget_per_step", 0.0)
    if not seconds or per_step <= 0:
        return None
    return step + 1 + max(0.0, seconds - budget.get("budget_spent", 0.0)) / per_step


def wsd_decay_steps(cfg: TrainConfig, horizon: float | None = None) -> int:
    """Steps of wsd's decay: `decay_fraction` of the horizon, rounded half up (at least 1)."""
    return max(1, math.floor(cfg.decay_fraction * (horizon or schedule_horizon(cfg)) + 0.5))


def muon_momentum(step: int, cfg: TrainConfig) -> float:
    """Muon's momentum for the update of step `step`: from `muon_momentum_start` up to `muon_momentum` in equal steps
    over `muon_momentum_warmup` steps (nanochat's warm-up: a low momentum while the weights move fast), then that."""
    warmup = cfg.muon_momentum_warmup
    if not warmup or step >= warmup:
        return cfg.muon_momentum
    return cfg.muon_momentum_start + (cfg.muon_momentum - cfg.muon_momentum_start) * step / warmup


class StepSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose only resumed state is the step: the rates (and Muon's momentum) come from this run's config,
    never the checkpoint's.

    A plain LambdaLR restores the saved `base_lrs` and last rate (and the optimizer restores each group's `lr`),
    so the first update after a resume would use the rate the old config computed, and a changed learning_rate
    would never apply. Recomputing from (step, config) gives the same floats when nothing changed (the same
    expression as `get_lr`), so an unchanged resume stays bit-identical.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, cfg: TrainConfig, horizon: Callable[[], float | None] | None = None
    ) -> None:
        self.cfg, self.horizon = cfg, horizon
        super().__init__(optimizer, lambda step: lr_multiplier(step, cfg, horizon() if horizon else None))

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._set_momentum()

    def load_state_dict(self, state_dict: dict) -> None:
        base_lrs = self.base_lrs
        super().load_state_dict(state_dict)
        self.base_lrs = base_lrs
        self.refresh()

    def refresh(self) -> None:
        """The rates of the restored step from this run's config (and time budget, restored after the schedule)."""
        self._last_lr = [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs, strict=True)]
        for group, base, lr in zip(self.optimizer.param_groups, self.base_lrs, self._last_lr, strict=True):
            group["initial_lr"], group["lr"] = base, lr
        self._set_momentum()

    def warmup(self) -> float:
        """The warm-up's length in steps, as the schedule now sees it (a budget's moves with its horizon)."""
        return warmup_length(self.cfg, self.horizon() if self.horizon else None)

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k not in ("cfg", "horizon")}  # this run's, not saved

    def _set_momentum(self) -> None:
        for group in self.optimizer.param_groups:
            if "betas" not in group:  # a Muon group
                group["momentum"] = muon_momentum(self.last_epoch, self.cfg)


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, horizon: Callable[[], float | None] | None = None
) -> StepSchedule:
    """The schedule over `lr_multiplier` (`horizon`: a time budget's). Build the Accelerator with
    `step_scheduler_with_optimizer=False`: a prepared scheduler otherwise steps once per process per optimizer step
    (W times too fast)."""
    return StepSchedule(optimizer, cfg, horizon)
