"""The training loop. It reads top to bottom like the data flow in DESIGN.md:

build (Accelerator, model, data, optimizer, schedule) -> resume -> loop over optimizer steps
(accumulated micro-steps, clip, update; periodic eval / HellaSwag / samples / checkpoints) -> final
weights. Devices, DDP wrapping, mixed precision and gradient sync belong to Accelerate; this module
never names a rank.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    set_seed,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from accel_gpt.artifacts import save_state_dict, tokenizer_from_meta, tokenizer_meta
from accel_gpt.checkpoint import TrainState, find_resume_checkpoint, load_checkpoint, save_checkpoint
from accel_gpt.config import MODEL_FIELDS, TrainConfig, save_config
from accel_gpt.data.loader import WindowSampler, check_vocab, train_windows, val_windows
from accel_gpt.distributed import make_accelerator
from accel_gpt.errors import ConfigError
from accel_gpt.metrics import MetricsFile, device_peak_flops, resolve_trackers
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.optim import make_optimizer, make_scheduler
from accel_gpt.tokenizer import Tokenizer

logger = get_logger(__name__)


@dataclass
class Run:
    """What `build` prepares: the objects the loop drives."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_dl: DataLoader
    sampler: WindowSampler
    val_dl: DataLoader | None
    hellaswag: list | None
    model_meta: dict[str, Any]  # model shape + tokenizer, written beside every saved set of weights
    flops_per_token: int
    tokenizer: Tokenizer | None  # for samples at eval time; built up front so a missing BPE file fails fast


def train(cfg: TrainConfig) -> None:
    accelerator = build_accelerator(cfg)
    run = build(cfg, accelerator)
    state = TrainState(config=cfg.to_dict())
    accelerator.register_for_checkpointing(state)
    metrics = MetricsFile(Path(cfg.out_dir) / "metrics.jsonl", accelerator.is_main_process)
    resume(cfg, accelerator, state, metrics)
    # Before start_run's barrier: once any rank trains, every rank turns SIGTERM into a clean stop (a rank that
    # died of it would take the others' last step and save down). Earlier, a signal just ends the process.
    stop = StopSignal()
    start_run(cfg, accelerator)
    run.sampler.start = state.data_position  # seek: the stream position follows from the step
    batches = iter(run.train_dl)
    logger.info(describe(cfg, accelerator, run))

    started = time.perf_counter()
    progress = tqdm(total=cfg.max_steps, initial=state.step, disable=not accelerator.is_main_process, unit="step")
    window = LogWindow(cfg, accelerator, run, state.step)
    while state.step < cfg.max_steps:
        window.add(train_step(run, batches, accelerator, cfg), stop.requested)
        state.step += 1
        state.tokens_seen += cfg.total_batch_size
        state.data_position += cfg.windows_per_step
        last = state.step == cfg.max_steps
        run_eval = due(state.step, cfg.eval_every, last) and run.val_dl is not None
        run_hellaswag = due(state.step, cfg.hellaswag_every, last) and bool(run.hellaswag)
        saving = due(state.step, cfg.save_every, last)
        stopping = False
        # A save step also writes its metrics rows: a resume keeps the rows up to its checkpoint's step.
        if last or saving or run_eval or run_hellaswag or state.step % cfg.log_every == 0:
            rows, stopping = window.collect(state.step)  # the one host sync; the window's timing ends here
            if run_eval:
                rows[-1] |= evaluate(run, accelerator, cfg, state)
            if run_hellaswag:
                rows[-1] |= hellaswag(run, accelerator, cfg)
            window.write(rows, metrics, progress)
        if saving or (stopping and cfg.save_every):
            val_loss = state.last_val_loss if run_eval else None  # keep_best ranks a checkpoint by its own loss
            save_checkpoint(
                accelerator, cfg.out_dir, state, run.model_meta, cfg.keep_checkpoints, cfg.keep_best, val_loss
            )
            window.restart_clock()  # saving time is not training throughput
        if stopping:
            saved = "resume with --resume auto" if cfg.save_every else "save_every=0, so no checkpoint was written"
            logger.info(f"stop requested: stopped after step {state.step}; {saved}")
            break
    progress.close()
    stop.restore()
    if state.step == cfg.max_steps:
        save_final(cfg, accelerator, run, state)
    logger.info(summary(cfg, state, window.last_row, time.perf_counter() - started))
    accelerator.end_training()


