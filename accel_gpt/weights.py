"""Model files that outlive a run: `model.safetensors` + `model_config.json`, and loading any model source.

`model_config.json` holds the GPT's block and shape and the tokenizer, so `eval`, `sample` and `export` need
nothing else:

    {"model": {"n_layer": .., "n_head": .., "n_embd": .., "seq_len": .., "vocab_size": .., "arch": .., ...},
     "tokenizer": {"name": "gpt2"} | {"name": "char", "chars": "..."},
     "step": 123}

The same pair sits in the run directory (final weights) and in every checkpoint folder, so any of
them can be pointed at with `--checkpoint`. The weights are stored under the GPT's own parameter
names; GPT-2's tied `lm_head.weight` is left out (it is `transformer.wte.weight`), nanochat's untied one is kept.
A checkpoint folder counts once its `COMPLETE` marker is readable (`complete_checkpoints`); a run dir without final
weights (still training, or stopped early) is read as its newest complete checkpoint.

Which run wrote them: a run has an id, kept in `run.json` in its folder and in every marker and card it writes
(`"run"`), so that a checkpoint or final weights copied in from another run, or a checkpoint folder renamed to a step
it does not hold, are refused in one line (`disowned`) instead of being resumed, read, rotated or deleted as the
run's own. Files from before ids were recorded carry none, and count as any run's.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from accel_gpt.data.shards import sha256_file
from accel_gpt.errors import UserError, is_main_rank
from accel_gpt.files import atomic_write_json, make_shareable, replacing
from accel_gpt.model import FAMILIES, GPT, GPTConfig
from accel_gpt.tokenizer import Tokenizer

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
TIED_HEAD = "lm_head.weight"  # GPT-2's: stored once, as transformer.wte.weight
CHECKPOINTS = "checkpoints"  # a run dir's folder of step_* checkpoints
COMPLETE = "COMPLETE"  # a checkpoint's marker, written last: the folder is complete
RUN_FILE = "run.json"  # {"run": id}: the run a run dir holds
TMP_PREFIX = ".tmp-"  # in checkpoints/: a save in progress (or killed mid-way)
TRASH_PREFIX = ".trash-"  # in checkpoints/: a checkpoint being deleted
RETIRED_PREFIX = "retired-"  # in checkpoints/: checkpoints of an abandoned line (after a rollback by path)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelCard:
    """What `model_config.json` says: enough to rebuild the model and read and write its text."""

    model: GPTConfig
    tokenizer: Tokenizer
    step: int | None = None
    # How the run got these weights: each start ({"from_step", "processes", "config"}), from the checkpoints' state.
    history: list[dict[str, Any]] | None = None
    # Weights picked among the run's checkpoints (`final_weights best`): {"val_loss", "last_step"} of the run.
    picked: dict[str, Any] | None = None
    run: str | None = None  # the id of the run that trained them (`RUN_FILE`)
    weights_sha256: str | None = None  # of the model.safetensors beside it, where no COMPLETE marker vouches for it

    def to_dict(self) -> dict[str, Any]:
        card = {"model": self.model.to_dict(), "tokenizer": self.tokenizer.to_dict(), "step": self.step}
        extra = (("history", self.history), ("picked", self.picked), ("run", self.run))
        extra += (("weights_sha256", self.weights_sha256),)
        return card | {k: v for k, v in extra if v is not None}


def write_model_config(folder: Path, card: ModelCard) -> None:
    """model_config.json, and a trained bpe's tokenizer.json beside it: a model's folder is all it needs."""
    card.tokenizer.copy_to(Path(folder))
    atomic_write_json(Path(folder) / MODEL_CONFIG, card.to_dict())


def read_model_config(folder: Path) -> ModelCard:
    path = Path(folder) / MODEL_CONFIG
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        model, tokenizer = GPTConfig(**meta["model"]), Tokenizer.from_dict(meta["tokenizer"], folder)
        card = ModelCard(model, tokenizer, meta.get("step"), meta.get("history"), meta.get("picked"), meta.get("run"),
                         meta.get("weights_sha256"))  # fmt: skip
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path} is not a readable accel_gpt model config ({type(e).__name__}: {e})") from None
    if tokenizer.name == "bpe":  # its tokenizer.json missing or changed: one line now (GPT-2's files load on use)
        tokenizer.load()
    return card


def save_weights(state_dict: dict[str, torch.Tensor], card: ModelCard, out_dir: Path) -> None:
    """`model.safetensors` + `model_config.json` in `out_dir`, each written whole or not at all."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tied = FAMILIES[card.model.arch].tied_head
    state = {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if not (tied and k == TIED_HEAD)}
    with replacing(out_dir / WEIGHTS) as tmp:
        save_file(state, str(tmp))
        make_shareable(tmp)
        digest = sha256_file(tmp)
    write_model_config(out_dir, replace(card, weights_sha256=digest))  # ties the two files together


