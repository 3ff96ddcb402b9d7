"""`metrics.jsonl`: one JSON object per optimizer step, appended by the main process as training goes.

Every row has `step, loss, lr, grad_norm, tokens_per_sec, mfu, flops_per_sec`; evaluation steps add
`val_loss` and `val_bpb` (bits per byte, when the data records its byte count; for a mixture also
`val_loss/<source>` and `val_bpb/<source>`), `hellaswag_acc_norm`, `hellaswag_acc` and their standard errors
`hellaswag_acc_norm_stderr`, `hellaswag_acc_stderr`; a step the spike guard skipped has `"skipped": true`. A resumed
run first cuts the file back to the step it continues from, so each step appears once. This module imports no
torch: `plot` reads it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accel_gpt.errors import UserError
from accel_gpt.files import atomic_write, write_failure

METRICS = "metrics.jsonl"


class MetricsFile:
    """Append-only rows; every method is a no-op unless `enabled` (the main process)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def write(self, rows: list[dict[str, Any]]) -> str | None:
        """Append `rows`; None, or why they could not be written (a full or read-only disk)."""
        if not self.enabled or not rows:
            return None
        text = "".join(json.dumps(row) + "\n" for row in rows)

        def append() -> None:
            with open(self.path, "a") as f:
                f.write(text)

        return write_failure(self.path.parent, append, len(text.encode()))

    def check(self) -> None:
        """Refuse, before the first step, a path that cannot hold the rows: a folder, or a link to nowhere."""
        if (self.path.exists() or self.path.is_symlink()) and not self.path.is_file():
            what = "a folder" if self.path.is_dir() else "not a file (a link to nowhere?)"
            said = f"{self.path} is {what}, where the run writes its metrics rows"
            raise UserError(f"{said}: move it aside and run again")

    def truncate_after(self, step: int) -> int | None:
        """Keep only rows up to `step`: a resumed run writes what follows again. A torn last line, or any line
        that is not a row with an integer step (the file is the user's too), is dropped rather than stop a resume.
        Returns the last step kept (0: none; None where this process does not write the file)."""
        if not self.enabled:
            return None
        if not self.path.exists():
            return 0
        rows = [row for row in read_metrics(self.path) if isinstance(row.get("step"), int) and row["step"] <= step]
        atomic_write(self.path, "".join(json.dumps(row) + "\n" for row in rows))
        return max((row["step"] for row in rows), default=0)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, skipping a torn last line (a run killed mid-write) and non-object lines."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class Tally:
    """How often a pause in training (an evaluation, a checkpoint) ran and its seconds in all: the final line says
    what each costs, which is what sizes eval_every and save_every."""

    def __init__(self, what: str) -> None:
        self.what, self.count, self.seconds = what, 0, 0.0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - start

    def describe(self) -> str:
        """e.g. `2 checkpoints, 0.41 s each`; empty when it never ran."""
        if not self.count:
            return ""
        plural = "s" if self.count != 1 else ""
        return f"{self.count} {self.what}{plural}, {self.seconds / self.count:.3g} s each"
