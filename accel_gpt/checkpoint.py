"""Checkpoints: the `step_XXXXXXXX` folder, the trainer state that rides in it, and the `Checkpointer`.

Layout: `out_dir/checkpoints/step_XXXXXXXX/` holds what `accelerator.save_state` writes (model.safetensors,
optimizer.bin, scheduler.bin, random_states_{rank}.pkl for every rank, custom_checkpoint_0.pkl with the
`TrainState`), plus `model_config.json` (so eval/sample/export can read it) and `COMPLETE`, written last.
Under FSDP, `save_state` writes the model and optimizer sharded instead (`pytorch_model_fsdp_0/`, `optimizer_0/`:
torch distributed checkpoints, one file per rank), which only an FSDP launch reads back; so the save also gathers the
whole model and the main process writes it as model.safetensors beside them: eval, sample, export and `--init_from`
read every checkpoint the same way, and a resume reads the sharded form.

A save goes into a hidden `.tmp-step_XXXXXXXX/` folder. Once every rank has written its part, the main
process fsyncs it, writes `COMPLETE` and renames it into place; a folder is deleted by first renaming it to
a hidden `.trash-` name. So a crash at any moment leaves each `step_*` folder either complete or absent
(plus hidden leftovers that the next save removes), and the previous checkpoint is always intact. A save that
cannot write (a full disk, a folder turned read-only) removes its temporary folder and stops the run on every rank
with one line naming that previous checkpoint. Readers trust only folders whose `COMPLETE` is readable: a truncated
or garbled marker vouches for nothing, so its folder counts as incomplete (skipped by `auto` and by pruning, with a
warning).

Lines of a run. `--resume auto` takes the newest complete checkpoint, so the folder must hold one line of training.
Resuming from step k *by path* starts a new line from k (a rollback, e.g. past a loss spike, or with other
settings); the checkpoints after k belong to the abandoned line, and a later `auto` would go back to them. So the
resumed run retires them before it writes anything: they are moved, not deleted, into
`checkpoints/retired-<UTC time>/` with a copy of metrics.jsonl (the rows of the abandoned line), and the log says
so. The final weights in the run directory go there too when they are from after k. `auto`, pruning and readers
see only `checkpoints/step_*`.

What a resume must share with its checkpoint: the model's shape, the global batch and seed (`RESUME_FIELDS`), and
the data (`TrainState.data`: tokenizer, vocabulary and a fingerprint of the training shards). Other data is
refused, naming `--init_from` (which starts a new run from a checkpoint's weights). The optimizer's settings
(learning_rate, weight_decay, betas, Muon's) may change: they are applied after `load_state` (the learning rates by
`optim.StepSchedule`, the others by `optim.apply_settings`) and each change is logged, so the run uses the values
config.yaml records. The optimizer itself may not: its state is another optimizer's (AdamW's moments are not Muon's
momentum), so a resume under the other one is refused.

Every rank looks its resume checkpoint up on its own; before anything is loaded, all must have found the same folder
with the same files (`shared_storage.agreement`: a folder on each machine's own disk fails here instead of hanging),
and each rank of the group that saved it must find its own random state there. A checkpoint resumed by a group of
another size is named in one line (`other_group_note`).

The weights are saved under the unwrapped model's keys whatever the world size (Accelerate keeps the
module it was given, not the DDP wrapper, in the list it saves), so a checkpoint written by W processes
resumes under any W' with the same `total_batch_size`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, gather_object
from accelerate.utils.constants import RNG_STATE_NAME

from accel_gpt.bpe import TOKENIZER_FILE
from accel_gpt.budget import TimeBudget
from accel_gpt.config import MODEL_FIELDS, TrainConfig
from accel_gpt.data.shards import sha256_file
from accel_gpt.errors import UserError
from accel_gpt.files import (
    atomic_write_json,
    fsync_dir,
    fsync_tree,
    make_shareable,
    publish,
    remove,
    tensor_bytes,
    write_failure,
)
from accel_gpt.metrics import Tally
from accel_gpt.optim import apply_settings, schedule_moved
from accel_gpt.rundir import same_on_every_rank
from accel_gpt.shared_storage import agreement, gather_views
from accel_gpt.spike import SpikeGuard
from accel_gpt.tokenizer import Tokenizer
from accel_gpt.weights import (
    CHECKPOINTS,
    COMPLETE,
    MODEL_CONFIG,
    RETIRED_PREFIX,
    TMP_PREFIX,
    TRASH_PREFIX,
    WEIGHTS,
    ModelCard,
    checkpoint_name,
    checkpoint_run,
    complete_checkpoints,
    disowned,
    folder_run,
    is_checkpoint_name,
    read_marker,
    read_model_config,
    save_weights,
    unlike_recorded,
    write_model_config,
)
from accel_gpt.workarounds import check_pickles_are_safe, drop_tied_head, first_line, reset_micro_step

logger = get_logger(__name__)

TRAIN_STATE_FILE = "custom_checkpoint_0.pkl"  # Accelerate's name for the first registered object
FSDP_MODEL_PREFIX = "pytorch_model_fsdp"  # Accelerate's name for the model saved under FSDP (sharded or not)
# Fields that a resumed run must share with its checkpoint: the model's shape, the global batch (it fixes how
# far the data stream advances per step) and the seed (it fixes the data order).
RESUME_FIELDS = (*MODEL_FIELDS, "total_batch_size", "seed")
# The values of model fields added later, in checkpoints saved before they existed: every such run was GPT-2's block
# (`gelu` came after nanochat's block: `check_resume_config` gives it the tanh GELU under gpt2, none under nanochat).
LEGACY_DEFAULTS = {"arch": "gpt2", "n_kv_head": None, "rope_theta": None, "logit_softcap": None}
# Settings a resume may change; each change is logged. The optimizer's are re-applied after `load_state`, which
# restores the saved ones; the schedule's and grad_clip are read from the config at every step anyway.
CHANGEABLE_FIELDS = ("learning_rate", "weight_decay", "beta1", "beta2", "grad_clip", "warmup_steps", "min_lr_ratio")
CHANGEABLE_FIELDS += ("lr_schedule", "schedule_steps", "decay_fraction", "max_steps", "time_budget", "warmup_fraction")
CHANGEABLE_FIELDS += ("spike_loss_zscore", "spike_grad_zscore", "spike_window", "dropout")
CHANGEABLE_FIELDS += ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_adjust_lr_fn", "muon_ns_steps")
CHANGEABLE_FIELDS += ("muon_momentum_warmup", "muon_momentum_start", "muon_ns_dtype", "embedding_lr", "head_lr")
CHANGEABLE_FIELDS += ("muon_ns_coefficients",)


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
    data: dict[str, Any] = field(default_factory=dict)  # `data_identity` of the training data
    spike: SpikeGuard | None = None  # the spike guard's window, when the guard is on
    num_processes: int = 0  # the group that saved it (0: a checkpoint from before it was recorded)
    # Each start of the run that led to these weights: {"from_step", "processes", "config"}, so that a model card
    # tells every command that trained them ([] in checkpoints from before it was recorded).
    segments: list[dict[str, Any]] = field(default_factory=list)
    budget: TimeBudget | None = None  # --time_budget: its spent step time rides in every checkpoint
    budget_record: dict[str, float] = field(default_factory=dict)  # as loaded: `TimeBudget.state` of the saver
    run: str = ""  # the run's id (`weights.RUN_FILE`): "" in checkpoints from before it was recorded

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
            "data_json": json.dumps(self.data),
            "num_processes": self.num_processes,
            "segments_json": json.dumps(self.segments),
            "run": self.run,
            **({"spike_json": json.dumps(self.spike.state_dict())} if self.spike is not None else {}),
            **(self.budget.state() if self.budget is not None and self.budget.on else {}),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.data_position = int(sd["data_position"])
        self.last_val_loss = float(sd["last_val_loss"])
        self.config = json.loads(sd["config_json"])
        self.data = json.loads(sd.get("data_json", "{}"))  # {} in checkpoints from before it was recorded
        self.num_processes = int(sd.get("num_processes", 0))
        self.segments = json.loads(sd.get("segments_json", "[]"))
        self.run = str(sd.get("run", ""))
        self.budget_record = {k: float(sd[k]) for k in ("budget_spent", "budget_per_step") if k in sd}
        if self.budget is not None:  # a budget continues with what is left (none spent: saved without one)
            self.budget.resume(sd, self.step)
        if self.spike is not None and "spike_json" in sd:  # absent when saved with the guard off: it starts empty
            self.spike.load_state_dict(json.loads(sd["spike_json"]))


def data_identity(manifests: list[dict[str, Any]], weights: list[float]) -> dict[str, Any]:
    """What a run trains on: the tokenizer, its vocabulary, and a sha256 over each source's training shard entries
    (file, tokens, sha256) and the mixture's weights: together they fix the stream of windows.

    The entries are hashed in manifest order, not sorted: that order fixes which tokens a window index names, so
    the same shards listed in another order are another stream.
    """
    entries = [[[e["file"], e["tokens"], e["sha256"]] for e in m["splits"]["train"]] for m in manifests]
    fingerprint = json.dumps({"train": entries, "weights": weights} if len(manifests) > 1 else entries[0])
    trained = {"tokenizer_sha256": manifests[0]["tokenizer_sha256"]} if "tokenizer_sha256" in manifests[0] else {}
    return {
        "tokenizer": manifests[0]["tokenizer"],
        **trained,  # a bpe: which one
        "vocab_size": manifests[0]["vocab_size"],
        "train_shards_sha256": hashlib.sha256(fingerprint.encode()).hexdigest(),
    }


class Checkpointer:
    """When to save, what to keep, and each save published atomically; also the resume at start-up.

    Every rank calls `save` and `resume` (both are collective); the main process writes the shared files.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        accelerator: Accelerator,
        card: ModelCard,
        state: TrainState,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.cfg, self.accelerator, self.card, self.state, self.model = cfg, accelerator, card, state, model
        self.optimizer = optimizer
        self.fsdp = accelerator.distributed_type == DistributedType.FSDP
        self.out_dir, self.every = Path(cfg.out_dir), cfg.save_every
        self.keep, self.keep_best = cfg.keep_checkpoints, cfg.keep_best or cfg.final_weights == "best"
        self.rollback_from: int | None = None  # the step of a checkpoint resumed by path: a new line starts there
        self.tally = Tally("checkpoint")
        accelerator.register_for_checkpointing(state)

    def due(self, step: int, last: bool, stopping: bool = False) -> bool:
        """Every `save_every` steps, at the last step, and when a stop was requested (0 turns all three off)."""
        return self.every > 0 and (step % self.every == 0 or last or stopping)

    def save(self, val_loss: float | None) -> Path:
        """`save_state` into a temporary folder, then the main process publishes it and prunes.

        `val_loss` is the validation loss of these very weights (None when this step was not evaluated);
        it is what `keep_best` ranks checkpoints by.
        """
        with self.tally.timed():
            return self._save(val_loss)

    def _save(self, val_loss: float | None) -> Path:
        root = self.out_dir / CHECKPOINTS
        final = root / checkpoint_name(self.state.step)
        tmp = root / f"{TMP_PREFIX}{final.name}"
        if self.accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)
        self.accelerator.wait_for_everyone()
        handle = self.accelerator.register_save_state_pre_hook(drop_tied_head)
        try:
            error = write_failure(root, lambda: self.accelerator.save_state(str(tmp)), self.size())
        finally:
            handle.remove()
        error = any_rank_error(self.accelerator, error)  # also the barrier: every rank's RNG file is in tmp
        weights = self.accelerator.get_state_dict(self.model) if self.fsdp and error is None else None  # collective
        if error is None and self.accelerator.is_main_process:
            size = tensor_bytes((weights or {}).values())  # the gathered weights under FSDP; else small files
            error = write_failure(root, lambda: self._publish(tmp, final, val_loss, weights), size)
        error = same_on_every_rank(self.accelerator, error)
        if error is not None:
            if self.accelerator.is_main_process:
                with contextlib.suppress(OSError):  # in a folder gone read-only this fails too
                    remove(tmp)  # gives the space back; the published checkpoints were never touched
            raise self._save_failed(final, error)
        if self.accelerator.is_main_process:
            prune(self.out_dir, self.keep, self.keep_best, self.state.run)
            logger.info(f"saved checkpoint {final}")
        self.accelerator.wait_for_everyone()
        return final

    def size(self) -> int:
        """About the bytes a save writes from this process: the model's weights and the optimizer's state."""
        moments = (v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v))
        return tensor_bytes(self.model.parameters()) + tensor_bytes(moments)

    def _publish(self, tmp: Path, final: Path, val_loss: float | None, weights: dict[str, Any] | None) -> None:
        """`weights`: under FSDP, the gathered state dict (see the module), written as model.safetensors."""
        card = ModelCard(self.card.model, self.card.tokenizer, self.state.step, self.state.segments, run=self.state.run)
        if weights is None:
            write_model_config(tmp, card)
        else:
            save_weights(weights, card, tmp)  # with its model_config.json
        make_shareable(tmp)  # safetensors writes the weights 0600; the folder's other files have the umask's mode
        fsync_tree(tmp)  # the data must be on disk before the marker that vouches for it
        marker = {"step": self.state.step, "tokens_seen": self.state.tokens_seen, "val_loss": val_loss}
        marker["run"] = self.state.run
        marker["sha256"] = checksums(tmp)  # a resume verifies them: damage that still reads must not load silently
        atomic_write_json(tmp / COMPLETE, marker)
        if final.exists() and read_marker(final) is not None and checkpoint_run(final) in (None, self.state.run):
            _remove(final)  # the same step saved again (e.g. resumed from an older checkpoint by path)
        elif final.exists():  # a folder this run did not write: kept, out of the way
            aside = aside_folder(final.parent) / final.name
            os.replace(final, aside)
            logger.warning(f"{final} was not a checkpoint of this run: moved it to {aside} (nothing deleted)")
        publish(tmp, final)

    def _agreed_checkpoint(self, resume: str) -> Path | None:
        """The checkpoint every rank resumes from: each looks it up on its own, and all must find the same folder
        with the same files (`shared_storage`), or every rank stops with the same line instead of a hang."""
        error, path = None, None
        try:
            path = find_resume_checkpoint(resume, self.out_dir)
        except UserError as e:
            error = str(e)
        stop_together(self.accelerator, error)
        stop_together(self.accelerator, agreement(gather_views(self.accelerator, path)))
        return path

    def _check_own_random_state(self, path: Path, saved_by: int) -> None:
        """Each rank of the group that saved `path` wrote its random state into it; a rank whose file is missing
        would resume with another dropout stream than an uninterrupted run's, so the checkpoint is refused."""
        rank = self.accelerator.process_index
        own = path / f"{RNG_STATE_NAME}_{rank}.pkl"
        error = None
        if rank < saved_by and not own.is_file():
            error = (
                f"checkpoint {path} lacks {own.name}, the random state of rank {rank} of the {saved_by} processes "
                f"that saved it: it is damaged; resume from an earlier checkpoint by path"
            )
        stop_together(self.accelerator, error)

    def _save_failed(self, final: Path, reason: str) -> UserError:
        done = complete_checkpoints(self.out_dir)
        kept = f"the previous checkpoint, {done[-1]}, is intact" if done else "no earlier checkpoint of this run exists"
        return UserError(
            f"cannot save checkpoint {final}: {reason}; the run stopped after step {self.state.step} and {kept}: "
            "make room (or fix the folder), then continue with --resume auto"
        )

    def resume(self, resume: str) -> None:
        """Restore the checkpoint `resume` names into every registered object on every rank (or start at 0).

        Everything is checked before anything is restored (its files against the checksums its marker recorded,
        too), the loaded weights must be finite; then the optimizer gets this run's settings back."""
        path = self._agreed_checkpoint(resume)
        self._adopt_run(resume, path)  # before anything of it is read as this run's
        if path is None:
            if resume == "auto" and (self.out_dir / WEIGHTS).is_file():  # a finished run saved without checkpoints
                raise UserError(
                    f"--resume auto: out_dir {self.out_dir} holds a run's final weights but no complete checkpoint to "
                    f"continue from, and starting at step 0 would replace them; pass --overwrite true instead of "
                    f"--resume to replace that run, --init_from {self.out_dir} with a new out_dir to train on from its "
                    "weights, or use a new out_dir"
                )
            if resume == "auto":
                logger.info("resume: auto found no complete checkpoint; starting from step 0")
            self._begin_segment()
            return
        # the files present against their checksums first: a changed file is named as damaged, with the checkpoint
        # to go back to, before anything of it is unpickled; missing files once a rank's own has been looked for
        main = self.accelerator.is_main_process
        stop_together(self.accelerator, damage(path, absent=False) if main else None)
        check_pickles_are_safe(path)
        saved = saved_state(path)
        check_resume_config(saved.config, self.state.config, path)
        check_same_data(path, saved.data, self.state.data, self.card)
        check_same_sharding(path, self.fsdp)
        self._check_own_random_state(path, saved.num_processes)
        stop_together(self.accelerator, damage(path, present=False) if main else None)
        max_steps = self.state.config["max_steps"]
        if saved.step > max_steps:
            raise UserError(
                f"cannot resume from {path}: it is at step {saved.step}, past max_steps={max_steps}; set --max_steps "
                f"above {saved.step} to train on, or use its weights as they are"
            )
        config, data, processes, run = self.state.config, self.state.data, self.state.num_processes, self.state.run
        try:
            self.accelerator.load_state(str(path))
        except Exception as e:
            raise UserError(f"cannot load checkpoint {path}: {first_line(e)}") from None
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):  # saved before a check could catch it
            raise UserError(damaged(path, "its weights hold NaN or infinite values"))
        reset_micro_step(self.accelerator)
        # the run goes on under the config it was started with now, in this group
        self.state.config, self.state.data, self.state.num_processes, self.state.run = config, data, processes, run
        if saved.num_processes and saved.num_processes != processes:
            logger.warning(other_group_note(path, saved.num_processes, processes))
        apply_settings(self.optimizer, config)
        for name, *values in changed_settings(saved.config, config):
            was, now = ("none" if v in (None, "") else v for v in values)
            logger.info(f"resume: {name} {was} -> {now}")
        moved = schedule_moved(self.cfg, saved.config, self.state.step, saved.budget_record)
        if moved:
            logger.info(moved)
        if resume != "auto":
            self.rollback_from = self.state.step
        self._begin_segment()
        logger.info(f"resumed from {path} at step {self.state.step}")

    def _adopt_run(self, resume: str, path: Path | None) -> None:
        """The run's id, the same on every rank: a new run's is new; a resume keeps the folder's (`RUN_FILE`), else
        its checkpoint's. Before any file is read as the run's, everything in out_dir must be its own (`disowned`),
        and a checkpoint resumed by path must be of the run the folder holds: continuing another here mixes two."""
        error, run = None, ""
        if self.accelerator.is_main_process:
            try:
                here = folder_run(self.out_dir) if resume != "none" else None
                theirs = checkpoint_run(path) if path is not None else None
                if resume not in ("auto", "none") and here and theirs and here != theirs:
                    error = (
                        f"checkpoint {path} was saved by another run ({theirs}) than the one out_dir {self.out_dir} "
                        f"holds ({here}): continue that run with a new --out_dir, or start from its weights with "
                        f"--init_from {path}"
                    )
                else:
                    run = here or theirs or uuid.uuid4().hex[:16]
                    error = disowned(self.out_dir, run) if resume != "none" else None
            except UserError as e:
                error = str(e)
        stop_together(self.accelerator, error)
        self.state.run = same_on_every_rank(self.accelerator, run) or ""

    def _begin_segment(self) -> None:
        """This start of the run, in the history its saves carry (one that trained no step before it is replaced)."""
        state = self.state
        if state.segments and state.segments[-1]["from_step"] == state.step:
            state.segments.pop()
        state.segments.append({"from_step": state.step, "processes": state.num_processes, "config": state.config})

    def retire_later_line(self) -> None:
        """After a resume by path from step k: move the checkpoints after k aside (main process; see the module)."""
        if self.rollback_from is not None and self.accelerator.is_main_process:
            retired = retire_after(self.out_dir, self.rollback_from)
            if retired:
                logger.info(
                    f"resumed by path from step {self.rollback_from}: moved the later {', '.join(retired[1:])} of the "
                    f"abandoned line to {retired[0]} (nothing deleted); --resume auto now follows this run"
                )
        self.accelerator.wait_for_everyone()


