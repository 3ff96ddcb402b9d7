"""What a user trips on, through `run.py` as they run it: a run dir without final weights read by sample, eval and
export; file modes in a run dir; the summary after a stop."""

from __future__ import annotations

import json
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY_RUN_FLAGS, python_cmd, run_cmd, subprocess_env

from accel_gpt.weights import complete_checkpoints

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def unfinished(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir as a run still training (or killed) leaves it: checkpoints at steps 2 and 4, no final weights."""
    run = Path(shutil.copytree(tiny_run, tmp_path_factory.mktemp("unfinished") / "run"))
    (run / "model.safetensors").unlink()
    (run / "model_config.json").unlink()
    return run


def test_sample_eval_and_export_of_a_run_without_final_weights_use_its_newest_checkpoint(
    unfinished: Path, tiny_run: Path, tmp_path: Path
) -> None:
    """Each says so in one line and reads step 4's checkpoint: the same text, val loss and exported step as
    pointing at that checkpoint (before: "is not a run dir")."""
    newest = unfinished / "checkpoints" / "step_00000004"
    note = (
        f"note: {unfinished} has no final weights yet (a run still training, or stopped before its last step): "
        f"using its newest checkpoint, {newest}"
    )
    sample = ["sample", "--prompt", "To be", "--max_new_tokens", "8", "--device", "cpu"]
    got = run_cmd(python_cmd(*sample, "--checkpoint", str(unfinished)))
    assert got.stderr.count(note) == 1, got.stderr
    assert got.stdout == run_cmd(python_cmd(*sample, "--checkpoint", str(newest))).stdout
    data_dir = yaml.safe_load((tiny_run / "config.yaml").read_text())["data_dir"]
    scored = run_cmd(python_cmd("eval", "--checkpoint", str(unfinished), "--data_dir", data_dir))
    assert note in scored.stderr
    expected = run_cmd(python_cmd("eval", "--checkpoint", str(newest), "--data_dir", data_dir)).stdout
    assert json.loads(scored.stdout.splitlines()[-1]) == json.loads(expected.splitlines()[-1])
    exported = run_cmd(python_cmd("export", "--checkpoint", str(unfinished), "--out_dir", str(tmp_path / "hf")))
    assert note in exported.stderr and (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_run_continued_and_stopped_is_read_at_its_newest_checkpoint(tiny_run: Path, tmp_path: Path) -> None:
    """A finished run (final weights of step 4) continued with a larger max_steps and stopped (SIGTERM) after a
    later checkpoint: sample, eval and export read that checkpoint, and say so (before: the step-4 final weights,
    silently); the stopped run's last line says the final weights there are older."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    data_dir = yaml.safe_load((run / "config.yaml").read_text())["data_dir"]
    flags = [*TINY_RUN_FLAGS, "--data_dir", data_dir, "--out_dir", str(run), "--resume", "auto"]
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        cmd = python_cmd("train", *flags, "--max_steps", "100000", "--save_every", "3")
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=out, stderr=out)
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step_00000006" / "COMPLETE").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0 and "stop requested" in log.read_text()
    # its last line names the older final weights left in the folder (before: "no final weights yet")
    assert "; the final weights are step 4's, older than this)" in log.read_text(), log.read_text()[-2000:]
    newest = complete_checkpoints(run)[-1]
    assert (
        int(newest.name.removeprefix("step_")) >= 6 and json.loads((run / "model_config.json").read_text())["step"] == 4
    )
    note = f"note: {run}'s final weights are step 4's, but the run went on to its checkpoint {newest}"
    sample = ["sample", "--prompt", "To be", "--max_new_tokens", "8", "--device", "cpu"]
    got = run_cmd(python_cmd(*sample, "--checkpoint", str(run)))
    assert note in got.stderr and got.stdout == run_cmd(python_cmd(*sample, "--checkpoint", str(newest))).stdout
    scored = run_cmd(python_cmd("eval", "--checkpoint", str(run), "--data_dir", data_dir))
    expected = run_cmd(python_cmd("eval", "--checkpoint", str(newest), "--data_dir", data_dir)).stdout
    assert note in scored.stderr and json.loads(scored.stdout.splitlines()[-1]) == json.loads(expected.splitlines()[-1])
    exported = run_cmd(python_cmd("export", "--checkpoint", str(run), "--out_dir", str(tmp_path / "hf")))
    assert (
        note in exported.stderr
        and f"| optimizer steps | {newest.name.removeprefix('step_').lstrip('0')} of"
        in (tmp_path / "hf" / "README.md").read_text()
    )


def test_a_run_dir_without_any_checkpoint_is_one_line(unfinished: Path, tmp_path: Path) -> None:
    empty = Path(shutil.copytree(unfinished, tmp_path / "run"))
    shutil.rmtree(empty / "checkpoints")
    (empty / "checkpoints").mkdir()
    proc = run_cmd(python_cmd("sample", "--checkpoint", str(empty), "--device", "cpu"), check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: run dir {empty} has no final weights and no complete checkpoint yet: wait for its first save "
        "(save_every), or pass a checkpoint folder"
    )


def test_every_file_of_a_run_dir_has_the_umasks_mode(tiny_run: Path) -> None:
    """safetensors writes its file 0600; the checkpoints' weights were left so while everything else was 0644."""
    files = [p for p in tiny_run.rglob("*") if p.is_file() and p.name != ".lock"]
    modes = {str(p.relative_to(tiny_run)): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert "checkpoints/step_00000004/model.safetensors" in modes
    assert set(modes.values()) == {modes["config.yaml"]}, modes


def test_the_readmes_virtual_environment_is_ignored_by_git() -> None:
    """The README's install makes `.venv` inside the clone; unignored, `git status` listed the whole environment."""
    repo = Path(__file__).resolve().parent.parent
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    probe = subprocess.run(["git", "check-ignore", "-q", ".venv/lib/site.py"], cwd=repo, capture_output=True)
    assert probe.returncode == 0, "the README's .venv is not in .gitignore"
    assert "python3 -m venv .venv" in (repo / "README.md").read_text()
