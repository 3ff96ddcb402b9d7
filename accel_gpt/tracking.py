"""What a run reports while it trains: metrics.jsonl rows, tracker logs, the progress bar, throughput and MFU.

The training step returns device tensors; `MetricsLogger` keeps them until its window ends and then reads
the whole window in one go: one all-reduce and one host sync per `log_every` steps, so the GPU runs ahead
in between. Throughput is averaged over the window's wall time, with evaluation and saving left out.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from accel_gpt.config import TrainConfig
from accel_gpt.metrics import METRICS, MetricsFile

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


def resolve_trackers(log_with: str) -> list[str] | None:
    """`auto`: TensorBoard when installed, else none (metrics.jsonl is always written)."""
    if log_with == "none":
        return None
    if log_with == "auto":
        has_tb = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        return ["tensorboard"] if has_tb else None
    return [name.strip() for name in log_with.split(",") if name.strip()]


def show_logs_above_progress_bar() -> None:
    """Our INFO lines go above the bar (tqdm.write), not glued to its end; Accelerate's own INFO stays quiet."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", handlers=[_TqdmHandler()])
    logging.getLogger("accel_gpt").setLevel(logging.INFO)


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


class MetricsLogger:
    """Steps since the last host sync, written out as one row per step when the window is collected."""

    def __init__(self, cfg: TrainConfig, accelerator: Accelerator, flops_per_token: int, step: int) -> None:
        self.accelerator = accelerator
        self.tokens_per_step = cfg.total_batch_size
        self.log_every = cfg.log_every
        self.flops_per_token = flops_per_token
        self.peak = device_peak_flops(accelerator.device)
        self.file = MetricsFile(Path(cfg.out_dir) / METRICS, accelerator.is_main_process)
        self.file.truncate_after(step)  # rows past a resumed step are written again (an attempt may have logged them)
        self.progress = tqdm(
            total=cfg.max_steps, initial=step, unit="step", disable=not accelerator.is_main_process, dynamic_ncols=True
        )
        self.rows: list[dict[str, Any]] = []
        self.last_row: dict[str, Any] = {}
        self.start_step = step
        self.started = time.perf_counter()
        self.restart_clock()

    def due(self, step: int, last: bool) -> bool:
        return last or step % self.log_every == 0

    def add(self, row: dict[str, Any]) -> None:
        """One step's `loss` (this rank's mean, a device tensor), `grad_norm` (a device tensor) and `lr`."""
        self.rows.append(row)

    def collect(self, step: int) -> list[dict[str, Any]]:
        """Read the window from the device: the ranks' losses averaged in one all-reduce, then one host sync."""
        losses = self.accelerator.reduce(torch.stack([r["loss"] for r in self.rows]), "mean")
        grad_norms = torch.stack([_local(r["grad_norm"]).float() for r in self.rows])
        values = torch.stack([losses.float(), grad_norms], dim=1).tolist()
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
            }
            for i, (r, (loss, grad_norm)) in enumerate(zip(self.rows, values, strict=True))
        ]
        self.rows = []
        return rows

    def write(self, rows: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        """metrics.jsonl and trackers (main process), the progress bar; `extra` (evaluations) joins the last row."""
        rows[-1].update(extra)
        self.last_row = rows[-1]
        self.file.write(rows)
        for row in rows:
            self.accelerator.log({k: v for k, v in row.items() if v is not None and k != "step"}, step=row["step"])
        last = rows[-1]
        postfix = {"loss": f"{last['loss']:.4f}", "lr": f"{last['lr']:.2e}", "tok/s": f"{last['tokens_per_sec']:,.0f}"}
        if "val_loss" in last:
            postfix["val"] = f"{last['val_loss']:.4f}"
        self.progress.set_postfix(postfix, refresh=False)
        self.progress.update(len(rows))  # after the postfix: the bar shows this window's values
        self.restart_clock()

    def restart_clock(self) -> None:
        """Time spent outside training steps (evaluation, saving) stays out of the next window's throughput."""
        self.t0 = time.perf_counter()

    def summary(self, step: int, max_steps: int, tokens_seen: int, last_val_loss: float, out_dir: str) -> str:
        self.progress.close()
        minutes = (time.perf_counter() - self.started) / 60
        losses = f"final loss {self.last_row['loss']:.4f}" if self.last_row else "no step taken"
        if not math.isnan(last_val_loss):
            losses += f", last val_loss {last_val_loss:.4f}"
        return (
            f"finished at step {step}/{max_steps} in {minutes:.1f} min, {tokens_seen:,} tokens seen; {losses}; "
            f"run dir {out_dir} (metrics.jsonl, config.yaml, checkpoints/, model.safetensors)"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor: under FSDP2 `clip_grad_norm_` returns a replicated DTensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
