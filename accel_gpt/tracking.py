"""What a run reports while it trains: metrics.jsonl rows, tracker logs, the progress bar, throughput and MFU.

The training step returns device tensors; `MetricsLogger` keeps them until its window ends and then reads
the whole window in one go: one all-reduce and one host sync per `log_every` steps, so the GPU runs ahead
in between. Throughput is averaged over the window's wall time, with evaluation and saving left out. That read is
also where a diverged run is caught: a non-finite loss or gradient norm stops the run there, before the step's
checkpoint or final weights could be written, at no extra sync.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from accel_gpt.checkpoint import TrainState, complete_checkpoints, final_step
from accel_gpt.config import TrainConfig
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.metrics import METRICS, MetricsFile, read_metrics
from accel_gpt.rundir import same_on_every_rank

logger = get_logger(__name__)

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' data sheets. The first name
# found in torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of one device, or None where unknown (CPU: only achieved FLOP/s is reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


# The `pip install` that brings a tracker (the project's extras where it has one).
TRACKER_INSTALL = {"tensorboard": 'pip install -e ".[tensorboard]"', "wandb": 'pip install -e ".[wandb]"'}
TRACKER_ALIASES = {
    "tb": "tensorboard",
    "tensorboardx": "tensorboard",
    "weights_and_biases": "wandb",
    "comet": "comet_ml",
}


def resolve_trackers(log_with: str) -> list[str] | None:
    """`auto`: TensorBoard when installed, else none (metrics.jsonl is always written). Named trackers must be
    Accelerate's and installed: Accelerate raises a traceback for an unknown name and silently drops a missing one.
    """
    if log_with == "none":
        return None
    if log_with == "auto":
        has_tb = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        return ["tensorboard"] if has_tb else None
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    known = [str(t) for t in LoggerType if str(t) != "all"]
    available = {str(t) for t in get_available_trackers()}
    names = [name.strip() for name in log_with.split(",") if name.strip()]
    for name in names:
        if name not in known:
            close = [TRACKER_ALIASES[name]] if name in TRACKER_ALIASES else difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"log_with {name!r} is not a tracker{hint}; use auto, none, or some of: {', '.join(known)}"
            )
        if name not in available:
            install = TRACKER_INSTALL.get(name, f"pip install {name}")
            raise ConfigError(f"log_with {name}: {name} is not installed; {install}, or pass --log_with none")
    return names or None


def show_logs_above_progress_bar() -> None:
    """Our INFO lines go above the bar (tqdm.write), not glued to its end; Accelerate's own INFO stays quiet."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", handlers=[_TqdmHandler()])
    logging.getLogger("accel_gpt").setLevel(logging.INFO)


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except OSError:  # the terminal is gone (a closed ssh session): the run goes on and saves, unseen
            pass