def any_rank_error(accelerator: Accelerator, error: str | None) -> str | None:
    """The first rank's error (None when every rank succeeded), on every rank: all go on or all stop together."""
    if accelerator.num_processes == 1:
        return error
    return next((e for e in gather_object([error]) if e is not None), None)


def stop_together(accelerator: Accelerator, error: str | None) -> None:
    """Raise the first rank's error on every rank (collective): all stop with the same line, none waits."""
    error = any_rank_error(accelerator, error)
    if error is not None:
        raise UserError(error)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder so that no reader can see it half-deleted: rename it away, then delete. A link to
    one (the user's store elsewhere) loses only the link: what it points to is not the run's to delete."""
    if path.is_symlink():
        path.unlink()
        logger.info(f"removed the link {path} from the run; what it pointed to ({path.resolve()}) is left alone")
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Hidden folders of saves or deletions that a crash interrupted; nothing reads them."""
    for p in root.iterdir():
        if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and p.is_symlink():  # left by an older version
            p.unlink()
        elif p.is_dir() and p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path (what `COMPLETE` vouches for)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE)
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}


def damage(checkpoint: Path, present: bool = True, absent: bool = True) -> str | None:
    """The one line saying how a complete checkpoint's files differ from the checksums its marker recorded (None:
    they match, or it is from before checksums were recorded): the files `present` that changed (hashed), the ones
    `absent`. A resume asks for the two apart: a missing rank's random state has a more precise line of its own,
    which needs the group that saved it, which needs a pickle read, which must come after the hashes."""
    unlike = unlike_recorded(checkpoint, present=present, absent=absent)
    return None if unlike is None else damaged(checkpoint, unlike)


