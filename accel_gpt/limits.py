"""The limits a process lives under besides the machine's: its cgroups' CPU quota and memory limit (v1 or v2, its
own cgroup and every one above it: a container, a SLURM job, a systemd slice) and the ulimits that cap its memory,
its open files and the size of the files it writes.

Why: the machine's core count and free memory are not this process's to use when a container or a job scheduler
gives it less. The thread count (`threads.py`) and the memory check (`memory.py`) read them here; each function
takes a `root` (a fake /proc and /sys in tests).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path

# A v1 memory limit at or above this is cgroup v1's way of saying "none" (the largest page-aligned 64-bit value).
_V1_NO_LIMIT = 1 << 60


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """CPUs' worth of time per period that this process's cgroups allow (the smallest on its path), or None for no
    limit. cgroup v2: `cpu.max` ("max 100000", or "200000 100000" for two CPUs); v1: `cpu.cfs_quota_us` over
    `cpu.cfs_period_us` (-1: none)."""
    found = [q for q in _on_path(root, "cpu", _v2_cpu, _v1_cpu) if q is not None]
    return min(found) if found else None


def cgroup_memory_room(root: Path = Path("/")) -> int | None:
    """Bytes this process's cgroups still allow (limit less usage, the smallest on its path), or None for no limit.
    cgroup v2: `memory.max` less `memory.current`; v1: `memory.limit_in_bytes` less `memory.usage_in_bytes`."""
    found = [room for room in _on_path(root, "memory", _v2_memory, _v1_memory) if room is not None]
    return max(0, min(found)) if found else None


def rlimit_memory_room(status: Path = Path("/proc/self/status")) -> int | None:
    """Bytes the process may still map under its ulimits (`ulimit -v`: RLIMIT_AS against VmSize; `ulimit -d`:
    RLIMIT_DATA against VmData), or None where neither is set."""
    text = _read(status)
    rooms = []
    for limit, key in ((resource.RLIMIT_AS, "VmSize:"), (resource.RLIMIT_DATA, "VmData:")):
        soft, _ = resource.getrlimit(limit)
        used = next((int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith(key)), None)
        if soft != resource.RLIM_INFINITY and used is not None:
            rooms.append(max(0, soft - used))
    return min(rooms) if rooms else None


def open_files_needed(workers: int, processes: int = 1) -> int:
    """Descriptors a process needs at least, with `workers` DataLoader workers in a group of `processes`. Measured on
    tiny-cpu: with 2 workers, `ulimit -n` 12 failed at start (EMFILE), 16 in a worker's start, 20 left a worker dead
    and the run waiting for it; 30 trained: twice that, and more per worker (each passes its batches through
    shared-memory descriptors). A group of 2 CPU processes: 14 never formed (the store's sockets got EMFILE and every
    rank retried for 15 minutes), 18 trained; each rank holds sockets to the others, so the need grows with the group.
    """
    group = 24 + 2 * processes if processes > 1 else 0
    return group + (32 + 16 * workers if workers else 0)


def check_open_files(workers: int, processes: int = 1) -> str | None:
    """Why `ulimit -n` is too low for `workers` DataLoader workers in a group of `processes`, or None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_files_needed(workers, processes)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    why = []
    if processes > 1:
        why.append(f"a group of {processes} processes (each holds sockets to the others; below that the group never "
                   "forms, and every rank waits for it)")  # fmt: skip
    if workers:
        why.append(f"{workers} DataLoader worker(s) (they pass batches through file descriptors; below that a worker "
                   "dies and the run waits for it)")  # fmt: skip
    fix = " or give --num_workers 0" if workers else ""
    return (
        f"the open-file limit (ulimit -n) is {soft}, and {' with '.join(why)} need at least {need}: raise it "
        f"(ulimit -n 1024){fix}"
    )


def file_size_limit() -> int | None:
    """The largest file this process may write (`ulimit -f`: RLIMIT_FSIZE), or None where there is no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def check_file_size(largest: int, name: str) -> str | None:
    """Why `ulimit -f` stops a run whose largest file (`name`) is about `largest` bytes, or None where it does not:
    said before the run, not after it has trained up to its first save."""
    limit = file_size_limit()
    if limit is None or largest <= limit:
        return None
    return (
        f"this run writes files of about {_mb(largest)} ({name}), over the file size limit (ulimit -f: {_mb(limit)}):"
        " raise it (ulimit -f unlimited)"
    )


def file_size_reason(limit: int) -> str:
    return f"a file reached the file size limit (ulimit -f: {_mb(limit)}); raise it (ulimit -f unlimited)"


def _mb(size: int) -> str:
    return f"{size / 1e6:,.1f} MB" if size >= 1e6 else f"{size / 1e3:,.0f} kB"


def _on_path(root: Path, controller: str, v2: Callable[[Path], float | None], v1: Callable[[Path], float | None]):
    """`v2` or `v1` of each folder of this process's cgroup and those above it, for `controller`."""
    values = []
    for line in _read(root / "proc/self/cgroup").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hierarchy:
            continue
        if controllers == "":  # v2: one unified hierarchy
            values += [v2(folder) for folder in _folders(root / "sys/fs/cgroup", path)]
        elif controller in controllers.split(","):  # v1: the controller's own hierarchy
            mounts = ("cpu,cpuacct", "cpu", "cpuacct,cpu") if controller == "cpu" else (controller,)
            for mount in mounts:
                base = root / "sys/fs/cgroup" / mount
                if base.is_dir():
                    values += [v1(folder) for folder in _folders(base, path)]
                    break
    return values


def _folders(base: Path, path: str) -> list[Path]:
    """The cgroup's folder and those above it, under `base`; inside a container the cgroup is often mounted as
    the root itself, so `base` counts too."""
    parts = [p for p in path.strip("/").split("/") if p]
    folders = [base.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)]
    return [*folders, base]


def _v2_cpu(folder: Path) -> float | None:
    fields = _read(folder / "cpu.max").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        return int(fields[0]) / int(fields[1])
    except (ValueError, ZeroDivisionError):
        return None


def _v1_cpu(folder: Path) -> float | None:
    try:
        quota = int(_read(folder / "cpu.cfs_quota_us").strip())
        period = int(_read(folder / "cpu.cfs_period_us").strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v2_memory(folder: Path) -> int | None:
    return _room(_read(folder / "memory.max"), _read(folder / "memory.current"))


def _v1_memory(folder: Path) -> int | None:
    return _room(_read(folder / "memory.limit_in_bytes"), _read(folder / "memory.usage_in_bytes"))


def _room(limit: str, usage: str) -> int | None:
    try:
        cap = int(limit.strip())
    except ValueError:  # "max", or no such file at this level
        return None
    if cap >= _V1_NO_LIMIT:
        return None
    try:
        return cap - int(usage.strip())
    except ValueError:
        return cap


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