def load_weights(folder: Path) -> tuple[GPT, ModelCard]:
    """Our pair from a run dir or checkpoint folder -> (model on CPU in eval mode, its card)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    card = read_model_config(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{folder} has {MODEL_CONFIG} but no {WEIGHTS}")
    check_as_saved(folder)
    open(weights, "rb").close()  # a file this process may not read is said as such, not as safetensors' own error
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for corrupt headers or data
        raise UserError(f"{weights} is not a readable safetensors file: {e}") from None
    model = GPT(card.model)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = next((k for k, v in state.items() if k in shapes and tuple(v.shape) != shapes[k]), None)
    if wrong is not None:
        raise UserError(
            f"{weights} does not match its {MODEL_CONFIG}: {wrong} is {tuple(state[wrong].shape)} there, but "
            f"{shapes[wrong]} in the model it describes"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) - ({TIED_HEAD} if FAMILIES[card.model.arch].tied_head else set()) or unexpected:
        raise UserError(f"{weights} does not match its {MODEL_CONFIG}: missing {missing}, unexpected {unexpected}")
    broken = next((k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if broken is not None:
        raise UserError(f"{weights} holds NaN or infinite values ({broken}): these weights cannot be used")
    if card.weights_sha256 and read_marker(folder) is None and sha256_file(weights) != card.weights_sha256:
        raise UserError(  # after the checks that name damage: a file that reads and fits is another's weights
            f"{weights} is not the file its {MODEL_CONFIG} was written with (sha256): replaced or changed since; put "
            "back the pair as the run wrote them, or use a checkpoint"
        )
    return model.eval(), card


def check_as_saved(folder: Path) -> None:
    """A checkpoint's weights and shape must be the files its `COMPLETE` marker vouched for (sha256) when it was
    saved: eval, sample and export read them as that step's. Folders without recorded checksums pass."""
    marker = read_marker(folder)
    if marker is None and folder.parent.name == CHECKPOINTS and is_checkpoint_name(folder.name):
        raise UserError(f"checkpoint {folder} is incomplete (no readable {COMPLETE} marker: its save did not finish)")
    if marker is not None and (misnamed := misnamed_checkpoint(folder)):
        raise UserError(misnamed)
    changed = unlike_recorded(folder, names=(WEIGHTS, MODEL_CONFIG))
    if changed is not None:
        raise UserError(f"checkpoint {folder} is damaged: {changed}; use another checkpoint")


def unlike_recorded(
    checkpoint: Path, names: tuple[str, ...] | None = None, present: bool = True, absent: bool = True
) -> str | None:
    """How the first of a checkpoint's files (`names`, default all) is unlike the checksums its `COMPLETE` marker
    recorded, in words; None when they match or none were recorded. `present`: hash the files there; `absent`: report
    a missing one."""
    recorded = (read_marker(checkpoint) or {}).get("sha256")
    if not isinstance(recorded, dict):
        return None
    for name, digest in recorded.items():
        file = checkpoint / name
        if names is not None and name not in names:
            continue
        if not file.is_file():
            if absent:
                return f"{name} is missing"
        elif present and sha256_file(file) != digest:
            return f"{name} differs from the file it held when it was saved (sha256)"
    return None


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, ModelCard]:
    """A run dir, a checkpoint dir, or a transformers GPT-2 / NanoChat folder or hub id -> (model in eval mode, its
    card)."""
    p = Path(path)
    if (p / CHECKPOINTS).is_dir() or (p / RUN_FILE).is_file():
        check_own(p)  # a run dir: what it holds must be its own before its newest state is picked
    if (p / MODEL_CONFIG).is_file() or (p / CHECKPOINTS).is_dir():
        model, card = load_newest(p)
    elif (p / "config.json").is_file() or (not p.exists() and _looks_like_hub_id(str(path))):
        from accel_gpt.hf import folder_tokenizer, load_transformers

        model = load_transformers(str(path))
        card = ModelCard(model.config, folder_tokenizer(str(path)))
    elif not p.exists():
        raise UserError(
            f"'{path}' does not exist (a run dir, checkpoint dir, or transformers GPT-2 or NanoChat folder/hub id)"
        )
    else:
        raise UserError(
            f"'{path}' is not a run dir or checkpoint ({MODEL_CONFIG} + {WEIGHTS}) nor a transformers GPT-2 or "
            "NanoChat folder"
        )
    model.vocab_in_use = min(card.tokenizer.vocab_size, model.config.vocab_size)  # scores as the run and export do
    return model.to(device).eval(), card


