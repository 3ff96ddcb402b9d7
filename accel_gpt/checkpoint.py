"""Checkpoints: `TrainState`, atomic `save_state` folders, pruning, and resuming from one.

Layout: `out_dir/checkpoints/step_XXXXXXXX/` holds what `accelerator.save_state` writes (model,
optimizer, scheduler, each rank's RNG state, the registered `TrainState`), plus `model_config.json`
(so eval/sample/export can read it) and `COMPLETE`, written last. A save goes into a hidden
`.tmp-step_XXXXXXXX/` folder that is renamed only once every rank has written its part, so a crash
mid-save leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.logging import get_logger

from accel_gpt.artifacts import MODEL_CONFIG
from accel_gpt.config import MODEL_FIELDS
from accel_gpt.errors import UserError

logger = get_logger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
# Fields that a resumed run must share with its checkpoint: the model's shape, and the global batch,
# which fixes how far the data stream has advanced per step.
RESUME_FIELDS = (*MODEL_FIELDS, "total_batch_size", "seed")


@dataclass
class TrainState:
    """Everything about the run's progress that the model/optimizer/scheduler states do not hold.

    Registered with `accelerator.register_for_checkpointing`, so it rides in every `save_state`. Its
    state_dict holds only numbers and strings (the same on every rank), so it loads with
    `torch.load(weights_only=True)`.
    """

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # global, all ranks
    data_position: int = 0  # training windows consumed from the seeded stream
    best_val_loss: float = math.inf
    last_val_loss: float = math.nan
    config: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data_position": self.data_position,
            "best_val_loss": self.best_val_loss,
            "last_val_loss": self.last_val_loss,
            "config_json": json.dumps(self.config),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.data_position = int(sd["data_position"])
        self.best_val_loss = float(sd["best_val_loss"])
        self.last_val_loss = float(sd["last_val_loss"])
        self.config = json.loads(sd["config_json"])


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete folders are skipped with a warning."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = []
    for p in sorted(root.glob("step_*")):
        if (p / COMPLETE).is_file():
            done.append(p)
        else:
            logger.warning(f"skipping incomplete checkpoint {p} (no {COMPLETE} marker)")
    return done


def save_checkpoint(
    accelerator: Accelerator,
    out_dir: str | Path,
    state: TrainState,
    model_meta: dict[str, Any],
    keep: int,
    keep_best: bool,
) -> Path:
    """Every rank calls this: `save_state` into a temporary folder, then the main process publishes it."""
    root = Path(out_dir) / CHECKPOINTS
    final = root / checkpoint_name(state.step)
    tmp = root / f".tmp-{checkpoint_name(state.step)}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's RNG file and shard is in tmp
    if accelerator.is_main_process:
        (tmp / MODEL_CONFIG).write_text(json.dumps({**model_meta, "step": state.step}, indent=2))
        _fsync_tree(tmp)
        marker = {"step": state.step, "tokens_seen": state.tokens_seen, "val_loss": state.last_val_loss}
        (tmp / COMPLETE).write_text(json.dumps(marker))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        prune(out_dir, keep, keep_best)
        logger.info(f"saved checkpoint {final}")
    accelerator.wait_for_everyone()
    return final


def prune(out_dir: str | Path, keep: int, keep_best: bool) -> None:
    """Delete all but the newest `keep` complete checkpoints (and the best by val loss with keep_best)."""
    done = complete_checkpoints(out_dir)
    keepers = set(done[-keep:]) if keep > 0 else set(done)
    if keep_best:
        scored = [(json.loads((p / COMPLETE).read_text()).get("val_loss", math.nan), p) for p in done]
        scored = [(v, p) for v, p in scored if v == v]  # NaN: not evaluated at that point
        if scored:
            keepers.add(min(scored)[1])
    for p in done:
        if p not in keepers:
            shutil.rmtree(p, ignore_errors=True)


def find_resume_checkpoint(resume: str, out_dir: str | Path) -> Path | None:
    """`none` -> None; `auto` -> newest complete checkpoint or None; a path -> that (complete) checkpoint."""
    if resume == "none":
        return None
    if resume == "auto":
        done = complete_checkpoints(out_dir)
        return done[-1] if done else None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"resume checkpoint '{resume}' does not exist")
    if not (path / COMPLETE).is_file():
        raise UserError(f"resume checkpoint '{resume}' is incomplete (no {COMPLETE} marker): it was being written")
    return path


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    for name in RESUME_FIELDS:
        if name in saved and saved[name] != current[name]:
            raise UserError(
                f"cannot resume from {path}: {name} was {saved[name]} there but is {current[name]} now "
                f"(it changes the model shape or the data order); use the checkpoint's value or resume: none"
            )


def check_pickles_are_safe(path: Path) -> None:
    """Accelerate unpickles registered objects with `weights_only=False`; first prove every pickle in the
    folder loads as plain tensors/numbers (weights_only=True) so nothing in it can run code."""
    from accelerate.utils.other import load

    for p in sorted([*path.glob("*.bin"), *path.glob("*.pkl"), *path.glob("*.pt")]):
        try:
            load(p, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UserError(
                f"checkpoint file {p} is corrupt or holds non-tensor objects: {str(e).splitlines()[0]}"
            ) from None


def saved_state(path: Path) -> TrainState:
    """The TrainState inside a checkpoint, read without restoring anything (after the safety check)."""
    from accelerate.utils.other import load

    state = TrainState()
    state.load_state_dict(load(path / "custom_checkpoint_0.pkl", map_location="cpu", weights_only=True))
    return state


def load_checkpoint(accelerator: Accelerator, path: Path, state: TrainState, config: dict[str, Any]) -> None:
    """Check the checkpoint is safe and fits `config`, then restore model, optimizer, scheduler, RNG and
    `state` (registered) on every rank."""
    check_pickles_are_safe(path)
    check_resume_config(saved_state(path).config, config, path)
    try:
        accelerator.load_state(str(path))
    except Exception as e:
        raise UserError(f"cannot load checkpoint {path}: {str(e).splitlines()[0]}") from None
    logger.info(f"resumed from {path} at step {state.step}")
