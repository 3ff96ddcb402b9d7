"""`run.py compare RUN_DIR ...`: runs side by side, one row each, with the settings they differ in.

Each row: the last val loss and bits per byte (comparable across tokenizers), steps, tokens, the steps' own time
(the sum over steps of the step's tokens over its logged tokens/s: evaluations and checkpoints are left out, as a
time budget leaves them out), parameters, and each setting whose value is not the same in every run. `--plot` draws
their curves in one figure (the `plot` command's); `--log` appends each run not yet listed to a tab-separated
experiment log, one line per run (its path, measures and the settings not at train's defaults) with a fixed header,
so that a series of experiments builds one table, in the spirit of autoresearch's results.tsv.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from accel_gpt.config import CompareConfig, PlotConfig, TrainConfig, normalised_weights, split_folders
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.evaluate.val_loss import run_val_windows
from accel_gpt.files import atomic_write, write_or_refuse
from accel_gpt.memory import parameter_counts
from accel_gpt.plot import load_rows, run_labels
from accel_gpt.rundir import ENV_REPORT, read_run_config
from accel_gpt.weights import MODEL_CONFIG, complete_checkpoints

# Settings that never make two runs different experiments: where they ran, and how often they said so.
_NOT_SETTINGS = ("out_dir", "config", "log_every", "log_with", "resume", "overwrite", "num_workers", "check_memory")
LOG_COLUMNS = ("run", "val_loss", "val_bpb", "steps", "tokens", "train_seconds", "parameters", "settings")


@dataclass
class Result:
    """One run's row."""

    label: str
    path: Path
    settings: dict[str, Any]
    val_loss: float | None
    val_bpb: float | None
    steps: int
    tokens: int
    seconds: float
    parameters: int | None
    processes: str  # how many processes trained it: "2", or each start's where they differed ("1,2"); "-" unknown
    val_step: int | None = None  # the step its val_loss was measured at (a run stopped past it)

    @classmethod
    def of(cls, run_dir: Path, label: str) -> Result:
        rows = load_rows(run_dir)
        settings = {k: v for k, v in read_run_config(run_dir).items() if k not in _NOT_SETTINGS}
        evaluated = [row for row in rows if row.get("val_loss") is not None]
        last = evaluated[-1] if evaluated else {}
        batch = settings.get("total_batch_size")
        seconds = sum(batch / row["tokens_per_sec"] for row in rows if row.get("tokens_per_sec")) if batch else 0.0
        steps = rows[-1]["step"]
        return cls(
            label, run_dir, settings, last.get("val_loss"), last.get("val_bpb"), steps, steps * (batch or 0),
            seconds, _parameters(settings), _processes(run_dir), last.get("step"),
        )  # fmt: skip


def _processes(run_dir: Path) -> str:
    """The processes of each start that trained the run's newest weights (their model_config.json's history), else
    what its launch report says; "-" where neither is there."""
    newest = [run_dir, *reversed(complete_checkpoints(run_dir))]
    for folder in newest:
        try:
            history = json.loads((folder / MODEL_CONFIG).read_text(encoding="utf-8")).get("history") or []
        except (OSError, ValueError, AttributeError):
            continue
        counts = list(dict.fromkeys(str(h["processes"]) for h in history if isinstance(h, dict) and h.get("processes")))
        if counts:
            return ",".join(counts)
    try:
        report = (run_dir / ENV_REPORT).read_text(encoding="utf-8")
    except OSError:
        return "-"
    found = re.search(r"^Num processes: (\d+)", report, re.MULTILINE)
    return found.group(1) if found else "-"


def _parameters(settings: dict[str, Any]) -> int | None:
    """The model's parameters from its shape (None where config.yaml lacks one of them)."""
    try:
        return parameter_counts(SimpleNamespace(**settings))[0]  # type: ignore[arg-type]
    except (AttributeError, TypeError):
        return None


def differing(results: list[Result]) -> list[str]:
    """The settings whose values are not the same in every run, in config order."""
    keys = list(dict.fromkeys(k for r in results for k in r.settings))
    return [k for k in keys if len({repr(r.settings.get(k)) for r in results}) > 1]


def val_set(settings: dict[str, Any]) -> dict[str, Any]:
    """What decides the text a run's val_loss was measured on, in one form: its folders (resolved, with their shares
    of a mixture's loss), the window length and the number of windows (an older config's eval_steps counted)."""
    given = split_folders(str(settings.get("data_dir") or ""))
    folders = [str(Path(d).expanduser().resolve()) for d in given]
    try:
        weights = normalised_weights(str(settings.get("data_weights") or ""), len(folders)) if folders else []
    except ConfigError:  # a config.yaml edited by hand: its folders are what there is to compare
        weights = [1.0] * len(folders)
    shares = sorted(zip(folders, (round(w, 9) for w in weights), strict=True))
    return {"data_dir": shares, "seq_len": settings.get("seq_len"), "eval_windows": run_val_windows(settings)}


