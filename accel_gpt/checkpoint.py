"""Checkpoints: the `step_XXXXXXXX` folder, the trainer state that rides in it, and the `Checkpointer`.

Layout: `out_dir/checkpoints/step_XXXXXXXX/` holds what `accelerator.save_state` writes (model.safetensors,
optimizer.bin, scheduler.bin, random_states_{rank}.pkl for every rank, custom_checkpoint_0.pkl with the
`TrainState`), plus `model_config.json` (so eval/sample/export can read it) and `COMPLETE`, written last.

A save goes into a hidden `.tmp-step_XXXXXXXX/` folder. Once every rank has written its part, the main
process fsyncs it, writes `COMPLETE` and renames it into place; a folder is deleted by first renaming it to
a hidden `.trash-` name. So a crash at any moment leaves each `step_*` folder either complete or absent
(plus hidden leftovers that the next save removes), and the previous checkpoint is always intact. Readers
trust only folders with `COMPLETE`.

The weights are saved under the unwrapped model's keys whatever the world size (Accelerate keeps the
module it was given, not the DDP wrapper, in the list it saves), so a checkpoint written by W processes
resumes under any W' with the same `total_batch_size`.
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

from accel_gpt.config import MODEL_FIELDS, TrainConfig
from accel_gpt.errors import UserError
from accel_gpt.files import atomic_write_json, fsync_tree, publish
from accel_gpt.weights import ModelCard, write_model_config
from accel_gpt.workarounds import check_pickles_are_safe, drop_tied_head, first_line, reset_micro_step

logger = get_logger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TMP_PREFIX = ".tmp-"  # a save in progress (or killed mid-way)
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted
TRAIN_STATE_FILE = "custom_checkpoint_0.pkl"  # Accelerate's name for the first registered object
# Fields that a resumed run must share with its checkpoint: the model's shape, the global batch (it fixes how
# far the data stream advances per step) and the seed (it fixes the data order).
RESUME_FIELDS = (*MODEL_FIELDS, "total_batch_size", "seed")


@dataclass
class TrainState:
    """The run's progress beyond the model/optimizer/scheduler states; rides in every `save_state`.

    Its state_dict holds only numbers and strings (the same on every rank), so it loads with
    `torch.load(weights_only=True)`.
    """

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # global, all ranks
    data_position: int = 0  # training windows consumed from the seeded stream
    last_val_loss: float = math.nan
    config: dict[str, Any] = field(default_factory=dict)

    def advance(self, cfg: TrainConfig) -> None:
        """One optimizer step done: the position in the window stream follows from the global batch."""
        self.step += 1
        self.tokens_seen += cfg.total_batch_size
        self.data_position += cfg.windows_per_step

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data_position": self.data_position,
            "last_val_loss": self.last_val_loss,
            "config_json": json.dumps(self.config),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.data_position = int(sd["data_position"])
        self.last_val_loss = float(sd["last_val_loss"])
        self.config = json.loads(sd["config_json"])


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


class Checkpointer:
    """When to save, what to keep, and each save published atomically; also the resume at start-up.

    Every rank calls `save` and `resume` (both are collective); the main process writes the shared files.
    """

    def __init__(self, cfg: TrainConfig, accelerator: Accelerator, card: ModelCard, state: TrainState) -> None:
        self.accelerator, self.card, self.state = accelerator, card, state
        self.out_dir, self.every = Path(cfg.out_dir), cfg.save_every
        self.keep, self.keep_best = cfg.keep_checkpoints, cfg.keep_best
        accelerator.register_for_checkpointing(state)

    def due(self, step: int, last: bool, stopping: bool = False) -> bool:
        """Every `save_every` steps, at the last step, and when a stop was requested (0 turns all three off)."""
        return self.every > 0 and (step % self.every == 0 or last or stopping)

    def save(self, val_loss: float | None) -> Path:
        """`save_state` into a temporary folder, then the main process publishes it and prunes.

        `val_loss` is the validation loss of these very weights (None when this step was not evaluated);
        it is what `keep_best` ranks checkpoints by.
        """
        root = self.out_dir / CHECKPOINTS
        final = root / checkpoint_name(self.state.step)
        tmp = root / f"{TMP_PREFIX}{final.name}"
        if self.accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)
        self.accelerator.wait_for_everyone()
        handle = self.accelerator.register_save_state_pre_hook(drop_tied_head)
        try:
            self.accelerator.save_state(str(tmp))
        finally:
            handle.remove()
        self.accelerator.wait_for_everyone()  # every rank's RNG file is in tmp
        if self.accelerator.is_main_process:
            write_model_config(tmp, ModelCard(self.card.model, self.card.tokenizer, self.state.step))
            fsync_tree(tmp)  # the data must be on disk before the marker that vouches for it
            marker = {"step": self.state.step, "tokens_seen": self.state.tokens_seen, "val_loss": val_loss}
            atomic_write_json(tmp / COMPLETE, marker)
            if final.exists():  # the same step saved again (e.g. resumed from an older checkpoint by path)
                _remove(final)
            publish(tmp, final)
            prune(self.out_dir, self.keep, self.keep_best)
            logger.info(f"saved checkpoint {final}")
        self.accelerator.wait_for_everyone()
        return final

    def resume(self, resume: str) -> None:
        """Restore the checkpoint `resume` names into every registered object on every rank (or start at 0)."""
        path = find_resume_checkpoint(resume, self.out_dir)
        if path is None:
            if resume == "auto":
                logger.info("resume: auto found no complete checkpoint; starting from step 0")
            return
        check_pickles_are_safe(path)
        check_resume_config(saved_state(path).config, self.state.config, path)
        config = self.state.config
        try:
            self.accelerator.load_state(str(path))
        except Exception as e:
            raise UserError(f"cannot load checkpoint {path}: {first_line(e)}") from None
        reset_micro_step(self.accelerator)
        self.state.config = config  # the run goes on under the config it was started with now
        logger.info(f"resumed from {path} at step {self.state.step}")


def _remove(path: Path) -> None:
    """Delete a checkpoint folder so that no reader can see it half-deleted: rename it away, then delete."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Hidden folders of saves or deletions that a crash interrupted; nothing reads them."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def complete_checkpoints(out_dir: str | Path, warn: bool = False) -> list[Path]:
    """Complete checkpoints, oldest first; with `warn`, say which `step_*` folders are skipped as incomplete."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = []
    for p in sorted(root.glob("step_*")):
        if (p / COMPLETE).is_file():
            done.append(p)
        elif warn:
            logger.warning(f"skipping incomplete checkpoint {p} (no {COMPLETE} marker: its save did not finish)")
    return done


def prune(out_dir: str | Path, keep: int, keep_best: bool) -> None:
    """Delete all but the newest `keep` complete checkpoints (0 keeps all), and with `keep_best` also keep the
    one whose own weights had the lowest validation loss."""
    done = complete_checkpoints(out_dir)
    keepers = set(done[-keep:]) if keep > 0 else set(done)
    if keep_best:
        scored = [(json.loads((p / COMPLETE).read_text()).get("val_loss"), p) for p in done]
        scored = [(v, p) for v, p in scored if v is not None and not math.isnan(v)]
        if scored:
            keepers.add(min(scored)[1])
    for p in done:
        if p not in keepers:
            _remove(p)


def find_resume_checkpoint(resume: str, out_dir: str | Path) -> Path | None:
    """`auto` -> the newest complete checkpoint or None; a path -> that complete checkpoint; `none` -> None.

    `none` refuses an out_dir that already holds checkpoints: the new run's saves would mix with the old run's,
    pruning would keep whichever has the higher step, and a later `auto` would resume the wrong run.
    """
    if resume in ("auto", "none"):
        done = complete_checkpoints(out_dir, warn=True)
        if resume == "auto":
            return done[-1] if done else None
        if done:
            raise UserError(
                f"out_dir {out_dir} already holds checkpoints of an earlier run (newest {done[-1].name}); "
                "pass --resume auto to continue it, or use a new out_dir"
            )
        return None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"resume checkpoint '{resume}' does not exist; expected auto, none or a checkpoint folder")
    if not (path / COMPLETE).is_file():
        if (path / CHECKPOINTS).is_dir():
            raise UserError(
                f"resume '{resume}' is a run directory, not a checkpoint: pass {path / CHECKPOINTS}/step_XXXXXXXX, "
                f"or --resume auto with --out_dir {resume}"
            )
        raise UserError(f"resume checkpoint '{resume}' is incomplete (no {COMPLETE} marker): its save did not finish")
    return path


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    for name in RESUME_FIELDS:
        if name in saved and saved[name] != current[name]:
            raise UserError(
                f"cannot resume from {path}: {name} was {saved[name]} there but is {current[name]} now "
                f"(it changes the model shape or the data order); use the checkpoint's value or a new out_dir"
            )


def saved_state(path: Path) -> TrainState:
    """The TrainState inside a checkpoint, read without restoring anything (after `check_pickles_are_safe`)."""
    from accelerate.utils.other import load

    file = path / TRAIN_STATE_FILE
    if not file.is_file():
        raise UserError(f"checkpoint {path} has no {TRAIN_STATE_FILE} (the trainer state): not an accel_gpt checkpoint")
    state = TrainState()
    try:
        state.load_state_dict(load(file, map_location="cpu", weights_only=True))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{file} is not an accel_gpt trainer state: {type(e).__name__} {e}") from None
    return state
