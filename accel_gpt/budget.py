"""`--time_budget`: train for a length of time instead of a number of steps, the same on every rank.

What counts is the steps' own time: each optimizer step is timed on the host, from its first micro-batch to its
update. Start-up, the first step (it carries one-off work: lazy allocation, a compile's first trace), evaluations,
samples and checkpoint writes are not counted, and the final line says what was and what was not.

Every rank follows rank 0's clock: after each step rank 0's total is broadcast (one 8-byte collective), so all ranks
see the same spent time, stop after the same step and compute the same learning rate. Ranks on their own clocks
would drift apart by a step or more, and one would wait in a collective (an NCCL timeout) for another that had
already stopped. The broadcast is read on the host, so a budgeted GPU run gives up one step's overlap of the host
with the device.

The schedule follows the budget: its horizon is the step the budget is expected to end at, extrapolated from the
time per step so far (capped by `max_steps`/`schedule_steps`), so a cosine or wsd decay ends at the budget's end.
An unset warm-up is a fraction of that horizon (`optim.warmup_length`): with 715 steps, a 3-minute budget of 36
steps ended still warming up. A given `warmup_steps` counts steps. A checkpoint records the time spent, and a resume
continues with what is left.

What a budget cannot promise: the same steps on another run or machine. How many steps fit depends on the machine,
its load and the number of processes, so a budgeted run is not step-for-step reproducible, nor invariant to the
world size; its exact resume holds for the steps taken, from the recorded spent time on.
"""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING

from accel_gpt.errors import ConfigError, StartRefused

if TYPE_CHECKING:
    import torch

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
clock = time.perf_counter  # the clock steps are timed with


def parse_duration(text: str) -> float:
    """Seconds from `300`, `300s`, `5m` or `1.5h`; a budget of 0, a negative one, NaN or infinity is refused."""
    match = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([smh]?)\s*", text.lower())
    if match is None:
        raise ConfigError(f"time_budget={text!r} is not a duration: give seconds (300) or a unit (300s, 5m, 1.5h)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"time_budget={text!r} must be a positive, finite duration")
    return seconds


class TimeBudget:
    """The spent step time, agreed by all ranks; with no budget every method is a no-op and `done` is False."""

    def __init__(
        self, seconds: float | None, device: torch.device, num_processes: int, warmup_steps: int = 0, max_steps: int = 0
    ) -> None:
        self.seconds, self.device, self.num_processes = seconds, device, num_processes
        self.warmup_steps, self.max_steps = warmup_steps, max_steps  # for the warning of a budget inside warm-up
        self.spent = 0.0  # counted step time, this run and those it resumed
        self.resumed_spent = 0.0  # what the checkpoint resumed from had spent
        self.counted = 0  # steps counted since this start
        self.measured = 0  # the run's step when the spent time was last agreed
        self.per_step = 0.0  # a resumed run's time per step, until this start has counted one of its own
        self.first: float | None = None  # this start's first step's time: not counted
        self.started = self.began = 0.0  # this start's wall clock; this step's

    @property
    def on(self) -> bool:
        return self.seconds is not None

    @property
    def done(self) -> bool:
        return self.on and self.spent >= self.seconds

    def begin_step(self) -> None:
        if self.on:
            self.began = clock()
            self.started = self.started or self.began

    def end_step(self, step: int) -> None:
        """Count the step just taken, the run's `step`-th (all but this start's first), and agree on the total with
        rank 0."""
        if not self.on:
            return
        took = clock() - self.began
        self.measured = step
        if self.first is None:
            self.first = took
            return
        self.counted += 1
        before = self.spent
        self.spent = self._agreed(before + took)
        rank0_took = self.spent - before  # every rank decides alike
        if self.counted == 1 and not self.resumed_spent and rank0_took > self.seconds:
            raise StartRefused(
                f"time_budget={self.seconds:g}s is less than one step ({rank0_took:.3g}s here): give a longer budget, "
                "or train by steps with --max_steps"
            )
        if self.counted == 1:
            self._warn_if_inside_warmup()

    def _warn_if_inside_warmup(self) -> None:
        """Once the time per step is known: a budget that ends before its warm-up (and before max_steps, which would
        end it there anyway) never trains at its peak rate."""
        ends = self.horizon()
        if ends is None or ends >= self.warmup_steps or (self.max_steps and ends >= self.max_steps):
            return
        from accelerate.logging import get_logger  # not at import: a config's validation reads parse_duration

        get_logger(__name__).warning(
            f"time_budget={self.seconds:g}s: at {self.time_per_step():.3g}s per step it ends near step {ends:.0f}, "
            f"inside the {self.warmup_steps} warm-up steps, so the learning rate never reaches its peak: give a "
            "longer budget or fewer --warmup_steps"
        )

    def horizon(self) -> float | None:
        """The step the budget should end at, from the time per counted step so far; None before one is counted."""
        if not self.on or self.time_per_step() <= 0:
            return None
        uncounted = 1 if self.first is None else 0  # this start's first step is still to come and will not count
        return self.measured + uncounted + max(0.0, self.seconds - self.spent) / self.time_per_step()

    def time_per_step(self) -> float:
        return (self.spent - self.resumed_spent) / self.counted if self.counted else self.per_step

    def state(self) -> dict[str, float]:
        """What a checkpoint records: the time spent, and per step (the schedule's horizon right after a resume)."""
        return {"budget_spent": self.spent, "budget_per_step": self.time_per_step()}

    def resume(self, state: dict[str, float], step: int) -> None:
        """Continue a checkpoint's budget at its step `step` (a checkpoint saved without a budget spent none)."""
        self.spent = self.resumed_spent = float(state.get("budget_spent", 0.0))
        self.per_step, self.measured = float(state.get("budget_per_step", 0.0)), step

    def _agreed(self, spent: float) -> float:
        """Rank 0's value on every rank (a broadcast; nothing to agree on in one process)."""
        if self.num_processes == 1:
            return spent
        import torch
        from accelerate.utils import broadcast

        value = torch.tensor([spent], dtype=torch.float64, device=self.device)
        return float(broadcast(value, from_process=0).item())

    def summary(self) -> str:
        """What the final line says of the budget: the time counted, and what was not."""
        if not self.on:
            return ""
        wall = clock() - self.started if self.started else 0.0
        first = self.first or 0.0
        others = max(0.0, wall - first - (self.spent - self.resumed_spent))
        return (
            f"time budget {self.seconds:g}s: {self.spent:.1f}s of step time counted ({self.counted:,} steps this "
            f"start); not counted: the first step's {first:.1f}s and {others:.1f}s of evaluations, samples, "
            "logging and checkpoints"
        )