def val_set_note(results: list[Result]) -> str | None:
    """A note where the runs were scored on different validation sets: bits per byte compare models across
    tokenizers, but only on the same text."""
    sets = [val_set(r.settings) for r in results]
    differ = [k for k in sets[0] if len({repr(s[k]) for s in sets}) > 1]
    if not differ:
        return None
    return (
        f"note: the runs were scored on different validation sets ({', '.join(differ)} differ): their val_loss and "
        "val_bpb compare them only as far as those sets are alike; `run.py eval --checkpoint RUN --data_dir D "
        "--eval_windows N` scores runs of one tokenizer on one set"
    )


def not_default(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run that are not train's defaults: what a log line needs to tell the experiment."""
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    return {k: v for k, v in settings.items() if k in defaults and v != defaults[k]}


def table(results: list[Result]) -> list[list[str]]:
    """Header and rows as text: the measures, then the settings that differ."""
    keys = differing(results)
    header = ["run", "val_loss", "val_bpb", "steps", "tokens", "train_s", "params", "processes", *keys]
    rows = [
        [
            r.label, _num(r.val_loss, 4) + _at(r), _num(r.val_bpb, 4) + _at(r), f"{r.steps:,}", f"{r.tokens:,}",
            f"{r.seconds:.4g}",
            f"{r.parameters / 1e6:.2f}M" if r.parameters else "-", r.processes,
            *(_text(r.settings.get(k)) for k in keys),
        ]
        for r in results
    ]  # fmt: skip
    return [header, *rows]


def _at(r: Result) -> str:
    """Where the last evaluation is older than the run's last step (stopped or killed past it): its step."""
    return f" (step {r.val_step:,})" if r.val_loss is not None and r.val_step not in (None, r.steps) else ""


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _text(value: Any) -> str:
    return "-" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def aligned(cells: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def append_log(path: Path, results: list[Result]) -> int:
    """Add each run not yet in the log at its step; return how many lines were added. A file that is not such a log
    is refused, so that it is never written into."""
    lines: list[list[str]] = []
    if path.exists():
        try:
            lines = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8")), delimiter="\t"))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise UserError(f"--log {path} cannot be read as an experiment log: {e}") from None
        if lines and tuple(lines[0]) != LOG_COLUMNS:
            raise UserError(f"--log {path} is not an experiment log of `compare` (its header is not theirs)")
    known = {(line[0], line[3]) for line in lines[1:] if len(line) == len(LOG_COLUMNS)}
    new = [r for r in results if (str(r.path), str(r.steps)) not in known]
    rows = [
        [
            str(r.path), _num(r.val_loss, 6), _num(r.val_bpb, 6), str(r.steps), str(r.tokens), f"{r.seconds:.2f}",
            str(r.parameters or ""), " ".join(f"{k}={_text(v)}" for k, v in not_default(r.settings).items()),
        ]
        for r in new
    ]  # fmt: skip
    out = io.StringIO()
    csv.writer(out, delimiter="\t", lineterminator="\n").writerows([LOG_COLUMNS] if not lines else [])
    csv.writer(out, delimiter="\t", lineterminator="\n").writerows(rows)
    before = path.read_text(encoding="utf-8") if lines else ""
    write_or_refuse(f"--log {path}", path, lambda: atomic_write(path, before + out.getvalue()))
    return len(rows)


def run_compare(cfg: CompareConfig) -> None:
    """`run.py compare`: the table on stdout; the plot and the log where asked for."""
    run_dirs = [Path(d) for d in cfg.run_dirs]
    if cfg.plot:  # a picture that cannot be written is said before the table, not after it
        from accel_gpt.plot import check_out_path

        check_out_path(Path(cfg.plot), "--plot")
    results = [Result.of(d, label) for d, label in zip(run_dirs, run_labels(run_dirs), strict=True)]
    print(aligned(table(results)))
    note = val_set_note(results)
    if note:
        print(note, file=sys.stderr)
    if cfg.plot:
        from accel_gpt.plot import run_plot

        run_plot(PlotConfig(run_dirs=cfg.run_dirs, out=cfg.plot), "--plot")
    if cfg.log:
        added = append_log(Path(cfg.log), results)
        print(f"logged {added} run{'s' if added != 1 else ''} to {cfg.log}")
