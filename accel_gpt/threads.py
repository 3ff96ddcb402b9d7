"""How many threads a CPU process computes with: the CPUs it may use, shared among the processes of its machine.

Why: torch sizes its pool from the host's cores, but a process may be held to fewer (a CPU affinity mask from
`taskset`, SLURM or a container; a cgroup's CPU quota from docker `--cpus`, Kubernetes or systemd), and the processes
of one launch share them. More busy threads than CPUs is the slow case: on a loaded 2-core machine the quick start
took 2.5 min on torch's default threads against 30 s on one. `OMP_NUM_THREADS`, set by the user or the launcher
(torchrun sets 1 for several processes per machine), always wins.

One thread is not faster for small models when the CPUs are free: on an idle 2-vCPU AVX2 EPYC, two threads beat
one from a near-empty model (1 layer, 16 wide: 248 against 277 us a token) to tiny-cpu (92 against 119), so no size
is given one thread (bench/RESULTS.md, "Threads"). A busy machine is another matter: the start-up line says so.
The count changes the order of float sums, so a run's losses repeat only at the same count: the start-up line names
it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from accel_gpt.limits import cgroup_cpu_quota


@dataclass(frozen=True)
class Threads:
    """The count a process computes with, and why (the start-up line)."""

    count: int
    why: str
    note: str | None = None  # a busy machine (`busy_note`)

    def describe(self) -> str:
        note = f"; {self.note}" if self.note else ""
        return f"{self.count} thread{'s' if self.count != 1 else ''} ({self.why}{note})"


def choose_threads(env: Mapping[str, str], usable_cpus: int, local_processes: int) -> Threads:
    """The thread count of one process: `OMP_NUM_THREADS` where set, else its share of `usable_cpus` among the
    `local_processes` of its machine (at least one)."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return Threads(int(given), "OMP_NUM_THREADS")
    why = f"{usable_cpus} usable CPU{'s' if usable_cpus != 1 else ''}"
    if local_processes > 1:
        why += f" / {local_processes} processes on this machine"
    return Threads(max(1, usable_cpus // max(1, local_processes)), why)


def busy_note(threads: int, usable_cpus: int, load: float) -> str | None:
    """A machine already busy (a 1-minute load average of `load` on `usable_cpus`) leaves these threads waiting on
    each other: the quick start took 2.5 min on 2 threads of a loaded 2-core machine, 30 s on one."""
    if threads < 2 or load < usable_cpus:
        return None
    return f"the machine is busy, load {load:.1f}: OMP_NUM_THREADS=1 is faster while it lasts"


def usable_cpus(root: Path = Path("/"), affinity: int | None = None) -> int:
    """The CPUs this process may run on: its affinity mask, capped by the CPU quota of its cgroup (v2 or v1) and of
    every cgroup above it. `root` and `affinity` are for tests (a fake /proc and /sys, a mask's size)."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root)
    return max(1, min(affinity, math.floor(quota) if quota is not None else affinity))


def local_processes(env: Mapping[str, str] = os.environ) -> int:
    """This launch's processes on this machine (torchrun's LOCAL_WORLD_SIZE; 1 where no launcher set it)."""
    value = env.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1
