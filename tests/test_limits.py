"""Limits a process lives under besides the machine's: its cgroups' memory limit (v1, v2, nested) and its ulimits,
read for the memory check (the CPU quota's own tests are in test_choices.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, python_cmd, run_cmd, subprocess_env
from test_choices import fake_root

from accel_gpt.limits import cgroup_memory_room

GB = 10**9


@pytest.mark.parametrize(
    ("cgroup", "files", "room"),
    [
        ("0::/job\n", {"job/memory.max": "max\n", "job/memory.current": "5"}, None),  # v2, no limit
        ("0::/job\n", {"job/memory.max": f"{4 * GB}\n", "job/memory.current": f"{GB}\n"}, 3 * GB),  # docker -m 4g
        (
            "0::/a/b\n",
            {"a/b/memory.max": "max", "a/b/memory.current": "10", "a/memory.max": f"{2 * GB}", "a/memory.current": "0"},
            2 * GB,
        ),  # a parent's limit holds (a SLURM job's, around its steps)
        ("0::/\n", {"memory.max": f"{GB}", "memory.current": f"{GB // 4}"}, GB - GB // 4),  # a container's own root
        (
            "9:memory:/slurm/job_7\n",
            {"memory/slurm/job_7/memory.limit_in_bytes": f"{8 * GB}", "memory/slurm/job_7/memory.usage_in_bytes": "0"},
            8 * GB,
        ),  # cgroup v1
        ("9:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),  # v1's "no limit"
        ("0::/job\n", {"job/memory.max": f"{GB}", "job/memory.current": f"{2 * GB}"}, 0),  # over its limit already
        ("", {}, None),  # no cgroups at all
    ],
)
def test_the_cgroup_memory_room_is_read_from_v1_and_v2(tmp_path: Path, cgroup: str, files: dict, room) -> None:
    assert cgroup_memory_room(fake_root(tmp_path, cgroup, files)) == room


def test_a_ulimit_on_memory_is_the_room_left_under_it() -> None:
    """`ulimit -v` (RLIMIT_AS) caps what the process may map: the room is the limit less what it maps already."""
    code = (
        "import resource; from accel_gpt.limits import rlimit_memory_room; "
        "size = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024; "
        "resource.setrlimit(resource.RLIMIT_AS, (size + 500_000_000, resource.RLIM_INFINITY)); "
        "print(rlimit_memory_room())"
    )
    free = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert 400_000_000 < int(free.stdout) <= 500_000_000, free.stderr
    code = "from accel_gpt.limits import rlimit_memory_room; print(rlimit_memory_room())"
    unlimited = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True)
    assert unlimited.stdout.strip() == b"None"


@pytest.mark.slow
def test_a_run_over_its_ulimit_is_refused_in_one_line(tmp_path: Path, tiny_run: Path) -> None:
    """A run whose estimate is over what `ulimit -v` leaves is refused before it allocates, in one line (before: the
    allocator's RuntimeError in the first step)."""
    data = next(line.split(": ", 1)[1] for line in (tiny_run / "config.yaml").read_text().splitlines()
                if line.startswith("data_dir:"))  # fmt: skip
    flags = ["--n_layer", "1", "--n_head", "2", "--n_embd", "64", "--seq_len", "64", "--micro_batch_size", "64"]
    flags += ["--total_batch_size", "4096", "--max_steps", "1", "--log_with", "none"]
    train = " ".join(python_cmd("train", *flags, "--data_dir", data, "--out_dir", str(tmp_path / "r")))
    run_cmd(["bash", "-c", train])  # no limit: it runs
    probe = "import torch, accel_gpt.train; print(open('/proc/self/status').read().split('VmSize:')[1].split()[0])"
    mapped = int(run_cmd([sys.executable, "-c", probe]).stdout)  # kB a started trainer maps before its run
    limited = run_cmd(["bash", "-c", f"ulimit -v {mapped + 300_000}; {train} --overwrite true"], check=False)
    lines = [line for line in limited.stderr.splitlines() if line.startswith("error:")]
    assert limited.returncode == 2 and len(lines) == 1 and "(its ulimit (ulimit -v or -d))" in lines[0], limited.stderr[
        -2000:
    ]


@pytest.mark.slow
def test_data_loader_workers_under_a_low_open_file_limit_are_refused_in_one_line(
    tmp_path: Path, tiny_run: Path
) -> None:
    """`ulimit -n 40` with 2 workers: measured, a worker then dies and the run waits for it (or a traceback from the
    worker's start); now one line before the data is opened. Without workers the same limit trains."""
    data = next(line.split(": ", 1)[1] for line in (tiny_run / "config.yaml").read_text().splitlines()
                if line.startswith("data_dir:"))  # fmt: skip
    flags = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "32", "--micro_batch_size", "2"]
    flags += ["--total_batch_size", "64", "--max_steps", "1", "--log_with", "none", "--data_dir", data]
    train = " ".join(python_cmd("train", *flags, "--out_dir", str(tmp_path / "r")))
    refused = run_cmd(["bash", "-c", f"ulimit -n 40; {train} --num_workers 2"], check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "error: the open-file limit (ulimit -n) is 40, and 2 DataLoader worker(s) (they pass batches through file "
        "descriptors; below that a worker dies and the run waits for it) need at least 64: raise it (ulimit -n 1024) "
        "or give --num_workers 0"
    )
    run_cmd(["bash", "-c", f"ulimit -n 40; {train} --overwrite true"])


