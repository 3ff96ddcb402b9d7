"""The launched processes form one group, or the run stops with a clear error; the group is freed before exit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("ending", ["finished", "failed"])
def test_group_threads_are_gone_before_the_interpreter_finalizes(
    tmp_path: Path, shakespeare_shards: Path, ending: str
) -> None:
    """A W=2 run frees its group in an exit handler, not in finalization's garbage collection, where a Gloo worker
    still freeing a collective's tensors aborted the process (SIGABRT after a finished run, now and then); also
    when the run stops on an error after the group formed (every rank agrees on it through a collective, then exits)."""
    flags = ["--config", "tiny-cpu", "--max_steps", "2", "--micro_batch_size", "2", "--eval_every", "2"]
    flags += ["--eval_windows", "4", "--sample_tokens", "0", "--log_with", "none"]
    flags += ["--data_dir", str(shakespeare_shards), "--out_dir", str(tmp_path / "run")]
    if ending == "failed":
        flags += ["--resume", str(tmp_path / "no_such_checkpoint")]
    launch = accelerate_cmd(2, "x")[:-2]  # the launcher prefix, without "run.py x"
    proc = run_cmd([*launch, "tests/workers/exit_threads.py", str(tmp_path), "train", *flags], check=False)
    if ending == "finished":
        assert proc.returncode == 0 and "2 process(es) on cpu" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode != 0 and "error: resume checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert record["group_threads"] >= 2, record  # the transport loop and at least one worker
        assert record["alive"] == [], record
