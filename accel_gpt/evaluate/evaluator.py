"""Evaluation during training: validation loss, HellaSwag and a text sample, each at its own cadence.

Everything an evaluation needs is built and checked when the run starts (a missing val split, a prompt
the tokenizer cannot encode, a bad HellaSwag file fail before step 1), and the loaders are prepared once.
Evaluation of a compiled model runs eagerly: its batch shapes differ from training's, and compiling
them would add graphs (and minutes of compile time on a GPU) at the first evaluation of every run.

For a mixture of sources, each source with a val split is evaluated on its own first `eval_windows` windows:
`val_loss/<folder name>` for each, and `val_loss` their mean weighted by `data_weights` (renormalised over the
sources that have a val split), so it measures the mixture the model is trained on.

Bits per byte (`val_bpb`, see `val_loss`) joins each val loss whose data records its byte count: `val_bpb/<folder
name>` with that source's own tokens per byte, and the mixture's `val_bpb` = `val_loss` over the mixture's bytes per
token (each source's, weighted like the losses), i.e. the bits of a batch drawn in those shares over its bytes. Data
prepared before byte counts existed gets no `val_bpb`, and one line at start-up says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.data import DataLoader

from accel_gpt.config import TrainConfig
from accel_gpt.data.loader import has_val, source_names, val_windows
from accel_gpt.data.shards import read_manifest, tokens_per_byte
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.evaluate.hellaswag import (
    check_vocabulary,
    describe,
    hellaswag_loader,
    hellaswag_metrics,
    load_hellaswag,
    score_hellaswag,
)
from accel_gpt.evaluate.val_loss import bits_per_byte, evaluate_loss, no_bpb_note, short_split_note
from accel_gpt.generate import NonFiniteLogits, encode_prompt, sample_texts
from accel_gpt.metrics import Tally
from accel_gpt.tracking import divergence_advice
from accel_gpt.weights import ModelCard

logger = get_logger(__name__)
# The HellaSwag results a metrics row gets, each as `hellaswag_<key>`.
HELLASWAG_KEYS = ("acc_norm", "acc", "acc_norm_stderr", "acc_stderr")


@dataclass
class ValSource:
    """One source's validation windows, prepared for the processes, and its share of the mixture."""

    name: str
    weight: float
    loader: DataLoader
    tokens_per_byte: float | None  # of its val split; None: the manifest counts no bytes, so no val_bpb


def val_sources(cfg: TrainConfig, accelerator: Accelerator) -> list[ValSource]:
    """The first `eval_windows` val windows of each source that has a val split (all of a smaller split, said once),
    with the tokens per byte that make its bits per byte."""
    sources, without = [], []
    for name, data_dir, weight in zip(source_names(cfg.data_dirs), cfg.data_dirs, cfg.source_weights(), strict=True):
        if not has_val(data_dir):
            logger.info(f"source {name} has no val split: val_loss leaves it out")
            continue
        windows = val_windows(
            data_dir,
            cfg.seq_len,
            cfg.eval_windows,
            checksums=accelerator.is_local_main_process,
            verify=cfg.verify_data,
        )
        if len(windows) < cfg.eval_windows:
            logger.warning(short_split_note(data_dir, len(windows), cfg.eval_windows, cfg.seq_len))
        loader = accelerator.prepare_data_loader(DataLoader(windows, batch_size=cfg.micro_batch_size))
        sources.append(ValSource(name, weight, loader, tokens_per_byte(read_manifest(data_dir), "val")))
        if sources[-1].tokens_per_byte is None:
            without.append(str(data_dir))
    if without:
        logger.warning(no_bpb_note(without))  # once per run, main process only
    return sources


def _bpb(key: str, loss: float, tokens_per_byte: float | None) -> dict[str, float]:
    """{key: bits per byte}, or nothing where the data counts no bytes."""
    return {key: bits_per_byte(loss, tokens_per_byte)} if tokens_per_byte else {}


