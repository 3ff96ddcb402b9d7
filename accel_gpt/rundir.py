"""The run directory: one run per folder, checked before anything is written, locked while a run trains in it.

The rules, and why:

- `out_dir` must name a folder that can be created or written: not "" (that would be the current folder), not an
  existing file, not a path under a file, not in a read-only place. These fail at the first write otherwise,
  after minutes of start-up, or worse, in the middle of a run.
- A new run (`resume: none`) refuses a folder that holds another run's files (`RUN_FILES`): its final weights,
  config.yaml and metrics.jsonl would be silently replaced or mixed with the new run's. A run of the same config that
  stopped before its first step (`never_stepped`) holds nothing to lose: its files are replaced, and the log says so.
  A new run refused in its first steps (`StartRefused`) takes back the files its own start wrote.
  `overwrite: true` removes those files (only those: nothing the trainer does not write) once every check has
  passed and the lock is held, before the new run writes anything, so nothing of the two runs mixes.
- `resume: auto` or a checkpoint path continues the run the folder holds.
- The main process holds `files.locked(out_dir, "train")` for the whole run, so a second training into the same
  folder is refused in one line naming the holder. The kernel drops the lock when the holder dies, however it dies,
  so the group torchrun starts after a failure (`--max_restarts`) takes over the lock of the one it replaces.
- A launch that torchrun may restart (`--max_restarts N`) must resume with `auto`: each restart runs the same
  command again, and only `auto` continues from the newest checkpoint.

`RunDir(cfg)` makes the checks on every rank before anything is built: they only read, so a refused run changes
nothing (not even the lock file: the lock is probed read-only). `RunDir.start` takes the lock and writes
config.yaml and accelerate_env.txt, then starts the trackers (which create logs/).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list

from accel_gpt.bpe import TOKENIZER_FILE
from accel_gpt.config import TrainConfig, save_yaml, yaml_text
from accel_gpt.errors import StartRefused, UserError
from accel_gpt.files import lock_holder, locked, remove
from accel_gpt.weights import (
    RETIRED_PREFIX,
    RUN_FILE,
    TMP_PREFIX,
    TRASH_PREFIX,
    is_checkpoint_name,
    write_folder_run,
)

logger = get_logger(__name__)

CONFIG_FILE = "config.yaml"
ENV_REPORT = "accelerate_env.txt"
# What a run writes into its folder (besides the lock): a folder holding any of these holds a run.
RUN_FILES = (
    CONFIG_FILE,
    "metrics.jsonl",
    "model.safetensors",
    "model_config.json",
    TOKENIZER_FILE,  # a bpe run's tokenizer, beside its final weights
    ENV_REPORT,
    RUN_FILE,
    "checkpoints",
    "logs",
)


class RunDir:
    """The checks at construction (every rank, read-only), then `start`: the lock and the run's first files."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.path = cfg, Path(cfg.out_dir)
        check_out_dir(cfg.out_dir)
        check_apart_from_data(self.path, cfg.data_dirs)
        check_restartable(cfg.resume)
        probe_lock(self.path)
        self._check_new_run()

    @contextlib.contextmanager
    def start(self, accelerator: Accelerator, run: str) -> Iterator[None]:
        """Hold the lock (main process) while the body runs; before it, replace an old run (`overwrite`) and write
        config.yaml, accelerate_env.txt, the run's id (`run`) and the trackers. A failure on the main process stops
        every rank."""
        with contextlib.ExitStack() as stack:
            error = None
            if accelerator.is_main_process:
                try:
                    self.path.mkdir(parents=True, exist_ok=True)
                    stack.enter_context(locked(self.path, "train"))
                    self._remove_old_run()
                    save_yaml(self.cfg, self.path / CONFIG_FILE)
                    (self.path / ENV_REPORT).write_text(accelerate_env_report(accelerator))
                    write_folder_run(self.path, run)
                except (UserError, OSError) as e:
                    error = str(e) if isinstance(e, UserError) else f"cannot write to out_dir {self.path}: {e}"
            error = same_on_every_rank(accelerator, error)
            if error:
                raise UserError(error)
            accelerator.init_trackers("accel_gpt", config=self.cfg.to_dict())
            accelerator.wait_for_everyone()
            try:
                yield
            except StartRefused:
                if accelerator.is_main_process and self.cfg.resume == "none":
                    self._take_back_start()
                raise

    def _take_back_start(self) -> None:
        """A new run refused in its first steps: the files it wrote go (it saved nothing), so that the command the
        refusal advises is not refused in turn as "another run"."""
        if any((self.path / "checkpoints").glob("step_*")) or (self.path / "model.safetensors").exists():
            return
        for name in run_files(self.path):
            remove_own(self.path / name)

    def _check_new_run(self) -> list[str]:
        """A new run's folder holds no other run, or `overwrite` says to replace it; returns the files to replace."""
        old = run_files(self.path) if self.cfg.resume == "none" else []
        if old and not self.cfg.overwrite and not never_stepped(self.path, self.cfg):
            raise UserError(
                f"out_dir {self.path} holds another run ({', '.join(old)}); pass --resume auto to continue it, "
                "--overwrite true to replace it, or use a new out_dir"
            )
        return old

    def _remove_old_run(self) -> None:
        """`overwrite`: the earlier run's files go before the new run writes any (checked again: under the lock)."""
        old = self._check_new_run()
        kept = [entry for name in old for entry in remove_own(self.path / name)]
        if old:
            why = "overwrite" if self.cfg.overwrite else "a run that stopped before its first step"
            left = f"; left what no run writes there: {', '.join(kept)}" if kept else ""
            logger.info(f"{why}: removed the earlier run's {', '.join(old)} from {self.path}{left}")