def damaged(checkpoint: Path, what: str) -> str:
    done = complete_checkpoints(checkpoint.parent.parent)
    earlier = [p for p in done if p.name < checkpoint.name]
    before = f"resume from the one before it by path: --resume {earlier[-1]}" if earlier else "no earlier one is kept"
    return f"checkpoint {checkpoint} is damaged: {what}; {before}"


def prune(out_dir: str | Path, keep: int, keep_best: bool, run: str | None = None) -> None:
    """Delete all but the newest `keep` complete checkpoints (0 keeps all), and with `keep_best` also keep the
    one whose own weights had the lowest validation loss (a marker without a finite one is unscored). Only the
    checkpoints of `run` (and those from before ids) are candidates: a run deletes only what it wrote."""
    done = [p for p in complete_checkpoints(out_dir) if run is None or checkpoint_run(p) in (None, run)]
    keepers = set(done[-keep:]) if keep > 0 else set(done)
    best = best_checkpoint(out_dir) if keep_best else None
    if best is not None:
        keepers.add(best[0])
    for p in done:
        if p not in keepers:
            _remove(p)


def best_checkpoint(out_dir: str | Path) -> tuple[Path, float] | None:
    """The complete checkpoint whose own weights had the lowest validation loss, and that loss (the earliest of
    equals); None when no checkpoint was evaluated at its step."""
    scored = [(loss, p) for p in complete_checkpoints(out_dir) if (loss := _val_loss(p)) is not None]
    if not scored:
        return None
    loss, path = min(scored, key=lambda pair: pair[0])
    return path, loss


