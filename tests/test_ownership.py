"""A run reads, resumes, rotates and deletes only what it wrote: checkpoints or final weights copied in from another
run, and a checkpoint folder renamed to a step it does not hold, are refused in one line by train, eval, sample and
export, and nothing of the run's own changes. Two real runs (A: seed 1, B: seed 2) on one data folder; each case
works on a copy of A.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import python_cmd, run_cmd, write_token_shards

from accel_gpt.checkpoint import prune
from accel_gpt.data.shards import sha256_file
from accel_gpt.weights import COMPLETE, RUN_FILE, ModelCard, complete_checkpoints, disowned, folder_run

VOCAB = 256
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
TINY += ["--micro_batch_size", "2", "--total_batch_size", "32", "--eval_every", "0", "--save_every", "2"]
TINY += ["--keep_checkpoints", "0", "--sample_tokens", "0", "--log_with", "none"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ownership")
    tokens = [(i * 7 + i // 13) % VOCAB for i in range(6000)]
    data = write_token_shards(root / "data", tokens, vocab_size=VOCAB)
    for name, seed, steps in (("A", "1", "4"), ("B", "2", "6")):
        run_cmd(python_cmd("train", *TINY, "--seed", seed, "--max_steps", steps, "--data_dir", str(data),
                           "--out_dir", str(root / name)))  # fmt: skip
    return {"A": root / "A", "B": root / "B", "data": data}


def train(runs: dict[str, Path], out: Path, *args: str, check: bool = True) -> str:
    proc = run_cmd(
        python_cmd("train", *TINY, "--seed", "1", "--data_dir", str(runs["data"]), "--out_dir", str(out), *args),
        check=check,
    )
    return proc.stderr


def refused(args: list[str]) -> str:
    """A command that exits 2 with one `error:` line: that line."""
    proc = run_cmd(python_cmd(*args), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def readers(run: Path, tmp_path: Path) -> list[list[str]]:
    """eval, sample and export of a run dir, as users point them at it."""
    return [
        ["eval", "--checkpoint", str(run), "--data_dir", str(run.parent / "data"), "--eval_windows", "2"],
        ["sample", "--checkpoint", str(run), "--prompt", "ab", "--max_new_tokens", "2"],
        ["export", "--checkpoint", str(run), "--out_dir", str(tmp_path / "export")],
    ]


def test_every_file_a_run_writes_carries_its_id(runs: dict[str, Path]) -> None:
    a, b = folder_run(runs["A"]), folder_run(runs["B"])
    assert a and b and a != b
    for p in complete_checkpoints(runs["A"]):
        assert json.loads((p / COMPLETE).read_text())["run"] == a
        assert json.loads((p / "model_config.json").read_text())["run"] == a
    assert json.loads((runs["A"] / "model_config.json").read_text())["run"] == a
    assert disowned(runs["A"]) is None and disowned(runs["B"]) is None


def test_a_checkpoint_copied_in_from_another_run_is_refused_and_nothing_of_the_run_changes(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    shutil.copytree(runs["B"] / "checkpoints" / "step_00000006", a / "checkpoints" / "step_00000006")
    before = snapshot(a)
    line = refused(["train", *TINY, "--seed", "1", "--max_steps", "8", "--resume", "auto",
                    "--data_dir", str(runs["data"]), "--out_dir", str(a)])  # fmt: skip
    assert "step_00000006 was saved by another run" in line and f"move it out of {a / 'checkpoints'}" in line, line
    for args in readers(a, tmp_path):
        assert "step_00000006 was saved by another run" in refused(args), args
    assert snapshot(a) == before, "a refused command changed the run's files"
    shutil.rmtree(a / "checkpoints" / "step_00000006")  # what the line says to do: then the run goes on
    assert "finished at step 8/8" in train(runs, a, "--max_steps", "8", "--resume", "auto")
    assert folder_run(a) == folder_run(runs["A"])


def test_a_checkpoint_of_another_run_resumed_by_path_into_this_run_is_refused(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """By path into A's folder it would mix two runs (and retire A's later checkpoints); into a new folder it is that
    run continued, and keeps its id."""
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    theirs = runs["B"] / "checkpoints" / "step_00000002"
    before = snapshot(a)
    line = refused(["train", *TINY, "--seed", "2", "--max_steps", "8", "--resume", str(theirs),
                    "--data_dir", str(runs["data"]), "--out_dir", str(a)])  # fmt: skip
    assert "was saved by another run" in line and f"--init_from {theirs}" in line, line
    assert snapshot(a) == before
    moved = tmp_path / "B_continued"
    run_cmd(python_cmd("train", *TINY, "--seed", "2", "--max_steps", "4", "--resume", str(theirs),
                       "--data_dir", str(runs["data"]), "--out_dir", str(moved)))  # fmt: skip
    assert folder_run(moved) == folder_run(runs["B"])


def test_a_checkpoint_folder_renamed_to_another_step_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    (a / "checkpoints" / "step_00000002").rename(a / "checkpoints" / "step_00000009")
    line = refused(["train", *TINY, "--seed", "1", "--max_steps", "12", "--resume", "auto",
                    "--data_dir", str(runs["data"]), "--out_dir", str(a)])  # fmt: skip
    assert "step_00000009 holds step 2's state" in line and "rename it step_00000002" in line, line
    by_path = ["sample", "--checkpoint", str(a / "checkpoints" / "step_00000009"), "--prompt", "ab"]
    assert "holds step 2's state" in refused(by_path)
    assert "holds step 2's state" in refused(readers(a, tmp_path)[1])


def test_final_weights_of_another_run_are_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    for name in ("model.safetensors", "model_config.json"):
        shutil.copy2(runs["B"] / name, a / name)
    for args in readers(a, tmp_path):
        assert "the final weights" in (line := refused(args)) and "another run" in line, line


def test_a_run_from_before_ids_resumes_and_takes_one(runs: dict[str, Path], tmp_path: Path) -> None:
    """Checkpoints and weights without an id (saved before ids were recorded) count as the run's own."""
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    (a / RUN_FILE).unlink()
    for p in [*complete_checkpoints(a), a]:
        card = json.loads((p / "model_config.json").read_text())
        card.pop("run")
        (p / "model_config.json").write_text(json.dumps(card))
        if (p / COMPLETE).is_file():
            marker = json.loads((p / COMPLETE).read_text())
            marker.pop("run")
            marker["sha256"]["model_config.json"] = sha256_file(p / "model_config.json")
            (p / COMPLETE).write_text(json.dumps(marker))
    assert disowned(a) is None
    assert "finished at step 6/6" in train(runs, a, "--max_steps", "6", "--resume", "auto")
    assert folder_run(a) and disowned(a) is None


