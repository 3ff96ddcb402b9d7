"""`run.py eval`: HellaSwag and/or validation loss of a checkpoint, on every rank; one JSON object printed.

    accelerate launch run.py eval --checkpoint P --hellaswag SRC --data_dir D

The JSON holds `acc_norm, acc` with their standard errors `acc_norm_stderr, acc_stderr`, and `correct_norm,
correct, total` with --hellaswag; `val_loss`, `val_bpb` (bits per byte, see `val_loss.py`; left out, with one line
on stderr saying why, for data prepared before byte counts existed) and the `eval_windows, batch_size` they were
computed with, with --data_dir; and `num_processes` (the size of the group that computed it): the values are the
same for any size.

The validation loss is the mean over the first `eval_windows` windows of the val split (all of them, said on stderr,
when it holds fewer): the same value, to float round-off, for any batch size or number of processes. For a run's
weights (a run dir or one of its checkpoints) it defaults to the run's own val set (its config.yaml; `eval_steps x
micro_batch_size` in a config written before eval_windows existed): `eval` then reports the val_loss the run logged
for those weights. An export of a run records that size in its config.json (see `hf.EVAL_RECORD`), so the export
scores as its run does. Flags override it; other weights default to 160 windows, and weights without their run to
batches of 8. One line on stderr says how many windows are scored and where that number came from.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Subset

from accel_gpt.config import DEFAULT_EVAL_WINDOWS, EvalConfig, resolve_eval_windows
from accel_gpt.data import shards
from accel_gpt.data.loader import check_vocab, val_windows
from accel_gpt.data.shards import read_manifest
from accel_gpt.errors import DataError, UserError
from accel_gpt.evaluate.hellaswag import (
    Prediction,
    check_vocabulary,
    hellaswag_loader,
    hellaswag_metrics,
    load_hellaswag,
    score_hellaswag,
)
from accel_gpt.evaluate.val_loss import (
    bits_per_byte,
    evaluate_loss,
    no_bpb_note,
    run_val_windows,
    short_split_note,
)
from accel_gpt.files import atomic_write, write_or_refuse
from accel_gpt.hf import recorded_eval_windows
from accel_gpt.rundir import read_run_config, run_of
from accel_gpt.runtime import make_accelerator
from accel_gpt.tokenizer import Tokenizer
from accel_gpt.weights import ModelCard, load_model

# Without a run to take it from (the val set's size comes from config.DEFAULT_EVAL_WINDOWS).
DEFAULT_BATCH_SIZE = 8


def run_eval(cfg: EvalConfig) -> None:
    cfg, windows_from = with_run_settings(cfg)
    if cfg.out:
        check_out_path(Path(cfg.out), cfg)  # before minutes of scoring, not after
    accelerator = make_accelerator()
    examples = None
    if cfg.hellaswag:
        with accelerator.main_process_first():  # a hub download lands in the cache once
            examples = load_hellaswag(cfg.hellaswag, cfg.limit or None)
        if accelerator.is_main_process:
            print(scoring_line(len(examples), cfg.limit), file=sys.stderr)
    model, card = load_model(cfg.checkpoint, accelerator.device)
    if examples is not None:
        check_vocabulary(card.model.vocab_size, card.tokenizer)
    windows, per_byte = val_data(cfg, card) if cfg.data_dir else (None, None)  # checked before anything is scored
    if windows is not None and accelerator.is_main_process:
        scoring = f"val_loss: scoring {len(windows)} windows of {card.model.seq_len} tokens ({windows_from})"
        print(scoring, file=sys.stderr)
        if len(windows) < cfg.eval_windows:
            note = short_split_note(cfg.data_dir, len(windows), cfg.eval_windows, card.model.seq_len)
            print(f"note: {note}", file=sys.stderr)
        if per_byte is None:
            print(f"note: {no_bpb_note([cfg.data_dir])}", file=sys.stderr)
    if accelerator.mixed_precision != "no":  # autocast from the launch config; no DDP, evaluation needs no grads
        model = accelerator.prepare_model(model, evaluation_mode=True)
    result: dict[str, float | int] = {}
    predictions: list[Prediction] = []
    if examples is not None:
        loader = accelerator.prepare_data_loader(
            hellaswag_loader(examples, card.model.seq_len, cfg.batch_size, card.tokenizer)
        )
        predictions = score_hellaswag(model, accelerator, loader, estimate=True)
        result |= hellaswag_metrics(predictions)
    if windows is not None:
        val_dl = accelerator.prepare_data_loader(DataLoader(windows, batch_size=cfg.batch_size))
        result["val_loss"] = evaluate_loss(model, val_dl, accelerator)
        if per_byte is not None:
            result["val_bpb"] = bits_per_byte(result["val_loss"], per_byte)
        result |= {"eval_windows": len(windows), "batch_size": cfg.batch_size}
    result["num_processes"] = accelerator.num_processes
    if accelerator.is_main_process:
        if cfg.out and examples is not None:
            write_predictions(Path(cfg.out), predictions)
        print(json.dumps(result))
    accelerator.end_training()


def scoring_line(count: int, limit: int) -> str:
    """What is about to be scored; the `--limit` hint only where it was not given, as it would repeat the command."""
    if not limit:
        return f"HellaSwag: scoring all {count:,} examples (4 endings each; --limit N scores fewer)"
    if count < limit:  # the source ran out first
        return f"HellaSwag: scoring all {count:,} examples (4 endings each; fewer than --limit {limit:,})"
    return f"HellaSwag: scoring the first {count:,} examples (4 endings each)"


def with_run_settings(cfg: EvalConfig) -> tuple[EvalConfig, str]:
    """`cfg` with eval_windows and batch_size set, and where the number of windows came from, in words: the flags
    (`--eval_steps` counts batches of the batch size), else the run's own (see the module), else what an export
    recorded of its run, else the defaults."""
    run = run_of(cfg.checkpoint) if cfg.eval_windows is None or cfg.batch_size is None else None
    saved = read_run_config(run) if run is not None else {}
    saved_batch = saved.get("micro_batch_size") if _positive(saved.get("micro_batch_size")) else None
    batch = cfg.batch_size or saved_batch or DEFAULT_BATCH_SIZE
    if cfg.eval_windows is not None or cfg.eval_steps is not None:
        windows, _ = resolve_eval_windows(cfg.eval_windows, cfg.eval_steps, batch)
        source = "--eval_windows" if cfg.eval_steps is None else f"--eval_steps {cfg.eval_steps} x batch size {batch}"
    elif (windows := run_val_windows(saved)) is not None:
        source = "the run's eval_windows, from its config.yaml"
    elif (windows := recorded_eval_windows(cfg.checkpoint)) is not None:
        source = "the eval_windows of the run it was exported from, recorded in its config.json"
    else:
        windows, source = DEFAULT_EVAL_WINDOWS, "the default eval_windows; --eval_windows N scores another number"
    return replace(cfg, eval_windows=windows, eval_steps=None, batch_size=batch), source


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def val_data(cfg: EvalConfig, card: ModelCard) -> tuple[Subset, float | None]:
    """The validation windows of --data_dir, once the shards are known to be in the model's tokens and vocabulary,
    and the val split's tokens per byte (None when its manifest counts no bytes)."""
    manifest = read_manifest(cfg.data_dir)
    check_same_tokenizer(manifest, card.tokenizer, cfg.data_dir, cfg.checkpoint)
    fewer = "the model has fewer ids than the data's tokenizer: it was trained with another one, so these shards "
    check_vocab(manifest, card.model.vocab_size, cfg.data_dir, fewer + "cannot score it")
    windows = val_windows(cfg.data_dir, card.model.seq_len, cfg.eval_windows)
    return windows, shards.tokens_per_byte(manifest, "val")