def load_newest(run: Path, tries: int = 5) -> tuple[GPT, ModelCard]:
    """A run dir's newest weights: its final ones, or the newest checkpoint past them. A run training in the folder
    prunes its older checkpoints as it saves (`keep_checkpoints`), so the one picked may go while it is read: then
    the newest is picked again, where before a checkpoint pruned mid-read was reported as damaged."""
    for attempt in itertools.count(1):
        folder = (checkpoint_past_final(run) or run) if (run / MODEL_CONFIG).is_file() else newest_checkpoint(run)
        try:
            return load_weights(folder)
        except (UserError, OSError):
            if folder == run or read_marker(folder) is not None or attempt == tries:
                raise
            _note(f"{folder} was pruned by the run training in {run} while it was read: reading the newest again")


def checkpoint_past_final(run: Path) -> Path | None:
    """The newest complete checkpoint of a run dir where it is newer than the run's final weights (the run was
    continued with a larger max_steps and has not finished again), said once on stderr; None where the final weights
    are the run's newest state (or were picked from an earlier checkpoint: `final_weights best`)."""
    try:  # only the step: the whole card (and its tokenizer) is read once, by `load_weights`, which names damage
        meta = json.loads((run / MODEL_CONFIG).read_text(encoding="utf-8"))
        step, picked = meta.get("step"), meta.get("picked")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    done = complete_checkpoints(run)
    if picked or not isinstance(step, int) or not done or _checkpoint_step(done[-1]) <= step:
        return None
    _note(
        f"{run}'s final weights are step {step}'s, but the run went on to its checkpoint {done[-1]} (continued, "
        "and not finished again): using that, its newest state"
    )
    return done[-1]


def _checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def newest_checkpoint(run: Path) -> Path:
    """The weights of a run dir without final weights (a run still training, or stopped before its last step): its
    newest complete checkpoint, said once on stderr; none yet is a one-line error."""
    done = complete_checkpoints(run)
    if not done:
        raise UserError(
            f"run dir {run} has no final weights and no complete checkpoint yet: wait for its first save "
            "(save_every), or pass a checkpoint folder"
        )
    _note(
        f"{run} has no final weights yet (a run still training, or stopped before its last step): using its newest "
        f"checkpoint, {done[-1]}"
    )
    return done[-1]


def _note(text: str) -> None:
    """Which weights a run dir gave, said once per launch on stderr (stdout is the command's result)."""
    if is_main_rank():
        print(f"note: {text}", file=sys.stderr)