def test_prune_deletes_only_the_runs_own_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step, run in ((2, "mine"), (4, "theirs"), (6, None), (8, "mine"), (10, "mine")):
        folder = root / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / COMPLETE).write_text(json.dumps({"step": step} | ({"run": run} if run else {})))
    prune(tmp_path, keep=1, keep_best=False, run="mine")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000010"]


def test_a_users_folders_beside_the_checkpoints_are_kept(runs: dict[str, Path], tmp_path: Path) -> None:
    """`step_00000002.bak` (a backup copy) is not a checkpoint name: it neither blocks a resume nor is pruned; a
    `step_00000006/` the user made (no COMPLETE) where the run then saves step 6 is moved aside, not deleted."""
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    shutil.copytree(a / "checkpoints" / "step_00000002", a / "checkpoints" / "step_00000002.bak")
    (a / "checkpoints" / "step_00000006").mkdir()
    (a / "checkpoints" / "step_00000006" / "notes.txt").write_text("mine")
    log = train(runs, a, "--max_steps", "6", "--resume", "auto", "--keep_checkpoints", "1")
    assert "step_00000006 was not a checkpoint of this run: moved it to" in log, log[-3000:]
    assert (a / "checkpoints" / "step_00000002.bak" / COMPLETE).is_file()
    assert [p.read_text() for p in (a / "checkpoints").glob("retired-*/step_00000006/notes.txt")] == ["mine"]
    assert [p.name for p in complete_checkpoints(a)] == ["step_00000006"]


def test_final_weights_replaced_without_their_card_are_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    """Only model.safetensors swapped for another run's (its model_config.json left): the card's sha256 of the
    weights it was written with names it, where before eval scored the other run's weights as this run's."""
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    shutil.copy2(runs["B"] / "model.safetensors", a / "model.safetensors")
    for args in readers(a, tmp_path):
        assert "is not the file its model_config.json was written with" in refused(args), args


