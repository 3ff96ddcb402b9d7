"""Throughput, model FLOPs utilisation, and the per-step metrics rows (metrics.jsonl + trackers)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

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


class MetricsFile:
    """Append-only metrics.jsonl; one JSON object per optimizer step, written by the main process only."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not self.enabled or not rows:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
            f.flush()

    def truncate_after(self, step: int) -> None:
        """Keep only rows up to `step` (and drop a torn last line): a resumed run rewrites what follows."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) <= step:
                kept.append(line + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl, skipping a torn last line."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