def train_step(run: Run, batches: Iterator, accelerator: Accelerator, cfg: TrainConfig) -> dict[str, Any]:
    """One optimizer step: accumulate over micro-steps, clip, update. Returns device tensors (no host sync)."""
    loss_sum = accumulate_gradients(run.model, batches, accelerator)
    lr = run.scheduler.get_last_lr()[0]  # the rate this update uses
    # Accelerate unscales and, under FSDP, reduces across shards; the norm is that of the mean gradient
    # over the whole global batch because DDP has already averaged the ranks' gradients.
    grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), cfg.grad_clip or math.inf)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    # this rank's mean loss; LogWindow.collect averages it over the ranks, one collective per log window
    return {"loss": loss_sum / accelerator.gradient_accumulation_steps, "grad_norm": grad_norm, "lr": lr}


def accumulate_gradients(model: torch.nn.Module, batches: Iterator, accelerator: Accelerator) -> torch.Tensor:
    """Forward/backward over this rank's micro-batches; gradients sync on the last one only.

    The summed (detached) micro-batch losses stay on the device: reading them here would stall the GPU.
    """
    model.train()
    loss_sum = torch.zeros((), device=accelerator.device)
    for _ in range(accelerator.gradient_accumulation_steps):
        x, y = next(batches)
        with accelerator.accumulate(model):
            _, loss = model(x, y, return_logits=False)
            accelerator.backward(loss)  # divides by gradient_accumulation_steps itself: no scaling here
        loss_sum += loss.detach()
    return loss_sum


def due(step: int, every: int, last: bool) -> bool:
    """A periodic action fires every `every` steps and on the last step; `every == 0` turns it off."""
    return every > 0 and (step % every == 0 or last)


# ---------------------------------------------------------------------------------------------- build


