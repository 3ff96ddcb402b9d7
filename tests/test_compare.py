"""`run.py compare`: two real runs side by side, their curves in one plot, and an experiment log that grows."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import python_cmd, run_cmd, write_token_shards

from accel_gpt.cli import main

FLAGS = [
    *("--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", "256"),
    *("--micro_batch_size", "2", "--total_batch_size", "64", "--max_steps", "4", "--warmup_steps", "1"),
    *("--eval_every", "2", "--eval_windows", "4", "--sample_tokens", "0", "--log_with", "none", "--save_every", "0"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> list[Path]:
    root = tmp_path_factory.mktemp("compare")
    tokens = [t % 256 for t in shakespeare_tokens[:6000]]
    data = write_token_shards(root / "data", tokens[:5000], tokens[5000:], vocab_size=256)
    out = []
    for name, rate in (("slow", "1e-4"), ("fast", "3e-3")):
        run = root / "runs" / name
        run_cmd(python_cmd("train", *FLAGS, "--data_dir", str(data), "--out_dir", str(run), "--learning_rate", rate))
        out.append(run)
    return out


def test_runs_side_by_side_with_the_settings_they_differ_in(runs: list[Path], capsys) -> None:
    main(["compare", *map(str, runs)])
    header, *rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert header == [
        "run",
        "val_loss",
        "val_bpb",
        "steps",
        "tokens",
        "train_s",
        "params",
        "processes",
        "learning_rate",
    ]
    metrics = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in runs]
    for row, run, rows_of_run in zip(rows, runs, metrics, strict=True):
        last = [m for m in rows_of_run if "val_loss" in m][-1]
        assert row[0] == run.name and row[1] == f"{last['val_loss']:.4f}" and row[2] == f"{last['val_bpb']:.4f}"
        assert row[3:5] == ["4", "256"] and float(row[5]) > 0 and row[7] == "1"
    assert [row[-1] for row in rows] == ["0.0001", "0.003"]


def test_a_val_loss_older_than_the_runs_last_step_says_its_step(runs: list[Path], tmp_path: Path, capsys) -> None:
    """A run stopped past its last evaluation (continued, then killed): its val_loss is an older step's, and says
    which, where before it stood beside the newer step count as if it were that step's."""
    run = tmp_path / "stopped"
    shutil.copytree(runs[0], run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    later = [{k: v for k, v in rows[-1].items() if not k.startswith(("val_", "hellaswag"))} | {"step": 4 + i}
             for i in (1, 2, 3)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, *later]))
    main(["compare", str(run)])
    row = capsys.readouterr().out.splitlines()[1]
    assert re.match(r"stopped +\d+\.\d{4} \(step 4\) +\d+\.\d{4} \(step 4\) +7 ", row), row


def test_the_curves_in_one_plot_and_a_log_that_grows(runs: list[Path], tmp_path: Path, capsys) -> None:
    log = tmp_path / "results.tsv"
    main(["compare", str(runs[0]), "--log", str(log), "--plot", str(tmp_path / "c.png")])
    main(["compare", *map(str, runs), "--log", str(log)])
    out = capsys.readouterr().out
    assert "logged 1 run to" in out and "logged 1 run to" in out.split("wrote")[1]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert lines[0] == ["run", "val_loss", "val_bpb", "steps", "tokens", "train_seconds", "parameters", "settings"]
    assert [line[0] for line in lines[1:]] == [str(runs[0]), str(runs[1])]
    assert "learning_rate=0.003" in lines[2][-1] and "max_steps=4" in lines[2][-1]
    main(["compare", *map(str, runs), "--log", str(log)])
    assert "logged 0 runs" in capsys.readouterr().out and len(log.read_text().splitlines()) == 3


@pytest.mark.parametrize("name", ["folder", "c.txt", "file/c.png"])
def test_a_plot_that_cannot_be_written_names_compares_own_flag(
    runs: list[Path], tmp_path: Path, capsys, name: str
) -> None:
    """`compare --plot PATH`: the error names --plot (not plot's --out), before any table is printed."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["compare", str(runs[0]), "--plot", str(tmp_path / name)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:") and captured.out == ""
    assert f"--plot {tmp_path / name}" in lines[0] and "--out" not in lines[0]


def test_runs_scored_on_other_validation_sets_are_noted(runs: list[Path], tmp_path: Path, capsys) -> None:
    """Two runs whose val_loss came from another number of windows: the table, and a note on stderr naming why their
    measures may not compare; runs on one set get none."""
    main(["compare", *map(str, runs)])
    assert capsys.readouterr().err == ""
    relative = tmp_path / "relative"  # the same folder, named from here
    shutil.copytree(runs[1], relative)
    config = relative / "config.yaml"
    data = yaml.safe_load(config.read_text())["data_dir"]
    config.write_text(config.read_text().replace(data, os.path.relpath(data)))
    main(["compare", str(runs[0]), str(relative)])
    assert capsys.readouterr().err == ""
    other = tmp_path / "other"
    shutil.copytree(runs[1], other)
    config = other / "config.yaml"
    config.write_text(config.read_text().replace("eval_windows: 4\n", "eval_windows: 8\n"))
    main(["compare", str(runs[0]), str(other)])
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split()[-2:] == ["learning_rate", "eval_windows"]
    assert captured.err.startswith("note: the runs were scored on different validation sets (eval_windows differ)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: RUN_DIR"),
        (["nope"], "run dir 'nope' does not exist"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_file_that_is_no_log_is_left_alone(runs: list[Path], tmp_path: Path, capsys) -> None:
    notes = tmp_path / "notes.tsv"
    notes.write_text("mine\tnot yours\n")
    with pytest.raises(SystemExit):
        main(["compare", str(runs[0]), "--log", str(notes)])
    assert "is not an experiment log of `compare`" in capsys.readouterr().err
    assert notes.read_text() == "mine\tnot yours\n"
