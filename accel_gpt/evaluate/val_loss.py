"""Validation loss over a fixed set of windows: the first `eval_windows` of the val split, whatever the batch size
or the number of processes.

Each sequence's mean token loss is gathered with `gather_for_metrics` (which drops the duplicates that
even batching pads into the last batch), and the mean is taken over all of them in float64. All windows
have `seq_len` tokens, so the mean of per-sequence means is the token-level mean, and the value depends
only on which windows are in `val_dl`, not on how they were split over the ranks.

Bits per byte (`val_bpb`) is the same loss in a unit that does not depend on the tokenizer: val_loss (nats per
token) / ln 2 * (tokens / UTF-8 bytes of the val split), from the byte count `prepare` records in the manifest. A
char model's token is one character, a GPT-2 token about four: their losses per token differ by that much for the
same model quality, their bits per byte do not. The ratio is the whole split's while the loss is that of the windows
evaluated (its first `eval_windows` windows): the split's average bytes per token stands in for theirs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, val_dl: DataLoader, accelerator: Accelerator) -> float:
    """Mean cross-entropy over every window of `val_dl` (already passed through `accelerator.prepare`).

    Every rank must call this (it gathers). The model may be the prepared one (DDP/FSDP, compiled,
    autocast); it is put back into the train/eval mode it was in.
    """
    was_training = model.training
    model.eval()
    per_sequence = []
    for x, y in val_dl:
        logits, _ = model(x)  # (B, T, V)
        B, T, V = logits.shape
        loss = F.cross_entropy(logits.reshape(B * T, V).float(), y.reshape(B * T), reduction="none")
        per_sequence.append(accelerator.gather_for_metrics(loss.view(B, T).mean(1)))
    model.train(was_training)
    if not per_sequence:
        raise ValueError("the validation DataLoader is empty")
    return torch.cat(per_sequence).double().mean().item()


def bits_per_byte(loss: float, tokens_per_byte: float) -> float:
    """Nats per token -> bits per byte of text (see the module docstring)."""
    return loss / math.log(2) * tokens_per_byte


def no_bpb_note(folders: list[str]) -> str:
    """The one line said when val_bpb cannot be computed for some data: what is missing and the remedy."""
    return (
        f"val_bpb (bits per byte) is unavailable for {', '.join(folders)}: its manifest.json has no byte count of "
        "the val split (prepared before accel_gpt recorded it); run the prepare command that wrote it again, which "
        "adds the count without tokenizing again (or prepare it anew)"
    )


def short_split_note(data_dir: str, have: int, asked: int, seq_len: int) -> str:
    """The one line said when the val split holds fewer windows than the val set asks for: all of them are used."""
    return (
        f"the val split of {data_dir} holds {have} windows of {seq_len} tokens, fewer than eval_windows={asked}: "
        f"validation uses all {have}"
    )


def run_val_windows(config: dict[str, Any]) -> int | None:
    """The size of a run's val set from its config.yaml as written: `eval_windows`, or `eval_steps x micro_batch_size`
    in a config from before eval_windows existed (the set those runs logged); None where it records neither."""
    if _positive(config.get("eval_windows")):
        return config["eval_windows"]
    if _positive(config.get("eval_steps")) and _positive(config.get("micro_batch_size")):
        return config["eval_steps"] * config["micro_batch_size"]
    return None


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
