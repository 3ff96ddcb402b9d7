"""`run.py train` whose time budget reads a clock the test controls, and which records every rank's learning rates.

    accelerate launch ... tests/workers/budget_clock.py CONTROL_DIR STEP_SECONDS [DIE_AT] -- train flags...

- The budget's clock (`accel_gpt.budget.clock`) advances STEP_SECONDS * (rank + 1) at each reading, so
  each step takes exactly that long on its rank: rank 1's clock runs twice as fast as rank 0's, and only agreeing on
  rank 0's keeps the ranks together.
- Each rank writes the learning rate of every step it took, in order, to CONTROL_DIR/rank_{rank}.json at exit.
- DIE_AT N: every rank SIGKILLs itself before its N-th step of the first attempt (CONTROL_DIR/died_{rank} marks
  it done).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import sys
from pathlib import Path

import accel_gpt.budget as budget
import accel_gpt.train as train_module
from accel_gpt.cli import main

control, step_seconds = Path(sys.argv[1]), float(sys.argv[2])
die_at = int(sys.argv[3]) if sys.argv[3] != "--" else 0
rank = int(os.environ.get("RANK", "0"))
ticks = itertools.count()
budget.clock = lambda: next(ticks) * step_seconds * (rank + 1)

rates: list[float] = []
original = train_module.train_step


def train_step(run, *args, **kwargs):
    if die_at and len(rates) + 1 == die_at and not (control / f"died_{rank}").exists():
        (control / f"died_{rank}").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    rates.append(run.scheduler.get_last_lr()[0])
    return original(run, *args, **kwargs)


train_module.train_step = train_step
atexit.register(lambda: (control / f"rank_{rank}.json").write_text(json.dumps(rates)))
main(sys.argv[sys.argv.index("--") + 1 :])
