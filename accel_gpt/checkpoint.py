"""Checkpoints: `TrainState`, atomic `save_state` folders, pruning, and resuming from one.

Layout: `out_dir/checkpoints/step_XXXXXXXX/` holds what `accelerator.save_state` writes (model.safetensors,
optimizer.bin, scheduler.bin, random_states_{rank}.pkl for every rank, custom_checkpoint_0.pkl with the
`TrainState`), plus `model_config.json` (so eval/sample/export can read it) and `COMPLETE`, written last.

A save goes into a hidden `.tmp-step_XXXXXXXX/` folder. Once every rank has written its part, the main process
fsyncs it, writes `COMPLETE` and renames it into place; a folder is deleted by first renaming it to a hidden
`.trash-` name. So a crash at any moment leaves each `step_*` folder either complete or absent (plus hidden
leftovers that the next save removes), and the previous checkpoint is always intact. Readers trust only folders
with `COMPLETE`.

The model weights are saved under the unwrapped model's keys whatever the world size (accelerate 1.15 keeps the
module it was given, not the DDP wrapper, in the list it saves), so a checkpoint written by W processes resumes
under any W' with the same `total_batch_size`.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.logging import get_logger

from accel_gpt.artifacts import MODEL_CONFIG
from accel_gpt.config import MODEL_FIELDS
from accel_gpt.data.shards import fsync_dir
from accel_gpt.errors import UserError

logger = get_logger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TMP_PREFIX = ".tmp-"  # a save in progress (or killed mid-way)
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted
TRAIN_STATE_FILE = "custom_checkpoint_0.pkl"  # accelerate's name for the first registered object
PICKLE_SUFFIXES = (".bin", ".pkl", ".pt")
# Fields that a resumed run must share with its checkpoint: the model's shape, the global batch (it fixes how
# far the data stream advances per step) and the seed (it fixes the data order).
RESUME_FIELDS = (*MODEL_FIELDS, "total_batch_size", "seed")
_HEAD, _WTE = "lm_head.weight", "transformer.wte.weight"


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


# ----------------------------------------------------------------------------------------------- save


def save_checkpoint(
    accelerator: Accelerator,
    out_dir: str | Path,
    state: TrainState,
    model_meta: dict[str, Any],
    keep: int,
    keep_best: bool,
    val_loss: float | None = None,
) -> Path:
    """Every rank calls this: `save_state` into a temporary folder, then the main process publishes it.

    `val_loss` is the validation loss of these very weights (None when this step was not evaluated); it is what
    `keep_best` ranks checkpoints by.
    """
    root = Path(out_dir) / CHECKPOINTS
    final = root / checkpoint_name(state.step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
    accelerator.wait_for_everyone()
    handle = accelerator.register_save_state_pre_hook(_drop_tied_head)
    try:
        accelerator.save_state(str(tmp))
    finally:
        handle.remove()
    accelerator.wait_for_everyone()  # every rank's RNG file is in tmp
    if accelerator.is_main_process:
        _publish(tmp, final, {**model_meta, "step": state.step}, _marker(state, val_loss))
        prune(out_dir, keep, keep_best)
        logger.info(f"saved checkpoint {final}")
    accelerator.wait_for_everyone()
    return final


def _drop_tied_head(models: list, weights: list[dict[str, Any]], output_dir: str) -> None:
    """Save the tied LM head once, as wte. accelerate would drop the alias itself (safetensors refuses shared
    tensors) but warns at every save; loading re-ties it either way."""
    for sd in weights:
        head, wte = sd.get(_HEAD), sd.get(_WTE)
        if head is not None and wte is not None and head.data_ptr() == wte.data_ptr():
            del sd[_HEAD]


def _marker(state: TrainState, val_loss: float | None) -> dict[str, Any]:
    return {"step": state.step, "tokens_seen": state.tokens_seen, "val_loss": val_loss}


def _publish(tmp: Path, final: Path, model_config: dict[str, Any], marker: dict[str, Any]) -> None:
    """Main process: make `tmp` durable, mark it complete, and rename it to `final` in one step."""
    (tmp / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2))
    _fsync_tree(tmp)  # the data must be on disk before the marker that vouches for it
    (tmp / COMPLETE).write_text(json.dumps(marker))
    _fsync_file(tmp / COMPLETE)
    fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. resumed from an older checkpoint by path)
        _remove(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


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


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            _fsync_file(p)
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(path)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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


# --------------------------------------------------------------------------------------------- resume


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


def check_pickles_are_safe(path: Path) -> None:
    """Prove that every pickle in the checkpoint holds only tensors and numbers before accelerate reads it.

    accelerate's `load_state` unpickles registered objects (the `TrainState`) with `weights_only=False`, which
    runs whatever code a crafted file names. Loading every pickle here with `weights_only=True` first means that
    such a file is refused before anything executes; truncated or garbage files are reported here too.
    """
    from accelerate.utils.other import load

    for p in sorted(q for q in path.rglob("*") if q.suffix in PICKLE_SUFFIXES and q.is_file()):
        try:
            load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserError(
                f"checkpoint file {p} holds something other than tensors and numbers ({_refusal_reason(e)}); "
                "refusing to unpickle it, as that could run arbitrary code"
            ) from None
        except Exception as e:
            raise UserError(f"checkpoint file {p} is corrupt or truncated: {_first_line(e)}") from None


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


def load_checkpoint(accelerator: Accelerator, path: Path, state: TrainState, config: dict[str, Any]) -> None:
    """Check the checkpoint is safe and fits `config`, then restore model, optimizer, scheduler, RNG and
    `state` (registered) on every rank."""
    check_pickles_are_safe(path)
    check_resume_config(saved_state(path).config, config, path)
    try:
        accelerator.load_state(str(path))
    except Exception as e:
        raise UserError(f"cannot load checkpoint {path}: {_first_line(e)}") from None
    # load_state restores accelerate's micro-step counter, and gradients sync (and the optimizer steps) when it is a
    # multiple of the accumulation. A checkpoint sits on an optimizer-step boundary, but the counter counts the
    # saving run's micro-steps: saved by W=2 (accumulation 1) at step 3 and resumed by W=1 (accumulation 2), it
    # would read 3, and every resumed update would come after one micro-step and then be skipped.
    accelerator.step = 0
    logger.info(f"resumed from {path} at step {state.step}")


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _refusal_reason(e: BaseException) -> str:
    """torch's weights_only refusal is a paragraph; keep the line that names what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return named[0] if named else _first_line(e)