def check_same_tokenizer(manifest: dict[str, Any], model_tok: Tokenizer, data_dir: str, checkpoint: str) -> None:
    """The shards must be in the model's own tokens: ids of another tokenizer index the same embedding rows and give a
    val_loss that looks like a number but means nothing (a GPT-2 model on char ids, or the reverse)."""
    data_tok = shards.tokenizer(manifest, data_dir)
    if data_tok == model_tok:
        return
    what, want = _describe(data_tok), _describe(model_tok)
    if what == want:
        what += " (another one of that size)"
    raise DataError(
        f"the shards in {data_dir} hold {what}, but {checkpoint} was trained on {want}: its val_loss on them would "
        "mean nothing; prepare the data with the model's tokenizer"
    )


def _describe(tok: Tokenizer) -> str:
    if tok.name == "bpe":
        return f"the tokens of a BPE of {tok.vocab_size:,} learned from text"
    return f"{tok.vocab_size} characters" if tok.name == "char" else "GPT-2's tokens"


def check_out_path(path: Path, cfg: EvalConfig) -> None:
    """--out is a file in a folder that can be written (or made): refused up front, and nothing is created yet. It
    replaces only an earlier --out of eval: never the HellaSwag rows being scored, a file of the model's folder, or
    any other file."""
    if path.is_dir() or not path.name or path.name in (".", ".."):
        raise UserError(f"--out {path} is a folder; give a file name, e.g. --out {path / 'predictions.jsonl'}")
    target = path.resolve()
    model = Path(cfg.checkpoint).resolve()
    if Path(cfg.hellaswag).exists() and target == Path(cfg.hellaswag).resolve():
        raise UserError(f"--out {path} is the --hellaswag file being scored; write the predictions to another file")
    if model.is_dir() and (target.parent == model or model in target.parents):
        raise UserError(f"--out {path} is inside the model's folder {cfg.checkpoint}; write the predictions elsewhere")
    if path.is_file() and not _holds_predictions(path):
        raise UserError(
            f"--out {path} exists and is not a predictions file of `eval --out`; remove it or write to another file"
        )
    folder = next(p for p in path.absolute().parents if p.exists())  # the nearest folder that exists
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write --out {path}: {folder} is not a writable folder")


def _holds_predictions(path: Path) -> bool:
    """Whether `path` is empty or its first line is a prediction row (what `write_predictions` writes)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        return not first.strip() or {"ind", "label", "pred_norm"} <= set(json.loads(first))
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return False


def write_predictions(path: Path, predictions: list[Prediction]) -> None:
    """One jsonl line per example (`ind`, `label`, `pred_norm`, `pred_sum`), written whole or not at all."""
    lines = (
        json.dumps({"ind": p.ind, "label": p.label, "pred_norm": p.pred_norm, "pred_sum": p.pred_sum}) + "\n"
        for p in predictions
    )
    text = "".join(lines)

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)

    write_or_refuse(f"--out {path}", path, write, len(text.encode()))  # a disk that filled up or turned read-only
