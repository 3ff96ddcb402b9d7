"""`run.py train` with test controls that let a test interrupt it at an exact point.

    python tests/workers/interrupted_train.py CONTROL_DIR [--pause_at N] [--pause_in_save N] [--die_once_at N]
        [--die_at CALL:RANK,...] [--late_after_restart SECONDS] -- train flags...

Counts are per process, from 1: call N of `train_step` is the N-th optimizer step this process runs.

- `--pause_at N`: rank 0 writes CONTROL_DIR/paused before its N-th step and waits until CONTROL_DIR/release
  exists. The test then SIGKILLs or SIGTERMs the process group at a known step instead of racing the loop.
- `--pause_in_save N`: rank 0 writes CONTROL_DIR/paused once the N-th `save_state` has written its files into
  the temporary folder, before the checkpoint is published, and waits the same way (a kill "while saving").
- `--die_once_at N`: the last rank SIGKILLs itself before its N-th step, unless CONTROL_DIR/died exists (it is
  written first), so an elastic restart of the group runs through.
- `--die_at CALL:RANK,...`: one kill per attempt of an elastic group: in attempt i (torchrun's
  TORCHELASTIC_RESTART_COUNT) the i-th entry's rank SIGKILLs itself before its CALL-th step, after writing
  CONTROL_DIR/died_{i}; attempts beyond the list run through.
- `--late_after_restart SECONDS`: in a restarted group the last rank waits SECONDS before starting, so the other
  ranks form the group first: the moment at which a store that kept the failed group's addresses fails them.

Each process writes CONTROL_DIR/pid_{rank}: torchrun starts every worker in its own session, so a test that
means to kill "everything" must signal the workers' process groups as well as the launcher's.

Everything else is the real trainer: `accel_gpt.cli.main(["train", ...])`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import accelerate

import accel_gpt.train as train_module
from accel_gpt.cli import main


def wait_for_release(control: Path) -> None:
    (control / "paused").write_text(str(os.getpid()))
    while not (control / "release").exists():
        time.sleep(0.01)


def kill_plan(die_at: str, attempt: int) -> tuple[int, int] | None:
    """(call, rank) of this attempt's kill in a `--die_at` list, or None."""
    entries = [tuple(int(n) for n in entry.split(":")) for entry in die_at.split(",") if entry]
    return entries[attempt] if attempt < len(entries) else None


def wrap_train_step(args: argparse.Namespace, rank: int, world_size: int) -> None:
    original = train_module.train_step
    calls = 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    plan = kill_plan(args.die_at, attempt)

    def train_step(*a, **kw):
        nonlocal calls
        calls += 1
        if calls == args.pause_at and rank == 0:
            wait_for_release(args.control)
        if calls == args.die_once_at and rank == world_size - 1 and not (args.control / "died").exists():
            (args.control / "died").write_text(f"rank {rank} step call {calls}")
            os.kill(os.getpid(), signal.SIGKILL)
        if plan == (calls, rank):
            (args.control / f"died_{attempt}").write_text(f"rank {rank} step call {calls}")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*a, **kw)

    train_module.train_step = train_step


def wrap_save_state(args: argparse.Namespace, rank: int) -> None:
    original = accelerate.Accelerator.save_state
    calls = 0

    def save_state(self, *a, **kw):
        nonlocal calls
        calls += 1
        out = original(self, *a, **kw)
        if calls == args.pause_in_save and rank == 0:
            wait_for_release(args.control)
        return out

    accelerate.Accelerator.save_state = save_state


if __name__ == "__main__":
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("control", type=Path)
    parser.add_argument("--pause_at", type=int, default=0)
    parser.add_argument("--pause_in_save", type=int, default=0)
    parser.add_argument("--die_once_at", type=int, default=0)
    parser.add_argument("--die_at", default="")
    parser.add_argument("--late_after_restart", type=float, default=0.0)
    args = parser.parse_args(sys.argv[1:split])
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == world_size - 1 > 0 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        time.sleep(args.late_after_restart)
    (args.control / f"pid_{rank}").write_text(str(os.getpid()))
    wrap_train_step(args, rank, world_size)
    wrap_save_state(args, rank)
    main(["train", *sys.argv[split + 1 :]])