def _val_loss(checkpoint: Path) -> float | None:
    value = (read_marker(checkpoint) or {}).get("val_loss")
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def retire_after(out_dir: str | Path, step: int) -> list[str]:
    """Move the `step_*` folders after `step` (complete or not), and final weights from after it, into a new
    `checkpoints/retired-<UTC time>/` with a copy of metrics.jsonl. Returns [that folder, what moved...] or []."""
    out_dir = Path(out_dir)
    root = out_dir / CHECKPOINTS
    later = [p for p in sorted(root.glob("step_*")) if is_checkpoint_name(p.name) and _step_of(p) > step]
    final = final_step(out_dir)
    if not later and (final is None or final <= step):
        return []
    folder = aside_folder(root)
    moved = [folder.name]
    for p in later:
        os.replace(p, folder / p.name)
        moved.append(p.name)
        if (marker := read_marker(folder / p.name)) is not None:  # copied back into the line, it is refused
            atomic_write_json(folder / p.name / COMPLETE, marker | {"retired": str(folder)})
    if final is not None and final > step:
        for name in (WEIGHTS, MODEL_CONFIG, TOKENIZER_FILE):
            if (out_dir / name).exists():
                os.replace(out_dir / name, folder / name)
        moved.append(f"final weights (step {final})")
    if (out_dir / "metrics.jsonl").is_file():
        shutil.copy2(out_dir / "metrics.jsonl", folder / "metrics.jsonl")
    fsync_tree(folder)
    fsync_dir(root)
    fsync_dir(out_dir)
    moved[0] = str(folder)
    return moved