def test_a_resume_past_the_end_of_metrics_says_which_rows_are_missing(runs: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint of this run's copy that went on elsewhere, dropped into the run (same id): the resume goes on
    from it, and says that metrics.jsonl lacks the rows between."""
    a, copy = tmp_path / "A", tmp_path / "copy"
    shutil.copytree(runs["A"], a)
    shutil.copytree(runs["A"], copy)
    train(runs, copy, "--max_steps", "6", "--resume", "auto")
    shutil.copytree(copy / "checkpoints" / "step_00000006", a / "checkpoints" / "step_00000006")
    log = train(runs, a, "--max_steps", "8", "--resume", "auto")
    assert "holds rows up to step 4 only, and the run resumes at step 6: the rows of steps 5-6" in log, log[-3000:]


def test_linked_checkpoint_folders_lose_only_their_links(runs: dict[str, Path], tmp_path: Path) -> None:
    """A new run into a folder whose `checkpoints/` links to an empty store elsewhere trains (an empty folder holds
    no run) and saves into the store; a checkpoint linked in from a backup is pruned as a link: the backup stays,
    and no hidden `.trash-` link is left behind."""
    store, backup, out = tmp_path / "store", tmp_path / "backup", tmp_path / "linked"
    store.mkdir()
    out.mkdir()
    (out / "checkpoints").symlink_to(store)
    train(runs, out, "--max_steps", "2")
    assert [p.name for p in store.iterdir()] == ["step_00000002"]
    shutil.copytree(store / "step_00000002", backup)
    shutil.rmtree(store / "step_00000002")
    (store / "step_00000002").symlink_to(backup)
    log = train(runs, out, "--max_steps", "4", "--resume", "auto", "--keep_checkpoints", "1")
    assert f"removed the link {out / 'checkpoints' / 'step_00000002'} from the run" in log, log[-3000:]
    assert sorted(p.name for p in store.iterdir()) == ["step_00000004"]
    assert (backup / COMPLETE).is_file()


def test_a_checkpoint_of_an_abandoned_line_copied_back_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    """Resumed from step 2 by path, the run retires its step 4 (its marker then says so); copied back into
    checkpoints/, that step 4 was adopted by `--resume auto` as the newest, silently mixing the two lines."""
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    train(runs, a, "--max_steps", "3", "--save_every", "1", "--resume", str(a / "checkpoints" / "step_00000002"))
    (retired,) = (a / "checkpoints").glob("retired-*/step_00000004")
    shutil.copytree(retired, a / "checkpoints" / "step_00000004")
    line = refused(["train", *TINY, "--seed", "1", "--max_steps", "6", "--resume", "auto",
                    "--data_dir", str(runs["data"]), "--out_dir", str(a)])  # fmt: skip
    assert "step_00000004 is of a line this run abandoned" in line and str(retired.parent) in line, line
    assert "abandoned" in refused(["sample", "--checkpoint", str(a), "--prompt", "ab", "--max_new_tokens", "2"])


def test_a_replaced_run_id_file_is_named_not_the_runs_checkpoints(runs: dict[str, Path], tmp_path: Path) -> None:
    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    shutil.copy2(runs["B"] / RUN_FILE, a / RUN_FILE)
    line = refused(["sample", "--checkpoint", str(a), "--prompt", "ab", "--max_new_tokens", "2"])
    assert f"{a / RUN_FILE} names run {folder_run(runs['B'])}, but every checkpoint" in line, line
    (a / RUN_FILE).unlink()  # what the line says: the id is read back from the checkpoints
    assert "finished at step 6/6" in train(runs, a, "--max_steps", "6", "--resume", "auto")
    assert folder_run(a) == folder_run(runs["A"])


def test_a_checkpoint_pruned_while_it_is_read_is_read_again_at_the_newest(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A run training in the folder prunes the checkpoint a reader picked (keep_checkpoints): the reader picks the
    newest again, where before eval, sample and export said the checkpoint was damaged."""
    import accel_gpt.weights as weights

    a = tmp_path / "A"
    shutil.copytree(runs["A"], a)
    for name in ("model.safetensors", "model_config.json"):  # a run still training: no final weights yet
        (a / name).unlink()
    picked = a / "checkpoints" / "step_00000004"
    read = weights.read_model_config

    def pruned_while_read(folder: Path) -> ModelCard:
        if Path(folder) == picked and picked.exists():
            picked.rename(picked.with_name(".trash-step_00000004"))  # as the run's prune does, mid-read
        return read(folder)

    monkeypatch.setattr(weights, "read_model_config", pruned_while_read)
    model, card = weights.load_model(a)
    assert card.step == 2
    assert f"{picked} was pruned by the run training in {a} while it was read" in capsys.readouterr().err
