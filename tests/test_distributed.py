"""The launched processes form one group, or the run stops with a clear error."""

from __future__ import annotations

import re

from conftest import accelerate_cmd, run_cmd


def _launch(*worker_args: str, **env: str):
    launch = accelerate_cmd(2, "x")[:-2]  # the launcher prefix, without "run.py x"
    return run_cmd([*launch, "tests/workers/group_check.py", *worker_args], check=False, timeout=180, **env)


def test_cpu_processes_form_one_group() -> None:
    proc = _launch()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d+) num_processes=(\d+)", proc.stdout)) == [("0", "2"), ("1", "2")]


def test_group_smaller_than_launch_is_refused() -> None:
    """Without the CPU flag on a GPU-less machine, accelerate hands each process a 1-process state."""
    proc = _launch("--pretend-gpu", ACCELERATE_USE_CPU="0")
    assert proc.returncode != 0
    assert "launched 2 processes (WORLD_SIZE) but the Accelerator formed a group of 1" in proc.stderr
