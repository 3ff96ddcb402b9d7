"""HellaSwag: pick the most likely of four endings, scored by the language model itself.

Each candidate is `context tokens + tokens of (" " + ending)` (tiktoken gpt2). The four candidates of an
example sit in one right-padded batch; a mask marks the ending tokens, and only their losses count.
`acc_norm` picks the ending with the lowest *mean* token loss, `acc` the lowest *summed* loss (which
favours short endings). Several examples share a forward pass.

Distribution: the examples go through a DataLoader prepared by the Accelerator, so rank r scores only
its own share, and per-example results come back through `gather_for_metrics`, which drops the
duplicates that even batching pads into the last batch. Every rank therefore holds the same complete
list of predictions, for any number of processes and any number of examples.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from accel_gpt.errors import UserError
from accel_gpt.tokenizer import Tokenizer

NUM_ENDINGS = 4
HUB_ID = "Rowan/hellaswag"
_HUB_ID_RE = re.compile(r"^[\w.-]+/[\w.-]+$")
# Padded lengths are rounded up to this many tokens: fewer distinct shapes for `torch.compile` to
# specialise on, and GPU-friendly sizes; the extra positions are masked out and, being on the right
# under causal attention, never change the scored positions.
PAD_MULTIPLE = 32


@dataclass(frozen=True)
class Example:
    ind: int  # the row's own `ind` (its position in the source when the row has none)
    ctx: str
    endings: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class Prediction:
    position: int  # index in the list of examples that was scored
    ind: int
    label: int
    pred_norm: int  # argmin of the mean ending-token loss
    pred_sum: int  # argmin of the summed ending-token loss


# ---------------------------------------------------------------------------------------------- loading


def load_hellaswag(source: str, limit: int | None = None) -> list[Example]:
    """Examples from a jsonl file, an http(s) URL of one (original release format) or a hub dataset id.

    The hub branch (`Rowan/hellaswag`, validation split) imports `datasets` only when it is taken, so
    training and file-based evaluation run without `datasets` installed.
    """
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be a positive number of examples, got {limit}")
    path = Path(source).expanduser()
    if source.startswith(("http://", "https://")):
        rows = _jsonl_rows(_fetch_lines(source), source)
    elif path.is_file():
        rows = _jsonl_rows(_file_lines(path), source)
    elif path.exists():
        raise UserError(f"HellaSwag source '{source}' is a folder; give its jsonl file")
    elif _HUB_ID_RE.match(source) and not source.endswith((".jsonl", ".json")):
        rows = _hub_rows(source)
    elif source.endswith((".jsonl", ".json")) or source.startswith((".", "/", "~")) or "/" in source:
        raise UserError(f"HellaSwag file '{source}' does not exist")
    else:
        raise UserError(
            f"HellaSwag source '{source}' does not exist as a file, and is not an http(s) URL or a hub id like {HUB_ID}"
        )
    examples, seen = [], {}
    for position, (where, row) in enumerate(rows):
        if limit is not None and position >= limit:
            break
        example = parse_row(row, where, position)
        if example.ind in seen:  # scored twice, it would count twice and shrink the standard error
            raise UserError(f"{where}: example ind={example.ind} again (first at {seen[example.ind]}); keep one")
        seen[example.ind] = where
        examples.append(example)
    if not examples:
        raise UserError(f"HellaSwag source '{source}' holds no examples")
    return examples


def _file_lines(path: Path) -> Iterator[bytes]:
    """Raw lines: each is decoded on its own, so that a bad byte is reported with its line number."""
    try:
        with open(path, "rb") as f:
            yield from f
    except OSError as e:
        raise UserError(f"cannot read HellaSwag file {path}: {e.strerror or e}") from None


def _fetch_lines(url: str) -> list[bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"cannot read HellaSwag from {url}: {e}") from None
    return data.splitlines()


def _jsonl_rows(lines: Iterable[bytes], source: str) -> Iterator[tuple[str, Any]]:
    """(location, decoded object) per non-blank line; locations are 1-based line numbers."""
    for number, raw in enumerate(lines, start=1):
        where = f"{source} line {number}"
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark may open the file
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None


def _hub_rows(hub_id: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"loading '{hub_id}' from the hub needs the `datasets` package; or pass a jsonl file") from None
    try:
        split = datasets.load_dataset(hub_id, split="validation")
    except Exception as e:  # datasets raises many types (offline, not found, no such split)
        raise UserError(f"cannot load the validation split of hub dataset '{hub_id}': {e}") from None
    for number, row in enumerate(split):
        yield f"{hub_id} validation row {number}", row


def parse_row(row: Any, where: str, position: int) -> Example:
    """Check one row of the original format; the hub's string labels ("0".."3") are accepted too."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("ctx", "endings", "label") if k not in row]
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)} (expected ctx, endings, label)")
    ctx, endings, label = row["ctx"], row["endings"], row["label"]
    if not isinstance(ctx, str) or not ctx:  # an empty context leaves a 1-token ending nothing to be predicted from
        raise UserError(f"{where}: 'ctx' must be a non-empty string, got {ctx!r}")
    if not isinstance(endings, list) or len(endings) != NUM_ENDINGS or not all(isinstance(e, str) for e in endings):
        got = f"{len(endings)} items" if isinstance(endings, list) else type(endings).__name__
        raise UserError(f"{where}: 'endings' must be a list of {NUM_ENDINGS} strings, got {got}")
    if not all(e.strip() for e in endings):  # an empty ending has no tokens to score
        raise UserError(f"{where}: ending {[bool(e.strip()) for e in endings].index(False)} is empty")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < NUM_ENDINGS:
        raise UserError(f"{where}: 'label' must be an integer 0-{NUM_ENDINGS - 1}, got {row['label']!r}")
    ind = row.get("ind", position)
    if isinstance(ind, bool) or not isinstance(ind, int):
        raise UserError(f"{where}: 'ind' must be an integer, got {ind!r}")
    return Example(ind=ind, ctx=ctx, endings=tuple(endings), label=label)


