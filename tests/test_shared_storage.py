"""One out_dir for every process: two "machines" on localhost whose out_dirs are each their own folder are refused
at start in one line (no hang); at resume every rank must find the same checkpoint with every part in it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, _free_port, accelerate_cmd, run_cmd, subprocess_env, write_token_shards

from accel_gpt.shared_storage import FIX, View, agreement

VOCAB = 256
FLAGS = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--seq_len", "16", "--vocab_size", str(VOCAB)]
FLAGS += ["--micro_batch_size", "2", "--total_batch_size", "64", "--eval_every", "0", "--sample_tokens", "0"]
FLAGS += ["--log_with", "none", "--warmup_steps", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:20_000]]
    return write_token_shards(tmp_path_factory.mktemp("shared") / "data", tokens, None, vocab_size=VOCAB)


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def test_agreement_names_the_ranks_that_found_another_checkpoint_or_other_files() -> None:
    a = View(0, "node-a", "/runs/x/checkpoints/step_00000020", ("COMPLETE", "random_states_0.pkl"))
    assert agreement([a, View(1, "node-a", a.checkpoint, a.files)]) is None
    assert agreement([View(0, "a", None), View(1, "b", None)]) is None  # nothing to resume anywhere: step 0
    other = agreement([a, View(1, "node-b", None)])
    assert other == (
        "the processes would resume from different checkpoints: rank 0 on node-a from "
        "/runs/x/checkpoints/step_00000020, rank 1 on node-b from none (step 0): out_dir is not one folder for every "
        f"machine; {FIX}"
    )
    files = agreement([a, View(1, "node-b", a.checkpoint, ("COMPLETE", "random_states_1.pkl"))])
    assert files is not None and "holds other files for rank 1 on node-b than for rank 0 on node-a" in files
    assert "(random_states_0.pkl, random_states_1.pkl)" in files


def two_machines(tmp_path: Path, data: Path) -> list[subprocess.Popen]:
    """One process per "machine", each launcher in its own working folder with the relative --out_dir run: the
    same path on two disks, as on cloud VMs without a shared file system."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        home = tmp_path / f"node{rank}"
        home.mkdir()
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2"]
        cmd += ["--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
        cmd += ["--main_process_port", port, "--mixed_precision", "no", str(REPO / "run.py"), "train", *FLAGS]
        cmd += ["--data_dir", str(data), "--out_dir", "run", "--max_steps", "4", "--save_every", "2"]
        env = subprocess_env(PYTHONPATH=str(REPO))
        procs.append(
            subprocess.Popen(cmd, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


@pytest.mark.slow
def test_two_machines_with_their_own_disks_are_refused_in_one_line(data: Path, tmp_path: Path) -> None:
    """Both launchers exit non-zero within the timeout; rank 0 says which rank cannot see its folder and the fix;
    neither machine keeps a run folder or the probe file."""
    procs = two_machines(tmp_path, data)
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] != [0, 0] and all(p.returncode != 0 for p in procs), outputs
    (line,) = errors(outputs[0][1])
    host = socket.gethostname()
    assert line == (
        f"error: out_dir run is not one folder for every process: rank 1 on {host} cannot see a file that rank 0 "
        f"({host}) wrote into it (a disk of each machine's own, or a relative path from another working folder), so "
        f"checkpoints would be split between machines; {FIX}"
    )
    assert "2 process(es)" not in outputs[0][1]  # refused before the model was built
    for rank in (0, 1):
        assert not (tmp_path / f"node{rank}" / "run").exists()


@pytest.mark.slow
def test_a_checkpoint_missing_a_ranks_random_state_is_refused_on_every_rank(data: Path, tmp_path: Path) -> None:
    """Saved by 2 processes; without rank 1's random state a 2-process resume would give rank 1 another dropout
    stream: refused in one line naming the file, before anything is loaded, and no rank hangs."""
    out = tmp_path / "run"
    args = [*FLAGS, "--data_dir", str(data), "--out_dir", str(out), "--save_every", "2"]
    first = run_cmd(accelerate_cmd(2, "train", *args, "--max_steps", "2"), timeout=240)
    assert "2 process(es) on cpu" in first.stderr
    checkpoint = out / "checkpoints" / "step_00000002"
    (checkpoint / "random_states_1.pkl").unlink()
    proc = run_cmd(accelerate_cmd(2, "train", *args, "--max_steps", "4", "--resume", "auto"), timeout=240, check=False)
    assert proc.returncode != 0
    assert errors(proc.stderr) == [
        f"error: checkpoint {checkpoint} lacks random_states_1.pkl, the random state of rank 1 of the 2 processes "
        "that saved it: it is damaged; resume from an earlier checkpoint by path"
    ]
    assert "2 process(es) on cpu" not in proc.stderr  # stopped before the loop