def build_accelerator(cfg: TrainConfig) -> Accelerator:
    accelerator = make_accelerator(
        log_with=resolve_trackers(cfg.log_with),
        project_config=ProjectConfiguration(project_dir=cfg.out_dir, logging_dir=str(Path(cfg.out_dir) / "logs")),
        # The schedule is a function of the optimizer step; a prepared scheduler would otherwise step
        # once per process per optimizer step (FACTS.md).
        step_scheduler_with_optimizer=False,
        # The training stream is endless: syncing at the "end of the dataloader" must never trigger.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )
    accelerator.gradient_accumulation_steps = cfg.grad_accum_steps(accelerator.num_processes)
    # Log lines go above the progress bar; accelerate's own INFO lines (8 per save_state) stay quiet, ours show.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", handlers=[TqdmHandler()])
    logging.getLogger("accel_gpt").setLevel(logging.INFO)
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (TF32)
        torch.backends.cudnn.allow_tf32 = True
    return accelerator


class TqdmHandler(logging.Handler):
    """Log lines go above the progress bar (tqdm.write) instead of being glued to the end of it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def build_model(cfg: TrainConfig) -> GPT:
    gpt_config = GPTConfig(**{name: getattr(cfg, name) for name in MODEL_FIELDS})
    if cfg.init_from == "none":
        model = GPT(gpt_config)
    else:
        from accel_gpt.hf import load_transformers_gpt2

        model = load_transformers_gpt2(cfg.init_from, vocab_size=cfg.vocab_size)
        for name in MODEL_FIELDS:
            if getattr(model.config, name) != getattr(gpt_config, name):
                raise ConfigError(
                    f"init_from {cfg.init_from} has {name}={getattr(model.config, name)} but the config says "
                    f"{getattr(gpt_config, name)}; set --{name} {getattr(model.config, name)}"
                )
    model.activation_checkpointing = cfg.activation_checkpointing
    return model


def build_dataloaders(
    cfg: TrainConfig, accelerator: Accelerator
) -> tuple[DataLoader, WindowSampler, DataLoader | None, dict]:
    """Training stream and fixed validation windows; the manifest is checked against the model first."""
    checksums = accelerator.is_local_main_process  # one reader per node hashes; every rank checks sizes
    train_ds = train_windows(cfg.data_dir, cfg.seq_len, checksums=checksums)
    check_vocab(train_ds.manifest, cfg.vocab_size, cfg.data_dir)
    sampler = WindowSampler(len(train_ds), cfg.seed)
    loader_kwargs = dict(
        batch_size=cfg.micro_batch_size,
        num_workers=cfg.num_workers,
        pin_memory=accelerator.device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    train_dl = DataLoader(train_ds, sampler=sampler, drop_last=True, **loader_kwargs)
    val_dl = None
    if cfg.eval_every > 0:
        if "val" not in train_ds.manifest["splits"]:
            raise ConfigError(
                f"eval_every={cfg.eval_every} but {cfg.data_dir} has no 'val' shards; "
                "prepare with --val_tokens N or set --eval_every 0"
            )
        val_ds = val_windows(cfg.data_dir, cfg.seq_len, cfg.eval_steps * cfg.micro_batch_size, checksums=checksums)
        val_dl = DataLoader(val_ds, shuffle=False, **loader_kwargs)
    return train_dl, sampler, val_dl, train_ds.manifest


def build(cfg: TrainConfig, accelerator: Accelerator) -> Run:
    set_seed(cfg.seed)  # the same initial weights on every rank and for any W
    train_dl, sampler, val_dl, manifest = build_dataloaders(cfg, accelerator)
    model = build_model(cfg)
    flops_per_token = model.flops_per_token()
    model_meta = {"model": model.config.to_dict(), "tokenizer": tokenizer_meta(manifest)}
    optimizer = make_optimizer(model, cfg, accelerator.device.type)
    scheduler = make_scheduler(optimizer, cfg)
    if val_dl is None:
        model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    else:
        model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(
            model, optimizer, train_dl, val_dl, scheduler
        )
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)  # in place: state_dict keys stay those of the uncompiled model
    examples = None
    if cfg.hellaswag_every > 0:
        from accel_gpt.evaluate.hellaswag import load_hellaswag

        examples = load_hellaswag(cfg.hellaswag, limit=cfg.hellaswag_limit or None)
    tokenizer = tokenizer_from_meta(model_meta["tokenizer"]) if cfg.sample_tokens and val_dl is not None else None
    return Run(model, optimizer, scheduler, train_dl, sampler, val_dl, examples, model_meta, flops_per_token, tokenizer)


def resume(cfg: TrainConfig, accelerator: Accelerator, state: TrainState, metrics: MetricsFile) -> None:
    """Restore the checkpoint `cfg.resume` names (or start at step 0), then drop the metrics rows after the step
    the run continues from: they are recomputed, and they include the rows of an attempt that crashed before its
    first checkpoint (an elastic restart with `resume: auto`), which would otherwise appear twice."""
    path = find_resume_checkpoint(cfg.resume, cfg.out_dir)
    if path is not None:
        load_checkpoint(accelerator, path, state, cfg.to_dict())
        state.config = cfg.to_dict()
    elif cfg.resume == "auto":
        logger.info("resume: auto found no complete checkpoint; starting from step 0")
    if accelerator.is_main_process:
        metrics.truncate_after(state.step)


def start_run(cfg: TrainConfig, accelerator: Accelerator) -> None:
    """Run directory and trackers, written once by the main process: the resolved config, and the
    `accelerate env` report (versions, devices, launch config) that a bug report needs."""
    if accelerator.is_main_process:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        (out / "accelerate_env.txt").write_text(accelerate_env_report())
    accelerator.init_trackers("accel_gpt", config=cfg.to_dict())
    accelerator.wait_for_everyone()


def accelerate_env_report() -> str:
    import argparse
    import contextlib
    import io

    from accelerate.commands.env import env_command

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        env_command(argparse.Namespace(config_file=None))
    return buffer.getvalue()


def describe(cfg: TrainConfig, accelerator: Accelerator, run: Run) -> str:
    n_params = sum(p.numel() for p in accelerator.unwrap_model(run.model).parameters())
    return (
        f"{n_params / 1e6:.2f}M parameters | {accelerator.num_processes} process(es) on {accelerator.device.type} "
        f"({accelerator.distributed_type}, mixed precision {accelerator.mixed_precision}) | "
        f"global batch {cfg.total_batch_size:,} tokens = {accelerator.num_processes} x "
        f"{accelerator.gradient_accumulation_steps} micro-steps x {cfg.micro_batch_size} x {cfg.seq_len}"
    )


# ----------------------------------------------------------------------------------- periodic actions


def evaluate(run: Run, accelerator: Accelerator, cfg: TrainConfig, state: TrainState) -> dict[str, Any]:
    from accel_gpt.evaluate.val_loss import evaluate_loss

    val_loss = evaluate_loss(run.model, run.val_dl, accelerator)
    state.last_val_loss = val_loss
    state.best_val_loss = min(state.best_val_loss, val_loss)
    row: dict[str, Any] = {"val_loss": val_loss}
    if run.tokenizer is not None:
        from accel_gpt.sample import sample_texts

        (text,) = sample_texts(
            run.model,
            run.tokenizer,
            cfg.sample_prompt,
            cfg.sample_tokens,
            temperature=1.0,
            top_k=50,
            seed=cfg.seed,
            device=accelerator.device,
            use_cache=not cfg.compile,
        )
        logger.info(f"sample at step {state.step}: {text!r}")
    return row


def hellaswag(run: Run, accelerator: Accelerator, cfg: TrainConfig) -> dict[str, Any]:
    from accel_gpt.evaluate.hellaswag import evaluate_hellaswag

    result = evaluate_hellaswag(run.model, accelerator, run.hellaswag, batch_size=cfg.micro_batch_size)
    return {"hellaswag_acc_norm": result["acc_norm"], "hellaswag_acc": result["acc"]}


def save_final(cfg: TrainConfig, accelerator: Accelerator, run: Run, state: TrainState) -> None:
    """Final weights in the run directory; every rank takes part in gathering them (FSDP)."""
    state_dict = accelerator.get_state_dict(run.model)
    if accelerator.is_main_process:
        save_state_dict(state_dict, run.model_meta, Path(cfg.out_dir), state.step)
        logger.info(f"final weights: {Path(cfg.out_dir) / 'model.safetensors'}")
    accelerator.wait_for_everyone()


# -------------------------------------------------------------------------------------------- logging


def summary(cfg: TrainConfig, state: TrainState, last_row: dict[str, Any], seconds: float) -> str:
    losses = f"final loss {last_row['loss']:.4f}" if last_row else "no step taken"
    if not math.isnan(state.last_val_loss):
        losses += f", last val_loss {state.last_val_loss:.4f}"
    return (
        f"finished at step {state.step}/{cfg.max_steps} in {seconds / 60:.1f} min, {state.tokens_seen:,} tokens seen; "
        f"{losses}; run dir {cfg.out_dir} (metrics.jsonl, config.yaml, checkpoints/, model.safetensors)"
    )


class LogWindow:
    """Steps since the last host sync. Their loss/grad-norm tensors are read in one go at `collect`, so the
    GPU runs ahead between logs; throughput is averaged over the window's wall time."""

    def __init__(self, cfg: TrainConfig, accelerator: Accelerator, run: Run, step: int) -> None:
        self.cfg = cfg
        self.accelerator = accelerator
        self.flops_per_token = run.flops_per_token
        self.peak = device_peak_flops(accelerator.device)
        self.rows: list[dict[str, Any]] = []
        self.last_row: dict[str, Any] = {}
        self.stop = torch.zeros((), device=accelerator.device)
        self.t0 = time.perf_counter()

    def add(self, row: dict[str, Any], stop_requested: bool) -> None:
        self.rows.append(row)
        if stop_requested:
            self.stop.fill_(1.0)

    def collect(self, step: int) -> tuple[list[dict[str, Any]], bool]:
        """Read the window's values from the device (one sync); also whether any rank asked to stop.

        One all-reduce per window sums the ranks' losses and stop flags together.
        """
        summed = self.accelerator.reduce(
            torch.cat([torch.stack([r["loss"] for r in self.rows]), self.stop[None]]), "sum"
        )
        losses, stop = summed[:-1] / self.accelerator.num_processes, summed[-1]
        grad_norms = torch.stack([r["grad_norm"].float() for r in self.rows])
        values = torch.stack([losses, grad_norms], dim=1).tolist()
        tokens_per_sec = len(self.rows) * self.cfg.total_batch_size / (time.perf_counter() - self.t0)
        flops_per_sec = tokens_per_sec * self.flops_per_token
        mfu = flops_per_sec / (self.peak * self.accelerator.num_processes) if self.peak else None
        first = step - len(self.rows) + 1
        rows = [
            {
                "step": first + i,
                "loss": loss,
                "lr": r["lr"],
                "grad_norm": grad_norm,
                "tokens_per_sec": tokens_per_sec,
                "mfu": mfu,
                "flops_per_sec": flops_per_sec,
            }
            for i, (r, (loss, grad_norm)) in enumerate(zip(self.rows, values, strict=True))
        ]
        self.rows = []
        return rows, stop.item() > 0

    def write(self, rows: list[dict[str, Any]], metrics: MetricsFile, progress: tqdm) -> None:
        """metrics.jsonl and trackers (main process), the progress bar; then the next window starts."""
        self.last_row = rows[-1]
        metrics.write(rows)
        for row in rows:
            self.accelerator.log({k: v for k, v in row.items() if v is not None and k != "step"}, step=row["step"])
        last = rows[-1]
        postfix = {"loss": f"{last['loss']:.4f}", "lr": f"{last['lr']:.2e}", "tok/s": f"{last['tokens_per_sec']:,.0f}"}
        if "val_loss" in last:
            postfix["val"] = f"{last['val_loss']:.4f}"
        progress.set_postfix(postfix, refresh=False)
        progress.update(len(rows))  # after the postfix: the bar shows this window's values, not the previous one's
        self.restart_clock()  # evaluation time stays out of the next window's throughput

    def restart_clock(self) -> None:
        self.t0 = time.perf_counter()


class StopSignal:
    """SIGTERM/SIGINT ask the loop to finish the current step, save a checkpoint and exit cleanly."""

    def __init__(self) -> None:
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
