"""`run.py eval`: HellaSwag and/or validation loss of a checkpoint, on every rank; one JSON object printed.

    accelerate launch run.py eval --checkpoint P --hellaswag SRC --data_dir D

The JSON holds `acc_norm, acc, correct_norm, correct, total` with --hellaswag, `val_loss` with --data_dir,
and `num_processes` (the size of the group that computed it): the values are the same for any size.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.utils.data import DataLoader

from accel_gpt.config import EvalConfig
from accel_gpt.data.loader import check_vocab, val_windows
from accel_gpt.data.shards import read_manifest
from accel_gpt.errors import UserError
from accel_gpt.evaluate.hellaswag import (
    Prediction,
    check_vocabulary,
    hellaswag_loader,
    hellaswag_metrics,
    load_hellaswag,
    score_hellaswag,
)
from accel_gpt.evaluate.val_loss import evaluate_loss
from accel_gpt.files import atomic_write
from accel_gpt.runtime import make_accelerator
from accel_gpt.weights import load_model


def run_eval(cfg: EvalConfig) -> None:
    accelerator = make_accelerator()
    examples = None
    if cfg.hellaswag:
        with accelerator.main_process_first():  # a hub download lands in the cache once
            examples = load_hellaswag(cfg.hellaswag, cfg.limit or None)
    model, card = load_model(cfg.checkpoint, accelerator.device)
    if accelerator.mixed_precision != "no":  # autocast from the launch config; no DDP, evaluation needs no grads
        model = accelerator.prepare_model(model, evaluation_mode=True)
    result: dict[str, float | int] = {}
    predictions: list[Prediction] = []
    if examples is not None:
        if card.tokenizer.name != "gpt2":
            raise UserError(
                f"HellaSwag is scored with the gpt2 tokenizer; {cfg.checkpoint} uses '{card.tokenizer.name}'"
            )
        check_vocabulary(card.model.vocab_size)
        loader = accelerator.prepare_data_loader(hellaswag_loader(examples, card.model.seq_len, cfg.batch_size))
        predictions = score_hellaswag(model, accelerator, loader)
        result |= hellaswag_metrics(predictions)
    if cfg.data_dir:
        check_vocab(read_manifest(cfg.data_dir), card.model.vocab_size, cfg.data_dir)
        windows = val_windows(cfg.data_dir, card.model.seq_len, cfg.eval_steps * cfg.batch_size)
        val_dl = accelerator.prepare_data_loader(DataLoader(windows, batch_size=cfg.batch_size))
        result["val_loss"] = evaluate_loss(model, val_dl, accelerator)
    result["num_processes"] = accelerator.num_processes
    if accelerator.is_main_process:
        if cfg.out and examples is not None:
            write_predictions(Path(cfg.out), predictions)
        print(json.dumps(result))
    accelerator.end_training()


def write_predictions(path: Path, predictions: list[Prediction]) -> None:
    """One jsonl line per example (`ind`, `label`, `pred_norm`, `pred_sum`), written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (
        json.dumps({"ind": p.ind, "label": p.label, "pred_norm": p.pred_norm, "pred_sum": p.pred_sum}) + "\n"
        for p in predictions
    )
    atomic_write(path, "".join(lines))
