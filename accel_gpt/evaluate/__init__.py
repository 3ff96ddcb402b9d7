"""Evaluation: validation loss and HellaSwag, exact under any number of processes; `run.py eval`.

The trainer calls `evaluate_loss`, `load_hellaswag` + `evaluate_hellaswag` directly; `run_eval` is the
command-line front (`accelerate launch run.py eval --checkpoint P --hellaswag SRC --data_dir D`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator

from accel_gpt.errors import UserError
from accel_gpt.evaluate.hellaswag import (
    Example,
    Prediction,
    evaluate_hellaswag,
    hellaswag_metrics,
    load_hellaswag,
    score_hellaswag,
)
from accel_gpt.evaluate.val_loss import evaluate_loss
from accel_gpt.sample import gpt_config

__all__ = ["Example", "Prediction", "evaluate_hellaswag", "evaluate_loss", "load_hellaswag", "run_eval"]


def run_eval(args: argparse.Namespace) -> None:
    """Score a checkpoint on every rank; the main process prints one JSON object and writes --out.

    The JSON holds `acc_norm, acc, correct_norm, correct, total` with --hellaswag, `val_loss` with
    --data_dir, and `num_processes` (the size of the group that computed it).
    """
    _check_args(args)
    from accel_gpt.artifacts import load_model
    from accel_gpt.distributed import make_accelerator

    accelerator = make_accelerator()
    examples = None
    if args.hellaswag:
        with accelerator.main_process_first():  # a hub download lands in the cache once
            examples = load_hellaswag(args.hellaswag, args.limit)
    model, tokenizer, _ = load_model(args.checkpoint, accelerator.device)
    if accelerator.mixed_precision != "no":  # autocast from the launch config; no DDP, evaluation needs no grads
        model = accelerator.prepare_model(model, evaluation_mode=True)
    result: dict[str, float | int] = {}
    predictions: list[Prediction] = []
    if examples is not None:
        if tokenizer.name != "gpt2":
            raise UserError(f"HellaSwag is scored with the gpt2 tokenizer; {args.checkpoint} uses '{tokenizer.name}'")
        predictions = score_hellaswag(model, accelerator, examples, args.batch_size)
        result |= hellaswag_metrics(predictions)
        if args.limit is None:
            assert result["total"] == len(examples), f"scored {result['total']} of {len(examples)} examples"
    if args.data_dir:
        result["val_loss"] = _val_loss(model, accelerator, args)
    result["num_processes"] = accelerator.num_processes
    if accelerator.is_main_process:
        if args.out and examples is not None:
            write_predictions(Path(args.out), predictions)
        print(json.dumps(result))
    accelerator.end_training()


def _check_args(args: argparse.Namespace) -> None:
    if not args.hellaswag and not args.data_dir:
        raise UserError("nothing to evaluate: pass --hellaswag SRC and/or --data_dir D")
    if args.out and not args.hellaswag:
        raise UserError("--out writes HellaSwag predictions; it needs --hellaswag")
    for name in ("batch_size", "eval_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")


def _val_loss(model: torch.nn.Module, accelerator: Accelerator, args: argparse.Namespace) -> float:
    """The trainer's validation loss: the first eval_steps * batch_size windows of the 'val' split."""
    from torch.utils.data import DataLoader

    from accel_gpt.data.loader import check_vocab, val_windows
    from accel_gpt.data.shards import read_manifest

    cfg = gpt_config(model)
    check_vocab(read_manifest(args.data_dir), cfg.vocab_size, args.data_dir)
    windows = val_windows(args.data_dir, cfg.seq_len, args.eval_steps * args.batch_size)
    val_dl = accelerator.prepare_data_loader(DataLoader(windows, batch_size=args.batch_size))
    return evaluate_loss(model, val_dl, accelerator)


def write_predictions(path: Path, predictions: list[Prediction]) -> None:
    """One jsonl line per example (`ind`, `label`, `pred_norm`, `pred_sum`), written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    lines = (
        json.dumps({"ind": p.ind, "label": p.label, "pred_norm": p.pred_norm, "pred_sum": p.pred_sum})
        for p in predictions
    )
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