class Evaluator:
    def __init__(
        self, cfg: TrainConfig, accelerator: Accelerator, model: torch.nn.Module, card: ModelCard, splits: list[str]
    ) -> None:
        self.cfg, self.accelerator, self.model, self.card = cfg, accelerator, model, card
        self.tally = Tally("evaluation")
        self.val_sources: list[ValSource] = []
        self.hellaswag_dl: DataLoader | None = None
        if cfg.eval_every:
            if "val" not in splits:
                raise ConfigError(
                    f"eval_every={cfg.eval_every} but {cfg.data_dir} has no 'val' shards; "
                    "prepare it again with --val_tokens N into a new --out_dir, or set --eval_every 0"
                )
            self.val_sources = val_sources(cfg, accelerator)
            if cfg.sample_tokens:
                encode_prompt(card.tokenizer, cfg.sample_prompt)
        if cfg.hellaswag_every:
            check_vocabulary(card.model.vocab_size, card.tokenizer)
            with accelerator.main_process_first():  # a hub download lands in the cache once
                examples = load_hellaswag(cfg.hellaswag, cfg.hellaswag_limit or None)
            loader = hellaswag_loader(examples, cfg.seq_len, cfg.micro_batch_size, card.tokenizer)
            self.hellaswag_dl = accelerator.prepare_data_loader(loader)

    def due(self, step: int, last: bool) -> bool:
        return self._val_due(step, last) or self._hellaswag_due(step, last)

    def _val_due(self, step: int, last: bool) -> bool:
        return bool(self.val_sources) and (step % self.cfg.eval_every == 0 or last)

    def _hellaswag_due(self, step: int, last: bool) -> bool:
        return self.hellaswag_dl is not None and (step % self.cfg.hellaswag_every == 0 or last)

    def run(self, step: int, last: bool) -> dict[str, Any]:
        """What is due at `step` (every rank calls this): the metrics to add to that step's row."""
        row: dict[str, Any] = {}
        if not self.due(step, last):
            return row
        with self.tally.timed(), self._eager():
            if self._val_due(step, last):
                row |= self._val_losses()
                if self.cfg.sample_tokens:
                    logger.info(f"sample at step {step}: {self._sample(step)!r}")
            if self._hellaswag_due(step, last):
                metrics = hellaswag_metrics(score_hellaswag(self.model, self.accelerator, self.hellaswag_dl))
                logger.info(f"HellaSwag at step {step}: {describe(metrics)}")
                row |= {f"hellaswag_{key}": metrics[key] for key in HELLASWAG_KEYS}
        return row

    def _val_losses(self) -> dict[str, float]:
        """`val_loss` and `val_bpb`; for a mixture also `val_loss/<source>` and `val_bpb/<source>`, and `val_loss` is
        their weighted mean (`val_bpb`: see the module docstring)."""
        losses = {s.name: evaluate_loss(self.model, s.loader, self.accelerator) for s in self.val_sources}
        if len(self.cfg.data_dirs) == 1:
            (source,) = self.val_sources
            return {"val_loss": losses[source.name]} | _bpb("val_bpb", losses[source.name], source.tokens_per_byte)
        total = sum(s.weight for s in self.val_sources)
        mean = sum(s.weight * losses[s.name] for s in self.val_sources) / total
        row = {"val_loss": mean}
        if all(s.tokens_per_byte for s in self.val_sources):
            bytes_per_token = sum(s.weight / s.tokens_per_byte for s in self.val_sources) / total
            row |= _bpb("val_bpb", mean, 1 / bytes_per_token)
        row |= {f"val_loss/{name}": loss for name, loss in losses.items()}
        for s in self.val_sources:
            row |= _bpb(f"val_bpb/{s.name}", losses[s.name], s.tokens_per_byte)
        return row

    def _sample(self, step: int) -> str:
        """A sample of the weights of `step`; weights whose logits overflow stop the run as a divergence would (their
        loss at the next step is the first that could show it)."""
        try:
            (text,) = sample_texts(
                self.model,
                self.card.model,
                self.card.tokenizer,
                self.cfg.sample_prompt,
                self.cfg.sample_tokens,
                temperature=1.0,
                top_k=50,
                seed=self.cfg.seed,
                device=self.accelerator.device,
                stop_early=False,  # every rank runs sample_tokens forward passes (see accel_gpt.generate)
            )
        except NonFiniteLogits:
            advice = divergence_advice(self.cfg.out_dir, step + 1, self.cfg.optimizer)
            raise UserError(
                f"training diverged by step {step}: its weights give non-finite logits (the sample at step {step}), "
                f"so it stopped without saving them; {advice}"
            ) from None
        return text

    @contextlib.contextmanager
    def _eager(self) -> Iterator[None]:
        if self.cfg.compile and hasattr(torch.compiler, "set_stance"):
            with torch.compiler.set_stance("force_eager"):
                yield
        else:
            yield