def aside_folder(root: Path) -> Path:
    """A new `checkpoints/retired-<UTC time>/`, for folders moved out of the run's line (nothing is deleted)."""
    folder = root / f"{RETIRED_PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    while folder.exists():
        folder = folder.with_name(folder.name + "_")
    folder.mkdir(parents=True)
    return folder


def _step_of(checkpoint: Path) -> int:
    try:
        return int(checkpoint.name.removeprefix("step_"))
    except ValueError:
        return -1


def final_step(out_dir: Path) -> int | None:
    """The step of the final weights in a run directory, or None when there are none (or they say no step)."""
    if not (out_dir / MODEL_CONFIG).is_file():
        return None
    try:
        return read_model_config(out_dir).step
    except UserError:
        return None


def find_resume_checkpoint(resume: str, out_dir: str | Path) -> Path | None:
    """`auto` -> the newest complete checkpoint or None; a path -> that complete checkpoint; `none` -> None.

    (`none` in a folder that holds another run is refused earlier, by `rundir.RunDir`, before anything is built.)
    """
    if resume == "none":
        return None
    if resume == "auto":
        done = complete_checkpoints(out_dir, warn=True)
        return done[-1] if done else None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"resume checkpoint '{resume}' does not exist; expected auto, none or a checkpoint folder")
    if read_marker(path) is None:
        if (path / COMPLETE).exists():
            raise UserError(
                f"resume checkpoint '{resume}' has an unreadable {COMPLETE} marker: it counts as incomplete"
            )
        if (path / CHECKPOINTS).is_dir():
            raise UserError(
                f"resume '{resume}' is a run directory, not a checkpoint: pass {path / CHECKPOINTS}/step_XXXXXXXX, "
                f"or --resume auto with --out_dir {resume}"
            )
        raise UserError(f"resume checkpoint '{resume}' is incomplete (no {COMPLETE} marker): its save did not finish")
    return path


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    was, now = saved.get("optimizer", "adamw"), current.get("optimizer", "adamw")  # older runs trained with AdamW
    if was != now:
        raise UserError(
            f"cannot resume from {path}: it was trained with --optimizer {was}, whose state does not carry over to "
            f"{now}; resume with --optimizer {was}, or start a new run from its weights with --init_from {path}"
        )
    legacy = LEGACY_DEFAULTS | {"gelu": "tanh" if saved.get("arch", "gpt2") == "gpt2" else None}
    # key/value heads as a count: unset is one per query head, so an unset and an equal one are the same model
    saved, current = ({**c, "n_kv_head": c.get("n_kv_head") or c.get("n_head")} for c in (saved, current))
    for name in RESUME_FIELDS:
        was = saved.get(name, legacy.get(name, current[name]))  # fields a checkpoint predates had these
        if was != current[name]:
            raise UserError(
                f"cannot resume from {path}: {name} was {was} there but is {current[name]} now "
                f"(it changes the model shape or the data order); use the checkpoint's value or a new out_dir"
            )