@pytest.mark.slow
def test_a_group_under_a_low_open_file_limit_is_refused_in_one_line(tmp_path: Path, tiny_run: Path) -> None:
    """`ulimit -n 14` and 2 processes, no workers: measured, the group's store sockets got EMFILE and every rank
    retried for 15 minutes; now one line before the group forms, for train and eval alike (torchrun here; `accelerate
    launch` launches the same way)."""
    data = next(line.split(": ", 1)[1] for line in (tiny_run / "config.yaml").read_text().splitlines()
                if line.startswith("data_dir:"))  # fmt: skip
    commands = {
        "train": ["train", "--config", "tiny-cpu", "--max_steps", "1", "--log_with", "none", "--data_dir", data,
                  "--out_dir", str(tmp_path / "r")],
        "eval": ["eval", "--checkpoint", str(tiny_run), "--data_dir", data, "--eval_windows", "2"],
    }  # fmt: skip
    ranks = tmp_path / "limited_rank.sh"  # the limit on the ranks alone: a launcher under it may fail on its own
    ranks.write_text(f'#!/bin/bash\nulimit -n 14\nexec {sys.executable} run.py "$@"\n')
    ranks.chmod(0o755)
    for name, args in commands.items():
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        refused = run_cmd([*launch, "--no-python", str(ranks), *args], check=False, timeout=120)
        lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert lines == [
            "error: the open-file limit (ulimit -n) is 14, and a group of 2 processes (each holds sockets to the "
            "others; below that the group never forms, and every rank waits for it) need at least 28: raise it "
            "(ulimit -n 1024)"
        ], (name, refused.stderr[-3000:])
        assert refused.returncode != 0 and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_file_size_limit_is_named_before_the_run_and_at_a_write(tmp_path: Path, tiny_run: Path) -> None:
    """`ulimit -f` below a checkpoint's optimizer.bin: before, the first save died in a torch traceback ("iostream
    error") and left its half-written folder. Now train refuses at start in one line naming the limit; a write that
    still meets it (a save under a limit the estimate missed) is one line too, and prepare's names the limit, not
    the disk."""
    data = next(line.split(": ", 1)[1] for line in (tiny_run / "config.yaml").read_text().splitlines()
                if line.startswith("data_dir:"))  # fmt: skip
    train = " ".join(python_cmd("train", "--config", "tiny-cpu", "--max_steps", "2", "--log_with", "none",
                                "--data_dir", data, "--out_dir", str(tmp_path / "r")))  # fmt: skip
    limited = run_cmd(["bash", "-c", f"ulimit -f 4000; {train}"], check=False)  # 4 MB; optimizer.bin is 26.6 MB
    lines = [line for line in limited.stderr.splitlines() if line.startswith("error:")]
    assert limited.returncode == 2 and len(lines) == 1, limited.stderr[-2000:]
    assert "(a checkpoint's optimizer.bin), over the file size limit (ulimit -f: 4.1 MB)" in lines[0], lines
    save = (
        "import resource, torch; from pathlib import Path; from accel_gpt.files import write_failure;"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.RLIM_INFINITY));"
        f"print(write_failure(Path('{tmp_path}'), lambda: torch.save(torch.zeros(10**6), '{tmp_path}/big.pt'), 4e6))"
    )
    said = run_cmd([sys.executable, "-c", save]).stdout.strip()
    assert said == "a file reached the file size limit (ulimit -f: 1.0 MB); raise it (ulimit -f unlimited)", said
    text = tmp_path / "text.txt"
    text.write_text("words and more words\n\n" * 2000)
    cases = ((8, "d1", "writing the datasets cache"), (None, "d2", None), (8, "d3", "finished shard(s) kept: raise it"))
    for limit, out, said in cases:
        prepare = " ".join(python_cmd("prepare", "--dataset", str(text), "--out_dir", str(tmp_path / out)))
        if limit is None:  # the datasets cache holds the text now: the next limited prepare fails at its shards
            run_cmd(["bash", "-c", prepare])
            continue
        limited = run_cmd(["bash", "-c", f"ulimit -f {limit}; {prepare}"], check=False)
        lines = [line for line in limited.stderr.splitlines() if line.startswith("error:")]
        assert limited.returncode == 2 and len(lines) == 1, limited.stderr[-2000:]
        assert "a file reached the file size limit (ulimit -f: 8 kB)" in lines[0] and said in lines[0], lines
        assert "make room" not in lines[0], lines