def check_out_dir(out_dir: str) -> None:
    """Refuse an out_dir that the run could not write, before anything is built (one line each)."""
    if not out_dir.strip():
        raise UserError("out_dir is empty: pass --out_dir DIR (the run is never written into the current folder)")
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"out_dir {path} is a file, not a folder; choose another out_dir")
    dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        raise UserError(
            f"out_dir {path} cannot be created: {dangling} is a link to {os.readlink(dangling)}, which does not exist; "
            "create that folder, or choose another out_dir"
        )
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"out_dir {path} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it is" if existing == path else f"{existing} is"
        raise UserError(f"out_dir {path} cannot be written: {where} read-only")


def check_apart_from_data(out_dir: Path, data_dirs: list[str]) -> None:
    """A data folder given as out_dir would get the run's files beside its shards (and a later `prepare` or
    `--overwrite` there would take the other's files for its own): refuse it."""
    for data in data_dirs:
        if out_dir.resolve() == Path(data).resolve():
            raise UserError(f"out_dir {out_dir} is the data folder {data}: give the run a folder of its own")


def check_restartable(resume: str, env: Mapping[str, str] = os.environ) -> None:
    """Refuse a launch that torchrun may restart unless it resumes with `auto` (one line, before anything is built).

    A restart runs the launch's command again: a new run (`resume: none`) would then be refused by the files of its
    own first attempt (or, with `overwrite`, start again from step 0), and a checkpoint path would take the run back
    to that step at every restart."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))  # set by torchrun (and accelerate launch) in workers
    if restarts > 0 and resume != "auto":
        raise UserError(
            f"--max_restarts {restarts} restarts the group with this same command, which then must continue the run: "
            f"pass --resume auto (not --resume {resume})"
        )


def probe_lock(folder: Path) -> None:
    """Refuse a folder another process trains in, without taking the lock (read-only: a refusal changes nothing).
    `start` takes the lock for real before the first write; this only names a busy folder before minutes of
    building."""
    holder = lock_holder(folder)
    if holder:
        raise UserError(f"{folder} is in use by {holder} (train refused); wait for it or use another folder")


def run_of(path: str | Path) -> Path | None:
    """The run directory whose weights `path` names: the run dir itself (final weights) or the run that holds the
    checkpoint `RUN/checkpoints/step_N`. None for weights without their run (a copied folder, a transformers model).
    """
    p = Path(path)
    candidates = [p, p.parent.parent] if p.parent.name == "checkpoints" else [p]
    return next((c for c in candidates if (c / CONFIG_FILE).is_file()), None)


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """A run's config.yaml as written: the train settings it resolved (read as plain YAML, so that a config from an
    older accel_gpt, with settings since renamed, still reads)."""
    path = run_dir / CONFIG_FILE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"cannot read the run's settings in {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a run's settings (a YAML mapping of train settings)")
    return data


# Settings a run records as it resolved them (`choices.py`): the same command leaves them at auto.
AUTO_FIELDS = ("mixed_precision", "compile")


def never_stepped(folder: Path, cfg: TrainConfig) -> bool:
    """A run of this very config that stopped before its first step (e.g. on bad data found after it claimed the
    folder): it left config.yaml and its launch report but no weights, no checkpoint and no metrics row, nothing a
    new run would lose, so running the command again after the fix is not refused as "another run". Another config
    is another run (`--overwrite true` replaces it); a config.yaml without the launch report may be a recipe the user
    keeps there."""
    if not (folder / ENV_REPORT).is_file():
        return False
    if any((folder / name).exists() for name in ("model.safetensors", "model_config.json", TOKENIZER_FILE)):
        return False
    if any((folder / "checkpoints").glob("step_*")) or any((folder / "checkpoints").glob("retired-*")):
        return False
    metrics = folder / "metrics.jsonl"
    if metrics.exists() and metrics.read_text(errors="replace").strip():
        return False
    try:
        saved, current = read_run_config(folder), yaml.safe_load(yaml_text(cfg))
    except UserError:  # no config.yaml, or not one of ours
        return False
    for name in AUTO_FIELDS:  # the run recorded what its auto resolved to
        if current.get(name) == "auto" and name in saved:
            current[name] = saved[name]
    return saved == current


def own_entry(folder: str, name: str) -> bool:
    """Whether `name` in a run's `checkpoints/` or `logs/` is what a run writes there: checkpoints, retired lines
    and a save's or a deletion's leftovers; the trackers' folders (TensorBoard's under the project's name, W&B's,
    MLflow's, Aim's)."""
    if folder == "checkpoints":
        return is_checkpoint_name(name) or name.startswith((RETIRED_PREFIX, TMP_PREFIX, TRASH_PREFIX))
    return name in ("accel_gpt", "wandb", "mlruns", ".aim")


def remove_own(path: Path) -> list[str]:
    """Delete a run's file or folder; of `checkpoints/` and `logs/`, only what a run writes there (a user's notes or
    hand-made copies beside them stay, and so does the folder then). Returns what stayed."""
    if path.name not in ("checkpoints", "logs") or path.is_symlink() or not path.is_dir():
        remove(path)
        return []
    kept = []
    for entry in sorted(path.iterdir()):
        if own_entry(path.name, entry.name):
            remove(entry)
        else:
            kept.append(f"{path.name}/{entry.name}")
    if not kept:
        path.rmdir()
    return kept


def run_files(folder: Path) -> list[str]:
    """The names in `RUN_FILES` that `folder` holds; an empty folder (`checkpoints/` made ahead, or linked to an
    empty store elsewhere) holds nothing of a run."""
    return [name for name in RUN_FILES if (folder / name).exists() and not _empty_folder(folder / name)]


def _empty_folder(path: Path) -> bool:
    try:
        return path.is_dir() and not any(path.iterdir())
    except OSError:
        return False


def same_on_every_rank(accelerator: Accelerator, value: str | None) -> str | None:
    """The main process's `value` on every rank, so that all stop together instead of some waiting forever."""
    if accelerator.num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def accelerate_env_report(accelerator: Accelerator) -> str:
    """`accelerate env` (versions, devices, default config; what a bug report needs), then the state in use."""
    from accelerate.commands.env import env_command, env_command_parser

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        env_command(env_command_parser().parse_args([]))
    return f"{buffer.getvalue()}\n- state of this run:\n{accelerator.state}"