def read_marker(checkpoint: Path) -> dict[str, Any] | None:
    """The `COMPLETE` marker of a checkpoint folder, or None when it is missing or unreadable (truncated, garbled):
    such a folder is incomplete, as nothing vouches for it."""
    try:
        marker = json.loads((Path(checkpoint) / COMPLETE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


def complete_checkpoints(out_dir: str | Path, warn: bool = False) -> list[Path]:
    """Complete checkpoints, oldest first. A folder whose marker exists but is unreadable is always named (it is
    not what a crash leaves); with `warn`, also the folders without a marker."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = []
    for p in [root / name for name in sorted(os.listdir(root)) if is_checkpoint_name(name)]:  # glob hides EACCES
        if read_marker(p) is not None:
            done.append(p)
        elif (p / COMPLETE).exists():
            _warn(f"skipping checkpoint {p}: its {COMPLETE} marker is unreadable, so it counts as incomplete")
        elif warn:
            _warn(f"skipping incomplete checkpoint {p} (no {COMPLETE} marker: its save did not finish)")
    return done


def _warn(message: str) -> None:
    """Said once per launch, with or without an Accelerator."""
    if is_main_rank():
        logger.warning(message)


def _looks_like_hub_id(name: str) -> bool:
    """`gpt2` or `org/name`: no path separators beyond one slash, no leading dot or slash."""
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1 and bool(name.strip())


def folder_run(out_dir: str | Path) -> str | None:
    """The id of the run a run dir holds (`RUN_FILE`), or None for a folder without one (a run from before ids)."""
    path = Path(out_dir) / RUN_FILE
    if not path.exists():
        return None
    try:
        run = json.loads(path.read_text(encoding="utf-8")).get("run")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"{path} is not a readable run id ({type(e).__name__}: {e}); restore it or remove it") from None
    if not isinstance(run, str) or not run:
        raise UserError(f"{path} holds no run id; restore it or remove it")
    return run


def write_folder_run(out_dir: str | Path, run: str) -> None:
    atomic_write_json(Path(out_dir) / RUN_FILE, {"run": run})


def checkpoint_run(checkpoint: Path) -> str | None:
    """The id of the run that saved a complete checkpoint (None: saved before ids were recorded)."""
    run = (read_marker(checkpoint) or {}).get("run")
    return run if isinstance(run, str) else None


def misnamed_checkpoint(checkpoint: Path) -> str | None:
    """One line when a complete checkpoint's folder name is not the step its marker vouches for (renamed, or another
    step copied over it): resuming or reading it by its name would give another step's state."""
    step = (read_marker(checkpoint) or {}).get("step")
    if not is_checkpoint_name(checkpoint.name) or step is None or checkpoint.name == checkpoint_name(step):
        return None
    return (
        f"checkpoint {checkpoint} holds step {step}'s state (its {COMPLETE} marker), not the step its name says: "
        f"rename it {checkpoint_name(step)} if it is this run's, or move it out of {checkpoint.parent}"
    )


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    """`step_` and the step's digits: a name of the run's own saves (`step_00000010.bak` is the user's)."""
    return re.fullmatch(r"step_\d{8,}", name) is not None


def disowned(out_dir: str | Path, run: str | None = None) -> str | None:
    """One line on the first thing in a run dir that is not the run's own, None when all is: a checkpoint whose name
    is not the step it holds, or checkpoints or final weights saved by another run than `run` (default: the id in
    the folder's `RUN_FILE`, else that of its newest checkpoint). Such files were copied in, restored from another
    run's backup or renamed; resuming, reading or pruning them as the run's own would mix two runs."""
    out_dir = Path(out_dir)
    done = complete_checkpoints(out_dir)
    misnamed = next((m for p in done if (m := misnamed_checkpoint(p))), None)
    if misnamed:
        return misnamed
    retired = next((p for p in done if (read_marker(p) or {}).get("retired")), None)
    if retired is not None:
        return (
            f"checkpoint {retired} is of a line this run abandoned when it was resumed from an earlier step by path "
            f"(it was moved to {read_marker(retired)['retired']}): to go back to that line, resume from it by path "
            f"where it was moved; else move it out of {out_dir / CHECKPOINTS}"
        )
    named = folder_run(out_dir)
    run = run or named or next((r for p in reversed(done) if (r := checkpoint_run(p))), None)
    if run is None:
        return None
    ids = {r for r in (*map(checkpoint_run, done), _card_run(out_dir)) if r is not None}
    if named == run and ids and run not in ids and len(ids) == 1:
        return (
            f"{out_dir / RUN_FILE} names run {run}, but every checkpoint and the final weights in {out_dir} are run "
            f"{ids.pop()}'s: {RUN_FILE} was replaced; put the run's own back, or remove it (the id is then read from "
            "the checkpoints)"
        )
    where = f"run {run}, which {out_dir} holds"
    for p in done:
        theirs = checkpoint_run(p)
        if theirs not in (None, run):
            return (
                f"checkpoint {p} was saved by another run ({theirs}) than {where}: move it out of "
                f"{out_dir / CHECKPOINTS} (to continue that run, resume it by path with a new --out_dir)"
            )
    final = _card_run(out_dir)
    if final not in (None, run):
        return (
            f"the final weights {out_dir / WEIGHTS} were trained by another run ({final}) than {where}: move "
            f"them and their {MODEL_CONFIG} out of {out_dir}"
        )
    return None


def check_own(out_dir: str | Path, run: str | None = None) -> None:
    """Raise `disowned`'s line, if any."""
    message = disowned(out_dir, run)
    if message:
        raise UserError(message)


def _card_run(folder: Path) -> str | None:
    try:
        run = json.loads((folder / MODEL_CONFIG).read_text(encoding="utf-8")).get("run")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None  # no final weights, or damaged ones: `load_weights` names damage
    return run if isinstance(run, str) else None
