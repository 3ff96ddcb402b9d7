"""`run.py plot`: one picture of how runs went, from their `metrics.jsonl` alone.

Five panels over optimizer steps: train and val loss (and, for a mixture of data sources, each source's
val loss), val bits per byte (the one curve that compares runs with different tokenizers; a run whose data has
no byte count simply has no line there), learning rate, HellaSwag accuracy (with a bar of one standard error each
way where the run logged it: on a few hundred examples the accuracy moves by noise), tokens/s across the bottom.
HellaSwag's panel is left out when none of the runs scored it (most runs do not), rather than a fifth of the figure
saying so: the figure is then a row shorter, with throughput beside the learning rate.
Several runs are overlaid, one colour per run, named by their directory. matplotlib is an optional
extra (`pip install accel_gpt[plot]`) and is imported only here; the figure is drawn with the Agg
canvas directly (no pyplot), so no display or GUI backend is ever touched.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel_gpt.config import PlotConfig
from accel_gpt.errors import UserError
from accel_gpt.files import replacing, write_or_refuse
from accel_gpt.metrics import METRICS, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMATS = (".png", ".pdf", ".svg")


@dataclass(frozen=True)
class Curve:
    """One metric of one run: the steps where it was logged and its values there."""

    key: str
    style: str  # matplotlib line style: solid for the headline metric, dashed for its companion
    label: str  # what the line is within its panel ("train", "val", "acc_norm", ...)
    markers: bool  # sparse metrics (evaluations) get markers so a single point still shows
    marker: str = "o"  # each source of a mixture gets its own, so its val curves tell apart within one colour


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    curves: tuple[Curve, ...]
    # shown instead of lines when no run logged any of the panel's metrics; None: the panel is left out then
    empty_note: str | None
    baseline: tuple[float, str] | None = None  # a reference level drawn under the runs, with its label


PANELS = (
    Panel(
        "loss",
        "cross-entropy (nats/token)",
        (Curve("loss", "-", "train", False), Curve("val_loss", "--", "val", True)),
        "no loss logged",
    ),
    Panel(
        "val bits per byte",
        "bits per UTF-8 byte of text (any tokenizer)",
        (Curve("val_bpb", "--", "val", True),),
        "no val_bpb logged\n(needs evaluations on data whose manifest\ncounts bytes: run its prepare again)",
    ),
    Panel("learning rate", "lr", (Curve("lr", "-", "lr", False),), "no learning rate logged"),
    Panel(
        "HellaSwag",
        "accuracy (bars: ± 1 standard error)",
        (Curve("hellaswag_acc_norm", "-", "acc_norm", True), Curve("hellaswag_acc", ":", "acc", True)),
        None,
        baseline=(0.25, "chance (1 in 4)"),  # four endings per example: a model that learned nothing
    ),
    Panel("throughput", "tokens/s", (Curve("tokens_per_sec", "-", "tokens/s", False),), "no throughput logged"),
)


# Where each panel goes: the two validation measures side by side on top, throughput across the bottom; without
# HellaSwag, throughput takes its place and the figure is a row shorter.
LAYOUT = [["loss", "val bits per byte"], ["learning rate", "HellaSwag"], ["throughput", "throughput"]]
LAYOUT_WITHOUT_HELLASWAG = [["loss", "val bits per byte"], ["learning rate", "throughput"]]
ROW_INCHES = 11 / 3  # the figure is 12 inches wide, 11 high for three rows
SOURCE_MARKERS = ("s", "^", "v", "D", "P", "X", "*")
# A mixture's per-source metrics (`<metric>/<folder name>`), by the panel that draws them.
SOURCE_PREFIXES = {"loss": "val_loss/", "val bits per byte": "val_bpb/"}
STDERR_SUFFIX = "_stderr"  # a metric's standard error, logged beside it (HellaSwag's accuracies)


def source_curves(runs: Sequence[RunMetrics], prefix: str) -> tuple[Curve, ...]:
    """A panel's extra lines for mixtures: each source's `prefix<name>` metric, dash-dotted, one marker per source,
    the same in every panel (numbered among all sources, also those that have no line in this panel)."""
    keys = {key for run in runs for row in run.rows for key in row}
    names = sorted({k.split("/", 1)[1] for k in keys for p in SOURCE_PREFIXES.values() if k.startswith(p)})
    return tuple(
        Curve(f"{prefix}{name}", "-.", f"val {name}", True, SOURCE_MARKERS[i % len(SOURCE_MARKERS)])
        for i, name in enumerate(names)
        if f"{prefix}{name}" in keys
    )


@dataclass
class RunMetrics:
    label: str
    rows: list[dict[str, Any]]  # one per step, sorted by step

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values where `key` was logged (evaluation metrics appear on some steps only)."""
        points = [(row["step"], row[key]) for row in self.rows if row.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]

    def spread(self, key: str) -> tuple[list[int], list[float], list[float]]:
        """Steps, lower and upper ends of `key` -/+ its standard error (`<key>_stderr`), where both were logged."""
        points = [
            (row["step"], row[key], row[f"{key}{STDERR_SUFFIX}"])
            for row in self.rows
            if row.get(key) is not None and row.get(f"{key}{STDERR_SUFFIX}") is not None
        ]
        return [s for s, _, _ in points], [v - e for _, v, e in points], [v + e for _, v, e in points]


