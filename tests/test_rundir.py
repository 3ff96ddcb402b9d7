"""A run directory belongs to one run: bad out_dirs and folders of other runs are refused in one line before
anything is written; `--overwrite true` replaces the other run whole; `--resume` continues it.

The refusals run `train` in this process (they stop before any Accelerator exists); the two-run scenario runs real
`run.py train` processes. The lock (two trainings into one folder) is tested with real processes in
test_reliability.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import python_cmd, run_cmd, write_token_shards
from safetensors.torch import load_file

from accel_gpt.cli import main
from accel_gpt.config import TrainConfig
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.files import LOCK, locked, write_failure
from accel_gpt.rundir import RUN_FILES, probe_lock

VOCAB = 256
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
TINY += ["--micro_batch_size", "2", "--total_batch_size", "32", "--seed", "7", "--eval_every", "0"]
TINY += ["--sample_tokens", "0", "--log_with", "none"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens = [(i * 7) % VOCAB for i in range(4000)]
    return write_token_shards(tmp_path_factory.mktemp("rundir") / "data", tokens, vocab_size=VOCAB)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for folders), hidden files included."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def refused(capsys: pytest.CaptureFixture, out: str | Path, data: Path, *args: str) -> str:
    """`train` into `out` exits 2 with one `error:` line."""
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--max_steps", "2", "--data_dir", str(data), "--out_dir", str(out), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_empty_out_dir_is_refused(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, data: Path, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert "out_dir is empty" in refused(capsys, "", data)
    assert "out_dir is empty" in refused(capsys, " ", data)
    assert list(tmp_path.iterdir()) == [], "nothing may be written into the current folder"


def test_out_dir_that_is_a_file_or_under_one(capsys: pytest.CaptureFixture, data: Path, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("mine")
    assert "is a file, not a folder" in refused(capsys, tmp_path / "a_file", data)
    assert f"{tmp_path / 'a_file'} is a file" in refused(capsys, tmp_path / "a_file" / "run", data)
    assert (tmp_path / "a_file").read_text() == "mine"


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """A folder nobody may write into; as root (tests in containers), made immutable, which binds root too."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("running as root where chattr +i is unavailable: cannot make a folder read-only")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)


