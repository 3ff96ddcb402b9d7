"""The runtime settings a run may leave to `auto`: mixed precision, compilation and CPU threads, resolved once at start.

Each choice is a pure function of the device's class, the model's size and the settings (precision.py, threads.py);
this module gathers what they need, applies them, and writes the resolved values back into the config, so that
config.yaml and every checkpoint record what the run did: a resume, a second process and an export then see the same
as if the flags had been given by hand.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accel_gpt.checkpoint import complete_checkpoints, saved_state
from accel_gpt.config import TrainConfig
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.precision import Capability, Choice, Workload, choose_compile, choose_mixed_precision
from accel_gpt.threads import Threads, busy_note, choose_threads, local_processes, usable_cpus


@dataclass
class RunChoices:
    """What the run resolved, with the reasons the start-up line gives."""

    precision: Choice
    compile: Choice | None = None
    threads: Threads | None = None  # CPU runs only

    def describe(self) -> str:
        parts = [f"mixed precision {self.precision.value} ({self.precision.why})"]
        if self.compile is not None:
            parts.append(f"{'compiled' if self.compile.value else 'not compiled'} ({self.compile.why})")
        if self.threads is not None:
            parts.append(self.threads.describe())
        return ", ".join(parts)


def resumed_config(cfg: TrainConfig) -> dict[str, Any]:
    """The config and step of the checkpoint this run will resume from, read early (before the Accelerator exists,
    which needs the precision); {} for a new run or where it cannot be read (the resume itself then says why)."""
    if cfg.resume == "none":
        return {}
    try:  # quietly: the resume itself warns of incomplete checkpoints, once the Accelerator can log
        done = complete_checkpoints(cfg.out_dir) if cfg.resume == "auto" else [Path(cfg.resume)]
        if not done:
            return {}
        state = saved_state(done[-1])
    except Exception:  # noqa: BLE001 - any damage is the resume's to report, in its own words
        return {}
    return {**state.config, "step": state.step}


def choose_precision(cfg: TrainConfig, capability: Capability, resumed: dict[str, Any]) -> Choice:
    """`mixed_precision` for this device; recorded into `cfg`."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION") or None
    was = resumed.get("mixed_precision")
    was = "no" if was == "auto" else was  # saved before auto chose by device: without a launch's, that was fp32
    choice = choose_mixed_precision(cfg.mixed_precision, launched, capability, cfg.n_embd, was)
    cfg.mixed_precision = str(choice.value)
    return choice


def apply_threads(device: torch.device) -> Threads | None:
    """Set this process's CPU threads (a CPU run only: a GPU's host threads are torch's to size)."""
    if device.type != "cpu":
        return None
    cpus = usable_cpus()
    threads = choose_threads(os.environ, cpus, local_processes())
    torch.set_num_threads(threads.count)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return dataclasses.replace(threads, note=busy_note(threads.count, cpus, load))


def choose_compiling(
    cfg: TrainConfig, capability: Capability, num_processes: int, resumed: dict[str, Any], threads: Threads | None
) -> Choice:
    """`compile` for this run's remaining work; recorded into `cfg`."""
    steps_left = max(0, cfg.max_steps - int(resumed.get("step", 0)))
    budget = cfg.budget_seconds()
    work = Workload(
        steps=steps_left,
        step_flops=cfg.total_batch_size / num_processes * flops_per_token(cfg),
        n_layer=cfg.n_layer,
        threads=threads.count if threads else 1,
        budget_seconds=budget,
    )
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() not in ("no", "")
    choice = choose_compile(cfg.compile, capability, cfg.mixed_precision, work, launch_compiles=dynamo)
    cfg.compile = bool(choice.value)
    return choice


def flops_per_token(cfg: TrainConfig) -> int:
    """Training FLOPs per token of the model `cfg` describes, without allocating it."""
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg.model_settings())).flops_per_token()
