"""`run.py plot`: a real PNG from metrics.jsonl files shaped like the trainer's, runs overlaid, clear errors.

The metrics rows here are written by the test (the quick-start test plots a real training run) and read
back through `accel_gpt.metrics.read_metrics`, the same reader the trainer's resume uses.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from accel_gpt.cli import main
from accel_gpt.config import PlotConfig
from accel_gpt.plot import load_rows, load_runs, make_figure, run_labels, run_plot
from tests.conftest import run_cmd

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: int, hellaswag: bool, loss0: float = 10.8, per_byte: float | None = None) -> Path:
    """A run dir with one metrics row per step, evaluations every 4 steps, as train.py writes them; with `per_byte`
    (tokens per byte of its data), evaluations also log val_bpb."""
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "loss": loss0 - 0.3 * step,
            "lr": 1e-3 * min(1.0, step / 3),
            "grad_norm": 1.0,
            "tokens_per_sec": 1000.0 + 10 * step,
            "mfu": None,
            "flops_per_sec": 1e9,
        }
        if step % 4 == 0:
            row["val_loss"] = loss0 - 0.25 * step
            if per_byte is not None:
                row["val_bpb"] = row["val_loss"] / math.log(2) * per_byte
            if hellaswag:
                row |= {"hellaswag_acc_norm": 0.25 + 0.01 * step, "hellaswag_acc": 0.24 + 0.01 * step}
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which a valid PNG must start with."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def axes_by_title(figure) -> dict:
    return {ax.get_title(): ax for ax in figure.axes}


def test_plot_writes_png_with_every_run_overlaid(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write_run(tmp_path / "baseline", steps=12, hellaswag=True)
    b = write_run(tmp_path / "bigger_lr", steps=8, hellaswag=False, loss0=9.0)
    out = tmp_path / "plots" / "runs.png"  # the folder does not exist yet
    run_plot(PlotConfig(run_dirs=[str(a), str(b)], out=str(out)))
    assert capsys.readouterr().out.splitlines() == [f"wrote {out} (2 runs, up to step 12)"]
    width, height = png_size(out)
    assert (width, height) == (1320, 1210)  # 12 x 11 inches at 110 dpi

    import matplotlib.colors
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(out)[..., :3]
    for color in ("C0", "C1"):  # each run's colour is on the picture: both runs were drawn
        rgb = np.array(matplotlib.colors.to_rgb(color))
        assert (np.abs(pixels - rgb).max(axis=-1) < 0.02).sum() > 200, f"no {color} line in the PNG"


@pytest.mark.slow
def test_plot_command_in_a_fresh_interpreter_imports_no_torch(tmp_path: Path) -> None:
    a = write_run(tmp_path / "baseline", steps=12, hellaswag=True)
    b = write_run(tmp_path / "bigger_lr", steps=8, hellaswag=False, loss0=9.0)
    out = tmp_path / "plots" / "runs.png"
    # The CLI's own main() in a fresh interpreter, which then reports whether plotting pulled in torch.
    script = f"import sys; from accel_gpt.cli import main; main({['plot', str(a), str(b), '--out', str(out)]!r}); "
    proc = run_cmd([sys.executable, "-c", script + "print('torch' in sys.modules)"], timeout=120)
    assert proc.stdout.splitlines() == [f"wrote {out} (2 runs, up to step 12)", "False"]  # no torch: starts fast
    assert png_size(out) == (1320, 1210)


def test_figure_panels_hold_each_runs_series(tmp_path: Path) -> None:
    runs = load_runs(
        [write_run(tmp_path / "a", 12, hellaswag=True), write_run(tmp_path / "b", 8, hellaswag=False, loss0=9.0)]
    )
    panels = axes_by_title(make_figure(runs))
    assert set(panels) == {"loss", "val bits per byte", "learning rate", "HellaSwag", "throughput"}

    loss_lines = {line.get_label(): line for line in panels["loss"].get_lines()}
    assert set(loss_lines) == {"a train", "a val", "b train", "b val"}
    assert list(loss_lines["a train"].get_xdata()) == list(range(1, 13))
    assert list(loss_lines["a val"].get_xdata()) == [4, 8, 12]  # evaluation steps only
    assert loss_lines["b val"].get_ydata()[-1] == pytest.approx(9.0 - 0.25 * 8)
    # one colour per run, the same in every panel
    assert loss_lines["a train"].get_color() == loss_lines["a val"].get_color()
    assert loss_lines["a train"].get_color() != loss_lines["b train"].get_color()
    lr_colors = {line.get_label(): line.get_color() for line in panels["learning rate"].get_lines()}
    assert lr_colors == {"a": loss_lines["a train"].get_color(), "b": loss_lines["b train"].get_color()}

    hellaswag = {line.get_label(): line for line in panels["HellaSwag"].get_lines()}
    assert set(hellaswag) == {"a acc_norm", "a acc", "chance (1 in 4)"}  # run b has no HellaSwag rows
    assert list(hellaswag["a acc_norm"].get_ydata()) == pytest.approx([0.29, 0.33, 0.37])
    tokens = [line.get_label() for line in panels["throughput"].get_lines()]
    assert tokens == ["a", "b"]


def test_runs_that_never_scored_hellaswag_get_no_hellaswag_panel(tmp_path: Path, capsys) -> None:
    """Four panels in two rows (throughput beside the learning rate) and a figure a row shorter; one run that scored
    HellaSwag among them brings the panel back."""
    a, b = write_run(tmp_path / "a", 4, hellaswag=False), write_run(tmp_path / "b", 8, hellaswag=False)
    panels = axes_by_title(make_figure(load_runs([a, b])))
    assert set(panels) == {"loss", "val bits per byte", "learning rate", "throughput"}
    assert panels["throughput"].get_position().y1 < panels["loss"].get_position().y0  # below, not beside
    assert [line.get_label() for line in panels["throughput"].get_lines()] == ["a", "b"]
    out = tmp_path / "runs.png"
    run_plot(PlotConfig(run_dirs=[str(a), str(b)], out=str(out)))
    assert png_size(out) == (1320, 806)  # 12 x 7.33 inches at 110 dpi
    with_hellaswag = load_runs([a, write_run(tmp_path / "c", 8, hellaswag=True)])
    assert "HellaSwag" in axes_by_title(make_figure(with_hellaswag))


def test_val_bpb_panel_draws_the_runs_that_logged_it(tmp_path: Path) -> None:
    """A char-level run and a GPT-2 one: their losses per token are not comparable, their bits per byte are. A run
    whose data counted no bytes has no line there (and its loss is still drawn); with no run, the panel says why."""
    char = write_run(tmp_path / "char", 8, hellaswag=False, loss0=4.2, per_byte=1.0)
    bpe = write_run(tmp_path / "bpe", 8, hellaswag=False, per_byte=0.25)
    old = write_run(tmp_path / "old", 8, hellaswag=False)
    panels = axes_by_title(make_figure(load_runs([char, bpe, old])))
    lines = {line.get_label(): line for line in panels["val bits per byte"].get_lines()}
    assert set(lines) == {"char", "bpe"}
    assert list(lines["bpe"].get_xdata()) == [4, 8]
    assert list(lines["bpe"].get_ydata()) == pytest.approx([9.8 / math.log(2) * 0.25, 8.8 / math.log(2) * 0.25])
    loss = {line.get_label(): line for line in panels["loss"].get_lines()}
    assert lines["char"].get_color() == loss["char train"].get_color() and "old val" in loss  # old: its loss still
    empty = axes_by_title(make_figure(load_runs([old])))["val bits per byte"]
    assert empty.get_lines() == [] and any("prepare" in text.get_text() for text in empty.texts)


def test_a_mixtures_sources_get_their_bpb_lines_with_their_loss_markers(tmp_path: Path) -> None:
    """val_bpb/<source> beside val_loss/<source>; a source without byte counts (code) has a loss line only, and web
    keeps the same marker in both panels."""
    run = tmp_path / "mix"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3} for s in range(1, 9)]
    for row in rows[3::4]:
        row |= {"val_loss": 4.0, "val_loss/code": 5.5, "val_loss/web": 3.5, "val_bpb/web": 1.2}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = axes_by_title(make_figure(load_runs([run])))
    bpb = {line.get_label(): line for line in panels["val bits per byte"].get_lines()}
    loss = {line.get_label(): line for line in panels["loss"].get_lines()}
    assert set(bpb) == {"mix val web"} and {"mix val web", "mix val code"} <= set(loss)
    assert list(bpb["mix val web"].get_ydata()) == [1.2, 1.2]
    assert bpb["mix val web"].get_marker() == loss["mix val web"].get_marker() != loss["mix val code"].get_marker()


def test_resumed_run_keeps_one_row_per_step(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 4, hellaswag=False)
    with open(run / "metrics.jsonl", "a") as f:  # a repeated step (the later row wins) and a torn last line
        f.write(json.dumps({"step": 3, "loss": 1.5, "lr": 1e-3}) + "\n" + '{"step": 5, "lo')
    rows = load_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] == 1.5


def test_labels_are_directory_names_made_unique(tmp_path: Path) -> None:
    assert run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]
    assert run_labels([tmp_path / "x" / "run", tmp_path / "y" / "other"]) == ["run", "other"]


def _plot_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["plot", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    return err


def test_bad_inputs_give_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = write_run(tmp_path / "good", 4, hellaswag=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "not_a_run").mkdir()
    out = tmp_path / "out.png"

    assert "does not exist" in _plot_error(capsys, str(tmp_path / "missing"), "--out", str(out))
    assert "has no metrics.jsonl" in _plot_error(capsys, str(tmp_path / "not_a_run"), "--out", str(out))
    assert "holds no metrics rows" in _plot_error(capsys, str(good), str(tmp_path / "empty"), "--out", str(out))
    assert ".png" in _plot_error(capsys, str(good), "--out", str(tmp_path / "out.jpeg"))
    assert not out.exists()


def test_out_must_be_a_file_and_a_failed_write_keeps_the_old_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A folder named like the picture, a path under a file, a disk that fills up while saving: one line each, and
    the picture from before is still whole, with no temporary beside it."""
    import errno

    run = str(write_run(tmp_path / "a", 4, hellaswag=False))
    (tmp_path / "dir.png").mkdir()
    assert "is a folder; give a file name" in _plot_error(capsys, run, "--out", str(tmp_path / "dir.png"))
    (tmp_path / "a_file").write_text("x")
    assert _plot_error(capsys, run, "--out", str(tmp_path / "a_file" / "x.png")) == (
        f"error: cannot write --out {tmp_path / 'a_file' / 'x.png'}: {tmp_path / 'a_file'} is not a folder"
    )
    out = tmp_path / "runs.png"
    main(["plot", run, "--out", str(out)])
    before = out.read_bytes()
    write = Path.write_bytes

    def full_disk(self: Path, data: bytes) -> int:  # the first 100 bytes fit, then the disk is full
        write(self, data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    capsys.readouterr()
    said = _plot_error(capsys, run, "--out", str(out))
    assert said.startswith(f"error: cannot write --out {out}: no space left on the device"), said
    assert out.read_bytes() == before and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_other_formats_follow_the_suffix(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "runs.svg"
    main(["plot", str(write_run(tmp_path / "a", 4, hellaswag=True)), "--out", str(out)])
    assert out.read_text().lstrip().startswith("<?xml")
    assert "wrote" in capsys.readouterr().out


def test_missing_matplotlib_says_which_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    err = _plot_error(capsys, str(write_run(tmp_path / "a", 4, hellaswag=False)), "--out", str(tmp_path / "x.png"))
    assert "pip install 'accel_gpt[plot]'" in err


def test_hellaswag_gets_bars_of_one_standard_error(tmp_path: Path) -> None:
    """Where a run logged `<metric>_stderr`, each point gets a bar from value - stderr to value + stderr."""
    run = write_run(tmp_path / "a", 8, hellaswag=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "hellaswag_acc_norm" in row:
            row |= {"hellaswag_acc_norm_stderr": 0.05, "hellaswag_acc_stderr": 0.04}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = axes_by_title(make_figure(load_runs([run, write_run(tmp_path / "b", 8, hellaswag=True)])))
    bars = [segments for c in panels["HellaSwag"].collections for segments in c.get_segments()]
    acc_norm = [(step, 0.25 + 0.01 * step, 0.05) for step in (4, 8)]
    expected = acc_norm + [(step, 0.24 + 0.01 * step, 0.04) for step in (4, 8)]
    got = sorted((s[0][0], s[0][1], s[1][1]) for s in bars)
    want = sorted((step, value - e, value + e) for step, value, e in expected)
    assert len(got) == len(want)  # run b logged no standard errors: no bars
    assert all(g == pytest.approx(w) for g, w in zip(got, want, strict=True)), (got, want)
    assert "standard error" in panels["HellaSwag"].get_ylabel()
    assert not panels["loss"].collections


def test_rows_with_values_that_are_not_numbers_are_drawn_without_them(tmp_path: Path) -> None:
    """A hand-edited or foreign row: an object, a list or a string where a number was, a step that is not an
    integer. The numbers are drawn; the rest is left out (an object once stopped the plot with a TypeError)."""
    run = write_run(tmp_path / "r", 4, hellaswag=False)
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["loss"], rows[2]["lr"], rows[3]["grad_norm"] = {"a": 1}, [1, 2], "x"
    rows.append({"step": "5", "loss": 1.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["plot", str(run), "--out", str(tmp_path / "r.png")])
    assert (tmp_path / "r.png").stat().st_size > 0
    loaded = load_rows(run)
    assert [r["step"] for r in loaded] == [1, 2, 3, 4] and "loss" not in loaded[1] and "lr" not in loaded[2]


def test_the_run_dirs_may_come_from_the_config_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Every setting is a --config key, plot's positional run directories too; a flag's still wins, and none at all
    is one line."""
    a, b = write_run(tmp_path / "a", 4, hellaswag=False), write_run(tmp_path / "b", 4, hellaswag=False)
    config = tmp_path / "plot.yaml"
    config.write_text(f"run_dirs: [{a}]\nout: {tmp_path / 'c.png'}\n")
    main(["plot", "--config", str(config)])
    assert "(1 run," in capsys.readouterr().out
    main(["plot", "--config", str(config), str(a), str(b)])
    assert "(2 runs," in capsys.readouterr().out
    config.write_text(f"out: {tmp_path / 'c.png'}\n")
    assert _plot_error(capsys, "--config", str(config)).startswith("error: the following arguments are required")