def test_read_only_out_dir(capsys: pytest.CaptureFixture, data: Path, tmp_path: Path) -> None:
    locked_dir = tmp_path / "ro"
    locked_dir.mkdir()
    with read_only(locked_dir):
        assert "cannot be written: it is read-only" in refused(capsys, locked_dir, data)
        assert f"cannot be written: {locked_dir} is read-only" in refused(capsys, locked_dir / "a" / "run", data)
    assert list(locked_dir.iterdir()) == []


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_new_run_refuses_a_folder_with_any_run_file(
    capsys: pytest.CaptureFixture, data: Path, tmp_path: Path, name: str
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    if name in ("checkpoints", "logs"):  # a folder of a run's holds something (an empty one holds no run: below)
        (out / name / ("step_00000001" if name == "checkpoints" else "accel_gpt")).mkdir(parents=True)
    else:
        (out / name).write_text("an earlier run's")
    before = snapshot(out)
    err = refused(capsys, out, data)
    assert f"out_dir {out} holds another run ({name})" in err and "--overwrite true" in err
    assert snapshot(out) == before


def test_empty_run_folders_hold_no_run(data: Path, tmp_path: Path) -> None:
    """`checkpoints/` made ahead (or linked to an empty store) and an empty `logs/`: nothing to lose, so a new run
    trains there (before: refused as "another run")."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "logs").mkdir()
    assert "finished at step 1/1" in _train(data, out, "--max_steps", "1", "--save_every", "1").stderr
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]


def test_a_folder_in_use_is_refused_without_touching_its_lock(
    capsys: pytest.CaptureFixture, data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    with locked(out, "train"):
        before = snapshot(out)
        err = refused(capsys, out, data, "--resume", "auto")
        assert f"{out} is in use by pid {os.getpid()}" in err
        assert snapshot(out) == before  # the lock file still names the holder


def test_probes_of_one_launch_never_refuse_each_other(tmp_path: Path) -> None:
    """Every rank probes the lock at the same moment before anything is built. A probe caught while it holds the
    lock (here: a shared lock held on its own open file, as a probe holds it) must not refuse the other ranks'
    probes, whatever pid the file names (the previous run's); the run's real lock still refuses them, and is taken
    once the probe is over."""
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK).write_text("pid 1 on the previous run's host")
    with open(out / LOCK) as probing:
        fcntl.flock(probing, fcntl.LOCK_SH | fcntl.LOCK_NB)
        probe_lock(out)
    with locked(out, "train"):
        with pytest.raises(UserError, match=f"{out} is in use by pid {os.getpid()} on "):
            probe_lock(out)


def test_overwrite_cannot_be_combined_with_resume() -> None:
    with pytest.raises(ConfigError, match="overwrite=true starts a new run; it cannot resume"):
        TrainConfig(data_dir="d", overwrite=True, resume="auto")


def _train(data: Path, out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_cmd(python_cmd("train", *TINY, "--data_dir", str(data), "--out_dir", str(out), *args), check=check)


@pytest.mark.slow
def test_second_run_into_a_used_folder_is_refused_then_overwrite_replaces_it(data: Path, tmp_path: Path) -> None:
    """Run 1 (2 layers, 6 steps, no checkpoints); run 2 (1 layer, 2 steps) into the same folder is refused and
    changes nothing, and so is `--resume auto`, which has no checkpoint to continue from; with --overwrite true run 2
    replaces run 1 whole: no file of run 1 is left beside run 2's."""
    out = tmp_path / "R"
    _train(data, out, "--save_every", "0", "--max_steps", "6", "--keep_checkpoints", "0")
    (out / "notes.txt").write_text("the user's own file")
    before = snapshot(out)
    second = ["--n_layer", "1", "--max_steps", "2", "--save_every", "1"]
    proc = _train(data, out, *second, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "holds another run" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert snapshot(out) == before
    proc = _train(data, out, *second[2:], "--resume", "auto", check=False)  # nothing to continue: not a silent restart
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "holds a run's final weights but no complete checkpoint to continue from" in errors[0]
    assert snapshot(out) == before
    proc = _train(data, out, *second, "--overwrite", "true")
    assert "overwrite: removed the earlier run's config.yaml, metrics.jsonl, model.safetensors" in proc.stderr
    assert [r.split(",")[0] for r in (out / "metrics.jsonl").read_text().splitlines()] == ['{"step": 1', '{"step": 2']
    assert "n_layer: 1" in (out / "config.yaml").read_text()
    assert not any(k.startswith("transformer.h.1.") for k in load_file(str(out / "model.safetensors")))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert (out / "notes.txt").read_text() == "the user's own file"  # only the trainer's own files are replaced


@pytest.mark.slow
def test_overwrite_keeps_what_no_run_writes_inside_checkpoints_and_logs(data: Path, tmp_path: Path) -> None:
    """A user's notes and hand-made copies inside `checkpoints/` and `logs/` stay through `--overwrite true` (before:
    deleted with the folders), and the log names them; the run's own checkpoints, retired line and tracker folder go.
    """
    out = tmp_path / "R"
    _train(data, out, "--max_steps", "2", "--save_every", "1")
    (out / "logs" / "accel_gpt").mkdir(parents=True)  # as TensorBoard writes it (not installed in every test venv)
    (out / "logs" / "accel_gpt" / "events.out.tfevents.1").write_bytes(b"")
    shutil.copytree(out / "checkpoints" / "step_00000001", out / "checkpoints" / "my_best_step1")
    (out / "checkpoints" / "retired-20260101T000000Z").mkdir()
    (out / "checkpoints" / "notes.txt").write_text("mine")
    (out / "logs" / "my_notes.txt").write_text("mine too")
    proc = _train(data, out, "--max_steps", "1", "--save_every", "0", "--overwrite", "true")
    assert "left what no run writes there: checkpoints/my_best_step1, checkpoints/notes.txt, logs/my_notes.txt" in (
        proc.stderr
    ), proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["my_best_step1", "notes.txt"]
    assert [p.name for p in (out / "logs").iterdir()] == ["my_notes.txt"]


def test_an_out_dir_through_a_broken_link_is_named(capsys: pytest.CaptureFixture, data: Path, tmp_path: Path) -> None:
    (tmp_path / "dang").symlink_to(tmp_path / "gone")
    err = refused(capsys, tmp_path / "dang", data)
    assert f"{tmp_path / 'dang'} is a link to {tmp_path / 'gone'}, which does not exist" in err, err
    assert "link to" in refused(capsys, tmp_path / "dang" / "run", data)


def test_a_full_disk_is_told_by_the_error_or_by_the_size_of_the_write(tmp_path: Path) -> None:
    """Libraries wrap ENOSPC in errors of their own: the chain and the words are read, and where neither says why
    (torch's writer), a write that needed more than was free is a full disk. Other failures are not called one."""

    def failing(error: Exception) -> Callable[[], None]:
        def write() -> None:
            raise error

        return write

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as cause:
        chained = RuntimeError("serializing failed")
        chained.__cause__ = cause
    safetensors_like = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    torch_like = RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed")
    free = shutil.disk_usage(tmp_path).free
    assert write_failure(tmp_path, failing(chained)) == "no space left on the device"
    assert write_failure(tmp_path, failing(safetensors_like)) == "no space left on the device"
    said = write_failure(tmp_path, failing(torch_like), needed=free + 10**9)
    assert said is not None and said.startswith("no space left on the device (the write needs about ")
    with pytest.raises(RuntimeError, match="PytorchStreamWriter"):  # room enough: not a full disk, not hidden
        write_failure(tmp_path, failing(torch_like), needed=1000)
    assert write_failure(tmp_path, failing(OSError(errno.EIO, "Input/output error"))) == "[Errno 5] Input/output error"
    assert write_failure(tmp_path, lambda: None, needed=free * 2) is None