# ---------------------------------------------------------------------------------------------- batching


class HellaSwagTokens(Dataset):
    """Examples tokenized on access, so each rank encodes only the examples it scores."""

    def __init__(self, examples: list[Example], tokenizer: Tokenizer, seq_len: int) -> None:
        self.examples = examples
        self.tokenizer = tokenizer
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ex = self.examples[i]
        ctx = self.tokenizer.encode(ex.ctx)
        rows, masks = [], []
        for ending in (self.tokenizer.encode(" " + e) for e in ex.endings):
            # too long for the context window: keep the rightmost tokens (the ending, and the context just before it)
            rows.append((ctx + ending)[-self.seq_len :])
            masks.append(([0] * len(ctx) + [1] * len(ending))[-self.seq_len :])
        return {"position": i, "label": ex.label, "rows": rows, "masks": masks}


def collate(items: list[dict[str, Any]], seq_len: int) -> dict[str, torch.Tensor]:
    """n examples -> tokens/mask (4n, T) right-padded with token 0, plus position and label (n,)."""
    rows = [r for item in items for r in item["rows"]]
    masks = [m for item in items for m in item["masks"]]
    longest = max(len(r) for r in rows)  # rows are already cut to seq_len
    T = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, seq_len)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for j, (r, m) in enumerate(zip(rows, masks, strict=True)):
        tokens[j, : len(r)] = torch.tensor(r)
        mask[j, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return {
        "tokens": tokens,
        "mask": mask,
        "position": torch.tensor([item["position"] for item in items]),
        "label": torch.tensor([item["label"] for item in items]),
    }


# ---------------------------------------------------------------------------------------------- scoring


def candidate_losses(
    model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean cross-entropy over the masked (ending) tokens of each row: two (N,) fp32 tensors.

    Token t is predicted at position t-1, so the loss of row j is read from logits[j, :-1] against
    tokens[j, 1:] where mask[j, 1:] is set. Only those positions go through the fp32 cross-entropy,
    which keeps the (N, T, vocab) fp32 copy to the ending tokens alone.
    """
    logits, _ = model(tokens)  # (N, T, V)
    scored = mask[:, 1:]  # (N, T-1)
    ce = F.cross_entropy(logits[:, :-1][scored].float(), tokens[:, 1:][scored], reduction="none")
    token_loss = torch.zeros(scored.shape, dtype=torch.float32, device=tokens.device)
    token_loss[scored] = ce
    total = token_loss.sum(1)
    return total, total / scored.sum(1).clamp(min=1)


def choose(total: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(4n,) candidate losses -> (pred_norm, pred_sum), each (n,): the lowest mean and the lowest sum."""
    return mean.view(-1, NUM_ENDINGS).argmin(1), total.view(-1, NUM_ENDINGS).argmin(1)


def hellaswag_loader(
    examples: list[Example], seq_len: int, batch_size: int, tokenizer: Tokenizer | None = None
) -> DataLoader:
    """Examples in order, `batch_size` per forward pass (4x as many rows), tokenized on access in the model's tokens
    (GPT-2's unless said); prepare it once with `accelerator.prepare_data_loader` so each rank scores only its
    share."""
    dataset = HellaSwagTokens(examples, tokenizer or Tokenizer("gpt2"), seq_len)
    return DataLoader(dataset, batch_size=batch_size, collate_fn=partial(collate, seq_len=seq_len))


def check_vocabulary(vocab_size: int, tokenizer: Tokenizer | None = None) -> None:
    """HellaSwag is scored in the model's own tokens: GPT-2's or a trained bpe's (a char vocabulary lacks most of its
    text's characters), with an embedding row for each."""
    tokenizer = tokenizer or Tokenizer("gpt2")
    if tokenizer.name == "char":
        raise UserError(
            "HellaSwag is scored in the model's tokens, and a char model's vocabulary lacks characters of its text: "
            "score a model trained on gpt2 or bpe tokens"
        )
    if vocab_size < tokenizer.vocab_size:
        what = "a GPT-2 vocabulary" if tokenizer.name == "gpt2" else "its tokenizer's vocabulary"
        raise UserError(f"HellaSwag needs {what} (>= {tokenizer.vocab_size} ids); this model has {vocab_size}")


@torch.no_grad()
def score_hellaswag(
    model: torch.nn.Module, accelerator: Accelerator, loader: DataLoader, estimate: bool = False
) -> list[Prediction]:
    """Per-example predictions in example order, identical on every rank; every rank must call this.

    `loader` is a prepared `hellaswag_loader`. `model` may be the prepared one (DDP/FSDP-wrapped, compiled,
    under mixed-precision autocast): even batching gives every rank the same number of forward passes, so
    wrappers that communicate inside forward stay in step. `estimate`: once the first batch is scored, say how
    long all of them should take at its pace (`eval` of all 10,042 examples takes minutes on a CPU).
    """
    examples = loader.dataset.examples
    was_training = model.training
    model.eval()
    gathered: list[dict[str, torch.Tensor]] = []
    bar = tqdm(loader, desc="HellaSwag", unit="batch", leave=False, disable=not accelerator.is_main_process)
    started = time.perf_counter()
    for batch in bar:  # 10,042 examples take minutes on a CPU: show where it is
        total, mean = candidate_losses(model, batch["tokens"], batch["mask"])
        pred_norm, pred_sum = choose(total, mean)
        result = {"position": batch["position"], "label": batch["label"], "pred_norm": pred_norm, "pred_sum": pred_sum}
        gathered.append({k: v.cpu() for k, v in accelerator.gather_for_metrics(result).items()})
        if estimate and len(gathered) == 1 and len(loader) > 1 and accelerator.is_main_process:
            seconds = (time.perf_counter() - started) * len(loader)
            pace = f"HellaSwag: about {_duration(seconds)} for {len(loader):,} batches at the first one's pace"
            tqdm.write(pace, file=sys.stderr)
    model.train(was_training)
    return _in_order(gathered, examples)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _in_order(gathered: list[dict[str, torch.Tensor]], examples: list[Example]) -> list[Prediction]:
    """Gathered batches (rank-interleaved) -> one prediction per example, in example order."""
    columns = {k: torch.cat([g[k] for g in gathered]).tolist() for k in gathered[0]}
    by_position: dict[int, Prediction] = {}
    for position, label, pred_norm, pred_sum in zip(
        columns["position"], columns["label"], columns["pred_norm"], columns["pred_sum"], strict=True
    ):
        if position in by_position:
            raise RuntimeError(f"HellaSwag example {position} was gathered twice: duplicates were not dropped")
        by_position[position] = Prediction(position, examples[position].ind, label, pred_norm, pred_sum)
    if len(by_position) != len(examples):
        raise RuntimeError(f"gathered {len(by_position)} HellaSwag results for {len(examples)} examples")
    return [by_position[p] for p in range(len(examples))]


def hellaswag_metrics(predictions: list[Prediction]) -> dict[str, float | int | None]:
    """Accuracies with their standard errors: on a few hundred examples the accuracy is mostly noise, and the
    standard error says how much (about 0.02 on 500 examples, 0.0045 on all 10,042)."""
    correct_norm = sum(p.pred_norm == p.label for p in predictions)
    correct = sum(p.pred_sum == p.label for p in predictions)
    total = len(predictions)
    return {
        "acc_norm": correct_norm / total,
        "acc": correct / total,
        "acc_norm_stderr": standard_error(correct_norm, total),
        "acc_stderr": standard_error(correct, total),
        "correct_norm": correct_norm,
        "correct": correct,
        "total": total,
    }


def standard_error(correct: int, total: int) -> float | None:
    """Standard error of an accuracy: the sample standard deviation of the 0/1 outcomes over sqrt(total), as
    lm-evaluation-harness computes it, so the two are comparable. None for one example (no spread to measure)."""
    if total < 2:
        return None
    p = correct / total
    return math.sqrt(p * (1 - p) / (total - 1))


def describe(metrics: dict[str, Any]) -> str:
    """'acc_norm 0.2800 ± 0.0641 on 50' (the ± is one standard error)."""
    stderr = metrics["acc_norm_stderr"]
    spread = f" ± {stderr:.4f}" if stderr is not None else ""
    return f"acc_norm {metrics['acc_norm']:.4f}{spread} on {metrics['total']}"
