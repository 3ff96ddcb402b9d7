"""`run.py` with a record of the process group's threads at the very end of the process.

    accelerate launch --multi_gpu --num_processes 2 tests/workers/exit_threads.py CONTROL_DIR train ...flags

The threads that appear while the group forms (Gloo's transport loop and its worker threads) are noted; an exit
handler registered before the command, so run after every handler the command registers, writes which of them are
still alive to CONTROL_DIR/rank_{rank}.json. Alive there means the group would be freed only during the
interpreter's finalization, where a Gloo worker that needs the GIL aborts the process.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import accel_gpt.runtime as runtime
from accel_gpt.cli import main

control = Path(sys.argv[1])
group_threads: set[str] = set()


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def forming(*args, _form=runtime.PartialState, **kwargs):
    before = threads()
    state = _form(*args, **kwargs)
    group_threads.update(threads() - before)
    return state


def report() -> None:
    record = {"group_threads": len(group_threads), "alive": sorted(group_threads & threads())}
    (control / f"rank_{os.environ['RANK']}.json").write_text(json.dumps(record))


runtime.PartialState = forming
atexit.register(report)
if __name__ == "__main__":
    main(sys.argv[2:])