def run_plot(cfg: PlotConfig, flag: str = "--out") -> None:
    """`run.py plot`: read the runs, draw, save; prints the path written. `flag`: the option that named the picture
    (compare's `--plot`), which its errors name."""
    out = Path(cfg.out)
    check_out_path(out, flag)
    require_matplotlib()
    runs = load_runs([Path(d) for d in cfg.run_dirs])
    figure = make_figure(runs)
    save_figure(figure, out, flag)
    steps = max(run.rows[-1]["step"] for run in runs)
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''}, up to step {steps})")


def require_matplotlib() -> None:
    """matplotlib is an optional extra: say how to get it instead of showing an ImportError traceback."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("`plot` needs matplotlib: pip install 'accel_gpt[plot]' (or pip install matplotlib)") from None


def check_out_path(out: Path, flag: str = "--out") -> None:
    """Fail before reading anything when the picture could not be written in the asked format, or not at all (a
    folder of that name, or no writable folder to put it in)."""
    if out.is_dir():
        raise UserError(f"{flag} {out} is a folder; give a file name, e.g. {flag} {out / 'runs.png'}")
    if out.suffix.lower() not in FORMATS:
        raise UserError(f"{flag} {out}: the file name must end in {', '.join(FORMATS)} (the format follows it)")
    folder = next(p for p in out.absolute().parents if p.exists())  # the nearest folder that exists
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        reason = "not a folder" if not folder.is_dir() else "not writable (read-only or no permission)"
        raise UserError(f"cannot write {flag} {out}: {folder} is {reason}")


def save_figure(figure: Figure, out: Path, flag: str = "--out") -> None:
    """Written whole or not at all: a reader (or a browser refreshing the picture) never sees half a PNG, and a
    failed write leaves the previous picture as it was."""

    rendered = io.BytesIO()  # rendered first, so that a full disk is told with the picture's size
    figure.savefig(rendered, format=out.suffix[1:].lower(), dpi=110)
    data = rendered.getvalue()

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with replacing(out) as tmp:
            tmp.write_bytes(data)

    write_or_refuse(f"{flag} {out}", out, write, len(data))


def load_runs(run_dirs: Sequence[Path]) -> list[RunMetrics]:
    labels = run_labels(run_dirs)
    return [RunMetrics(label, load_rows(run_dir)) for run_dir, label in zip(run_dirs, labels, strict=True)]


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of `run_dir/metrics.jsonl`, one per step (the last one wins if a step repeats), sorted by step."""
    path = run_dir / METRICS
    if not path.is_file():
        what = "does not exist" if not run_dir.exists() else "has no metrics.jsonl"
        raise UserError(f"run dir '{run_dir}' {what}: expected a folder written by `run.py train`")
    by_step = {  # numbers only: a hand-edited or foreign row's other values are left out, not drawn
        row["step"]: {k: v for k, v in row.items() if isinstance(v, int | float)}
        for row in read_metrics(path)
        if isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
    }
    if not by_step:
        raise UserError(f"{path} holds no metrics rows yet (a run writes one per optimizer step)")
    return [by_step[step] for step in sorted(by_step)]


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """The directory name, or more of the path where two runs share a name (a/run vs b/run)."""
    resolved = [d.resolve() for d in run_dirs]
    for depth in range(1, max(len(p.parts) for p in resolved) + 1):
        labels = ["/".join(p.parts[-depth:]) for p in resolved]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in run_dirs]  # the same folder given twice: keep what the user typed


def make_figure(runs: Sequence[RunMetrics]) -> Figure:
    """PANELS placed by LAYOUT; each run keeps one colour across panels, the legends name runs and line styles."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [panel for panel in PANELS if panel.empty_note is not None or has_values(panel, runs)]
    layout = LAYOUT if any(panel.title == "HellaSwag" for panel in panels) else LAYOUT_WITHOUT_HELLASWAG
    figure = Figure(figsize=(12, ROW_INCHES * len(layout)), layout="constrained")
    FigureCanvasAgg(figure)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    axes = figure.subplot_mosaic(layout)
    for panel in panels:
        draw_panel(axes[panel.title], panel, runs, colors)
    figure.suptitle(", ".join(run.label for run in runs) if len(runs) <= 3 else f"{len(runs)} runs")
    return figure


def has_values(panel: Panel, runs: Sequence[RunMetrics]) -> bool:
    """Whether any run logged a value of one of the panel's own metrics."""
    return any(run.series(curve.key)[0] for run in runs for curve in panel.curves)


def draw_panel(ax: Axes, panel: Panel, runs: Sequence[RunMetrics], colors: Sequence[str]) -> None:
    from matplotlib.ticker import EngFormatter

    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if panel.curves[0].key == "tokens_per_sec":
        ax.yaxis.set_major_formatter(EngFormatter())
    drawn = False
    prefix = SOURCE_PREFIXES.get(panel.title)
    curves = panel.curves + (source_curves(runs, prefix) if prefix else ())
    for run, color in zip(runs, colors, strict=True):
        for curve in curves:
            steps, values = run.series(curve.key)
            if not steps:
                continue
            label = run.label if len(curves) == 1 else f"{run.label} {curve.label}"
            marker = curve.marker if curve.markers else None
            ax.plot(steps, values, curve.style, color=color, marker=marker, markersize=3, linewidth=1.2, label=label)
            bar_steps, low, high = run.spread(curve.key)
            if bar_steps:
                ax.vlines(bar_steps, low, high, color=color, linewidth=0.8, alpha=0.5)
            drawn = True
    if drawn:
        if panel.baseline is not None:
            level, label = panel.baseline
            ax.axhline(level, color="gray", linestyle="--", linewidth=0.8, label=label)
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, panel.empty_note, ha="center", va="center", transform=ax.transAxes, color="gray")