def check_same_data(path: Path, saved: dict[str, Any], current: dict[str, Any], card: ModelCard) -> None:
    """A resume continues the data stream it was saved in: other data (or tokenizer) is refused, naming init_from.

    Checkpoints from before the data was recorded carry no identity; their tokenizer is still compared, so that
    the next save cannot write another tokenizer into their model_config.json."""
    hint = f"to continue training its weights on this data, start a new run with --init_from {path}"
    for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "train_shards_sha256"):
        if key in saved and saved[key] != current.get(key):
            raise UserError(
                f"cannot resume from {path}: it was trained on other data ({key} {saved[key]} there, "
                f"{current.get(key)} now); {hint}"
            )
    if (path / MODEL_CONFIG).is_file():
        tokenizer = read_model_config(path).tokenizer
        if tokenizer != card.tokenizer:
            raise UserError(f"cannot resume from {path}: {tokenizer_mismatch(tokenizer, card.tokenizer)}; {hint}")


def check_same_sharding(path: Path, fsdp: bool) -> None:
    """An FSDP checkpoint holds the model and optimizer in FSDP's form, which only an FSDP launch reads back, and the
    other way round: say so in one line instead of Accelerate's missing-file error."""
    saved_fsdp = any(p.name.startswith(FSDP_MODEL_PREFIX) for p in path.iterdir())
    if saved_fsdp != fsdp:
        saved, now = ("with", "without") if saved_fsdp else ("without", "with")
        raise UserError(
            f"cannot resume from {path}: it was saved {saved} FSDP and this launch runs {now} it; resume with the "
            f"accelerate config it was saved with, or start a new run from its weights with --init_from {path}"
        )