class MetricsLogger:
    """Steps since the last host sync, written out as one row per step when the window is collected."""

    def __init__(
        self,
        cfg: TrainConfig,
        accelerator: Accelerator,
        flops_per_token: int,
        step: int,
        vocab_size: int = 0,
        warmup: Callable[[], float] | None = None,
        horizon: Callable[[], float | None] | None = None,
    ) -> None:
        """`vocab_size`: the tokenizer's (the model's rows past it are padding), for `_warn_if_above_uniform`, which
        also needs the warm-up's length (`warmup`: a budget's follows its horizon). `horizon`: a time budget's
        expected last step, the progress bar's total."""
        self.accelerator = accelerator
        self.tokens_per_step = cfg.total_batch_size
        self.optimizer = cfg.optimizer  # the rates a divergence message names
        self.vocab_size, self.grad_clip = vocab_size, cfg.grad_clip
        self.warmup = warmup or (lambda: cfg.warmup_steps or 0)
        self.horizon, self.max_steps = horizon, cfg.max_steps
        self.warned_above_uniform = False
        self.log_every = cfg.log_every
        self.flops_per_token = flops_per_token
        self.peak = device_peak_flops(accelerator.device)
        self.out_dir = Path(cfg.out_dir)
        self.file = MetricsFile(self.out_dir / METRICS, accelerator.is_main_process)
        self.file.check()  # on every rank: all see the one out_dir
        last = self.file.truncate_after(step)  # rows past a resumed step are written again (an attempt logged them)
        if last is not None and last < step:  # a save writes its rows first: its run's file reaches its step
            logger.warning(
                f"{self.file.path} holds rows up to step {last} only, and the run resumes at step {step}: the rows "
                f"of steps {last + 1}-{step} are not in it (a checkpoint of a copy of this run that went on elsewhere, "
                "or the file restored from an older backup)"
            )
        self.progress = tqdm(  # a budget's total comes with its horizon (none before the first timed step)
            total=None if horizon else cfg.max_steps,
            initial=step,
            unit="step",
            disable=not accelerator.is_main_process,
            dynamic_ncols=True,
        )
        self._follow_horizon(step)
        self.rows: list[dict[str, Any]] = []
        self.last_row: dict[str, Any] = {}
        self.skipped = self._skipped_before()  # steps the spike guard skipped, shown in the bar and the summary
        self.clipped = 0  # gradients it scaled down since this start, in the summary
        self.last_val = self._last_val_before()  # the newest evaluation's row: its val_bpb goes into the summary
        self.start_step = step
        self.started = time.perf_counter()
        self.restart_clock()

    def _skipped_before(self) -> int:
        """Skipped steps in the rows a resumed run keeps (main process: the only one that shows them)."""
        if not self.file.enabled or not self.file.path.exists():
            return 0
        return sum(row.get("skipped") is True for row in read_metrics(self.file.path))

    def _last_val_before(self) -> dict[str, Any]:
        """The newest row with a val_loss among those a resumed run keeps (main process: the only one that reports)."""
        if not self.file.enabled or not self.file.path.exists():
            return {}
        return next((row for row in reversed(read_metrics(self.file.path)) if "val_loss" in row), {})

    def due(self, step: int, last: bool) -> bool:
        return last or step % self.log_every == 0

    def add(self, row: dict[str, Any]) -> None:
        """One step's `loss` (this rank's mean, a device tensor), `grad_norm` (a device tensor) and `lr`."""
        self.rows.append(row)

    def collect(self, step: int) -> list[dict[str, Any]]:
        """Read the window from the device: the ranks' losses averaged in one all-reduce, then one host sync."""
        losses = self.accelerator.reduce(torch.stack([r["loss"] for r in self.rows]), "mean")
        grad_norms = torch.stack([r["grad_norm"].float() for r in self.rows])
        columns = [losses.float(), grad_norms]
        if "skipped" in self.rows[0]:  # the spike guard's decisions come in the same read
            columns += [torch.stack([r[k] for r in self.rows]).float() for k in ("skipped", "clipped")]
        values = torch.stack(columns, dim=1).tolist()
        tokens_per_sec = len(self.rows) * self.tokens_per_step / (time.perf_counter() - self.t0)
        flops_per_sec = tokens_per_sec * self.flops_per_token
        mfu = flops_per_sec / (self.peak * self.accelerator.num_processes) if self.peak else None
        first = step - len(self.rows) + 1
        rows = [
            {
                "step": first + i,
                "loss": loss,
                "lr": r["lr"],
                "grad_norm": grad_norm,
                "tokens_per_sec": tokens_per_sec,
                "mfu": mfu,
                "flops_per_sec": flops_per_sec,
                **({"skipped": True} if guard and guard[0] else {}),
                **({"clipped": True} if guard and guard[1] and not guard[0] else {}),
            }
            for i, (r, (loss, grad_norm, *guard)) in enumerate(zip(self.rows, values, strict=True))
        ]
        self.rows = []
        self._stop_if_diverged(rows)
        self._warn_if_above_uniform(rows)
        return rows

    def _warn_if_above_uniform(self, rows: list[dict[str, Any]]) -> None:
        """Past warm-up, a loss over a nat above a uniform guess's (ln V) means the updates are breaking the weights:
        the run goes on (it may come back), but says so once, with the remedy. A healthy run starts near ln V and
        stays under it (tiny-cpu's worst spike after warm-up: 8.15 against ln 8,192 = 9.01)."""
        if self.warned_above_uniform or not self.vocab_size:
            return
        uniform = math.log(self.vocab_size)
        warmup = self.warmup()
        applied = [r for r in rows if r["step"] > warmup and not r.get("skipped")]  # the guard's are not
        bad = next((r for r in applied if r["loss"] > uniform + 1), None)
        if bad:
            self.warned_above_uniform = True
            clipping = "; --grad_clip 1 bounds each update" if not self.grad_clip else ""
            logger.warning(
                f"step {bad['step']}: loss {bad['loss']:.4g} is above a uniform guess's (ln {self.vocab_size:,} = "
                f"{uniform:.4g}): the updates are breaking the weights; train again with {lower_rate(self.optimizer)}"
                f"{clipping}"
            )

    def _stop_if_diverged(self, rows: list[dict[str, Any]]) -> None:
        """A non-finite loss (the weights before the step) or gradient norm (the weights it makes) ends the run
        before anything of that step is saved: its rows up to the bad one are written, then every rank raises
        (the values are all-reduced, so all see them)."""
        applied = [r for r in rows if not r.get("skipped")]  # a step the spike guard skipped made no weights
        bad = next((r for r in applied if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]))), None)
        if bad is None:
            return
        self._write(rows[: rows.index(bad) + 1])
        self.progress.close()
        then = divergence_advice(self.out_dir, bad["step"], self.optimizer)
        raise UserError(
            f"training diverged at step {bad['step']} (loss {bad['loss']}, grad_norm {bad['grad_norm']}): stopped "
            f"without saving its weights; {then}"
        )

    def _write(self, rows: list[dict[str, Any]]) -> None:
        """metrics.jsonl, or one line on every rank where it cannot be written: a resume cuts a torn row away."""
        error = same_on_every_rank(self.accelerator, self.file.write(rows))
        if error is None:
            return
        self.progress.close()
        if complete_checkpoints(self.out_dir):
            then = "make room (or fix the folder), then continue with --resume auto"
        else:
            then = "no checkpoint was saved: make room, then train again with --overwrite true"
        stopped = f"the run stopped after step {rows[-1]['step']}"
        raise UserError(f"cannot write {self.file.path}: {error}; {stopped}; {then}")

    def write(self, rows: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        """metrics.jsonl and trackers (main process), the progress bar; `extra` (evaluations) joins the last row."""
        rows[-1].update(extra)
        self.last_row = rows[-1]
        if "val_loss" in extra:
            self.last_val = rows[-1]
        self._write(rows)
        for row in rows:
            self.accelerator.log({k: v for k, v in row.items() if v is not None and k != "step"}, step=row["step"])
            if row.get("skipped"):
                self.skipped += 1
                logger.info(
                    f"step {row['step']} skipped by the spike guard (loss {row['loss']:.4f}, grad_norm "
                    f"{row['grad_norm']:.4g}): no update, the schedule and the data move on"
                )
            elif row.get("clipped"):
                self.clipped += 1
                logger.info(
                    f"step {row['step']}: the spike guard scaled its gradient (norm {row['grad_norm']:.4g}) down to "
                    "the window's bound"
                )
        last = rows[-1]
        postfix = {"loss": f"{last['loss']:.4f}", "lr": f"{last['lr']:.2e}", "tok/s": f"{last['tokens_per_sec']:,.0f}"}
        if "val_loss" in last:
            postfix["val"] = f"{last['val_loss']:.4f}"
        if self.skipped:
            postfix["skipped"] = str(self.skipped)
        self.progress.set_postfix(postfix, refresh=False)
        self._follow_horizon(last["step"] + 1)
        self.progress.update(len(rows))  # after the postfix: the bar shows this window's values
        self.restart_clock()

    def _follow_horizon(self, at_least: int) -> None:
        """Under a time budget the bar's total is the step the budget is expected to end at (its ETA then follows the
        budget, not max_steps), at least `at_least` while the run goes on."""
        expected = self.horizon() if self.horizon else None
        if expected is not None:
            self.progress.total = min(self.max_steps, max(at_least, math.ceil(expected)))

    def restart_clock(self) -> None:
        """Time spent outside training steps (evaluation, saving) stays out of the next window's throughput."""
        self.t0 = time.perf_counter()

    def summary(self, state: TrainState, cfg: TrainConfig, weights: str | None) -> str:
        """The run's last line. `weights`: what the final model.safetensors holds (None: none was written)."""
        self.progress.close()
        minutes = (time.perf_counter() - self.started) / 60
        losses = f"final loss {self.last_row['loss']:.4f}" if self.last_row else "no step taken"
        last_val_loss = state.last_val_loss
        if not math.isnan(last_val_loss):
            losses += f", last val_loss {last_val_loss:.4f}"
            if self.last_val.get("val_loss") == last_val_loss and "val_bpb" in self.last_val:  # the same evaluation's
                losses += f", val_bpb {self.last_val['val_bpb']:.4f}"
        if self.skipped or self.clipped:
            losses += f"; the spike guard skipped {self.skipped} step(s) and scaled down {self.clipped} gradient(s)"
        seconds = minutes * 60
        took = f"in {seconds:.1f} s" if seconds < 60 else f"in {minutes:.1f} min"
        took += f" (this attempt, from step {self.start_step})" if self.start_step else ""
        saved = (Path(cfg.out_dir) / "checkpoints").is_dir()
        files = "metrics.jsonl, config.yaml" + (", checkpoints/" if saved else "")
        if not weights:  # stopped before its last step: final weights there are an earlier finish's
            older = final_step(Path(cfg.out_dir))
            weights = f"the final weights are step {older}'s, older than this" if older else "no final weights yet"
        return (
            f"finished at step {state.step}/{cfg.max_steps} {took}, {state.tokens_seen:,} tokens seen; "
            f"{losses}; run dir {cfg.out_dir} ({files}; {weights})"
        )


def lower_rate(optimizer: str) -> str:
    """The remedy for updates too large, in the rates `optimizer` has."""
    return "a lower --muon_lr or --learning_rate" if optimizer == "muon" else "a lower --learning_rate"


def divergence_advice(out_dir: str | Path, bad_step: int, optimizer: str) -> str:
    """Where to go on from a run whose step `bad_step` met broken weights, and with what."""
    lower = lower_rate(optimizer)
    good = checkpoint_before(out_dir, bad_step)
    if good is not None:
        return f"the newest checkpoint before it, {good}, gave finite values: resume from it by path with {lower}"
    return f"no checkpoint was saved before it: train again with {lower} and --overwrite true"


def checkpoint_before(out_dir: str | Path, step: int) -> Path | None:
    """The newest complete checkpoint whose weights gave step `step - 1` its values, i.e. of step `step - 2` or
    earlier: step k's loss and gradient come from the weights of step k - 1, so where step k's are bad, checkpoint
    k - 1 holds the weights that gave them."""
    done = [p for p in complete_checkpoints(out_dir) if int(p.name.removeprefix("step_")) <= step - 2]
    return done[-1] if done else None
