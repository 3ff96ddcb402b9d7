"""The launched processes form one group, or the run stops with a clear error; the group is freed before exit; only
the main process writes and prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import HELLASWAG, accelerate_cmd, run_cmd


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


def _audited(tmp_path: Path, name: str, *command: str) -> list[dict]:
    """Launch `run.py COMMAND` on 2 processes under tests/workers/rank_audit.py; each rank's record of what it wrote
    under tmp_path/"work" and printed."""
    record = tmp_path / name
    record.mkdir()
    launch = accelerate_cmd(2, "x")[:-2]  # the launcher prefix, without "run.py x"
    worker = [*launch, "tests/workers/rank_audit.py", str(record), str(tmp_path / "work"), "--", *command]
    run_cmd(worker, timeout=240)
    return [json.loads((record / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_only_the_main_process_writes_files_and_prints(tmp_path: Path, shakespeare_shards: Path) -> None:
    """Main-process gating under W=2, through a run that evaluates, scores HellaSwag, samples, checkpoints, finishes,
    resumes and is evaluated: rank 1 writes nothing but its own RNG state into a checkpoint's folder (as every rank
    must: `save_state` makes that folder on every rank and records each rank's RNG) and prints nothing at all, while
    rank 0 writes the run and prints the progress; each rank reads only its share of the evaluation sets."""
    run, preds = tmp_path / "work" / "run", tmp_path / "work" / "preds.jsonl"
    flags = ["--config", "tiny-cpu", "--micro_batch_size", "2", "--eval_every", "2", "--eval_windows", "4"]
    flags += ["--save_every", "2", "--hellaswag", str(HELLASWAG), "--hellaswag_every", "4", "--hellaswag_limit", "6"]
    flags += ["--sample_tokens", "4", "--log_with", "none", "--data_dir", str(shakespeare_shards)]
    flags += ["--out_dir", str(run)]
    records = {
        "train": _audited(tmp_path, "train", "train", *flags, "--max_steps", "4"),
        "resume": _audited(tmp_path, "resume", "train", *flags, "--max_steps", "6", "--resume", "auto"),
        "eval": _audited(tmp_path, "eval", "eval", "--checkpoint", str(run), "--hellaswag", str(HELLASWAG), "--limit",
                         "8", "--data_dir", str(shakespeare_shards), "--eval_windows", "4", "--out", str(preds)),
    }  # fmt: skip
    assert json.loads(records["eval"][0]["stdout"])["num_processes"] == 2
    for name, (rank0, rank1) in records.items():
        assert "2 process(es) on cpu" in rank0["stderr"] or name == "eval", rank0["stderr"][-2000:]
        assert rank1["stdout"] == rank1["stderr"] == "", (name, rank1["stdout"][-2000:], rank1["stderr"][-2000:])
        own = re.compile(re.escape(str(run / "checkpoints")) + r"/\.tmp-step_\d{8}(/random_states_1\.pkl)?")
        assert all(own.fullmatch(path) for _, *paths in rank1["writes"] for path in paths), (name, rank1["writes"])
        assert any(path.endswith("random_states_1.pkl") for _, path in rank1["writes"]) == (name != "eval")
        assert any(path == str(run / "model.safetensors") for _, *paths in rank0["writes"] for path in paths) == (
            name != "eval"
        )
    assert "HellaSwag at step 4" in records["train"][0]["stderr"] and preds.exists()
    # each rank scored its own share of the val windows and HellaSwag rows, and together they scored each once
    reads = [rank["read"] for rank in records["eval"]]
    for name, count in (("val", 4), ("hellaswag", 8)):
        assert all(r[name] for r in reads) and sorted(reads[0][name] + reads[1][name]) == list(range(count)), reads
    zero, one = (rank["read"]["val"] for rank in records["train"])  # its evaluations at steps 2 and 4, alike
    assert not set(zero) & set(one) and sorted(zero + one) == sorted(list(range(4)) * 2), (zero, one)