def tokenizer_mismatch(weights: Tokenizer, data: Tokenizer) -> str:
    """Why weights trained with `weights` cannot train on data of `data` (two different tokenizers), in words."""
    if weights.name == data.name:
        other = " (another tokenizer.json)" if weights.name == "bpe" else ""
        ids = f"{weights.vocab_size} ids{other}"
        return f"its {weights.name} vocabulary ({ids}) is not the data's ({data.vocab_size} ids)"
    return (
        f"its tokenizer is {weights.name} ({weights.vocab_size} ids) but the data's is {data.name} ({data.vocab_size})"
    )


def other_group_note(path: Path, saved_by: int, processes: int) -> str:
    """The one line said when a checkpoint resumes in a group of another size (e.g. an elastic restart that lost
    a node): what stays the same and what does not."""
    return (
        f"resume: {path} was saved by {saved_by} process(es) and resumes in {processes}: the global batches, their "
        "order and the schedule stay the same, but the weights match an uninterrupted run only to float round-off "
        "(gradients are summed in another order; dropout masks and Muon's bf16 rounding differ more)"
    )


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, checkpoint's value, this run's) of the CHANGEABLE_FIELDS that differ (absent ones are not compared; a
    Muon run saved before `muon_ns_coefficients` existed iterated torch's quintic)."""
    if current.get("optimizer") == "muon":
        saved = {"muon_ns_coefficients": "quintic", **saved}
    names = [name for name in CHANGEABLE_FIELDS if name in saved and name in current]
    return [(name, saved[name], current[name]) for name in names if saved[name] != current[name]]


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
