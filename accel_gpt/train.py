"""`run.py train`: build, resume, then optimizer steps until `max_steps`, then the final weights.

`train()` only calls parts that own their cadence and state: the `MetricsLogger` (the one host sync per
`log_every` window), the `Evaluator` (validation loss, HellaSwag, samples), the `Checkpointer` (saving,
pruning, resuming) and the `StopSignal` (SIGTERM/SIGINT finish the current step and save). Devices, DDP
wrapping, mixed precision and gradient sync belong to Accelerate; this module never names a rank.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

from accel_gpt.checkpoint import Checkpointer, TrainState
from accel_gpt.config import MODEL_FIELDS, TrainConfig, save_yaml
from accel_gpt.data import shards
from accel_gpt.data.loader import WindowSampler, check_vocab, train_windows
from accel_gpt.errors import ConfigError
from accel_gpt.evaluate.evaluator import Evaluator
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.optim import make_optimizer, make_scheduler
from accel_gpt.runtime import StopSignal, make_accelerator
from accel_gpt.tracking import MetricsLogger, resolve_trackers, show_logs_above_progress_bar
from accel_gpt.weights import ModelCard, save_weights

logger = get_logger(__name__)


def train(cfg: TrainConfig) -> None:
    accelerator = build_accelerator(cfg)
    run = build(cfg, accelerator)
    state = TrainState(config=cfg.to_dict())
    checkpointer = Checkpointer(cfg, accelerator, run.card, state)
    checkpointer.resume(cfg.resume)
    evaluator = Evaluator(cfg, accelerator, run.model, run.card, run.splits)
    log = MetricsLogger(cfg, accelerator, run.flops_per_token, state.step)
    stop = StopSignal(accelerator)  # from here on, a signal finishes the current step and saves
    start_run(cfg, accelerator)
    batches = run.batches(state.data_position)  # the stream position follows from the step
    logger.info(describe(cfg, accelerator, run))
    while state.step < cfg.max_steps:
        log.add(train_step(run, batches, accelerator, cfg))
        state.advance(cfg)
        last, stopping = state.step == cfg.max_steps, stop.requested()
        saving, evals = checkpointer.due(state.step, last, stopping), {}
        if log.due(state.step, last) or evaluator.due(state.step, last) or saving or stopping:
            rows = log.collect(state.step)  # the one host sync; the window's clock stops here
            evals = evaluator.run(state.step, last)
            state.last_val_loss = evals.get("val_loss", state.last_val_loss)
            log.write(rows, evals)  # a save step writes its rows first: a resume keeps the rows up to it
        if saving:
            checkpointer.save(val_loss=evals.get("val_loss"))  # keep_best ranks a checkpoint by its own loss
            log.restart_clock()
        if stopping:
            saved = "resume with --resume auto" if cfg.save_every else "save_every=0, so no checkpoint was written"
            logger.info(f"stop requested: stopped after step {state.step}; {saved}")
            break
    stop.restore()
    if state.step == cfg.max_steps:
        save_final(cfg, accelerator, run, state)
    logger.info(log.summary(state.step, cfg.max_steps, state.tokens_seen, state.last_val_loss, cfg.out_dir))
    accelerator.end_training()


def train_step(run: Run, batches: Iterator, accelerator: Accelerator, cfg: TrainConfig) -> dict[str, Any]:
    """One optimizer step: accumulate over micro-steps, clip, update. Returns device tensors (no host sync)."""
    loss_sum = accumulate_gradients(run.model, batches, accelerator)
    lr = run.scheduler.get_last_lr()[0]  # the rate this update uses
    # The norm of the mean gradient over the whole global batch: DDP has already averaged the ranks' gradients.
    grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), cfg.grad_clip or math.inf)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
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


# ---------------------------------------------------------------------------------------------- build


@dataclass
class Run:
    """What `build` prepares: the objects the loop drives."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_dl: DataLoader
    sampler: WindowSampler
    card: ModelCard  # model shape + tokenizer, written beside every saved set of weights
    splits: list[str]
    flops_per_token: int

    def batches(self, position: int) -> Iterator:
        """The training stream from window `position` on (O(1): nothing before it is read)."""
        self.sampler.start = position
        return iter(self.train_dl)


def build_accelerator(cfg: TrainConfig) -> Accelerator:
    accelerator = make_accelerator(
        cfg.grad_accum_steps,
        log_with=resolve_trackers(cfg.log_with),
        project_config=ProjectConfiguration(project_dir=cfg.out_dir, logging_dir=str(Path(cfg.out_dir) / "logs")),
        # The schedule is a function of the optimizer step; a prepared scheduler would otherwise step
        # once per process per optimizer step.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )
    show_logs_above_progress_bar()
    return accelerator


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


def build(cfg: TrainConfig, accelerator: Accelerator) -> Run:
    """Data (checked against the model), model, optimizer and schedule, all through `accelerator.prepare`."""
    set_seed(cfg.seed)  # the same initial weights on every rank and for any W
    # one reader per node hashes the shards; every rank checks their sizes
    train_ds = train_windows(cfg.data_dir, cfg.seq_len, checksums=accelerator.is_local_main_process)
    check_vocab(train_ds.manifest, cfg.vocab_size, cfg.data_dir)
    sampler = WindowSampler(len(train_ds), cfg.seed)
    train_dl = DataLoader(
        train_ds,
        sampler=sampler,
        batch_size=cfg.micro_batch_size,
        drop_last=True,
        num_workers=cfg.num_workers,
        pin_memory=accelerator.device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    model = build_model(cfg)
    card = ModelCard(model.config, shards.tokenizer(train_ds.manifest))
    flops_per_token = model.flops_per_token()
    optimizer = make_optimizer(model, cfg, accelerator.device.type)
    scheduler = make_scheduler(optimizer, cfg)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)  # in place: state_dict keys stay those of the uncompiled model
    splits = list(train_ds.manifest["splits"])
    return Run(model, optimizer, scheduler, train_dl, sampler, card, splits, flops_per_token)


def start_run(cfg: TrainConfig, accelerator: Accelerator) -> None:
    """The run directory's config.yaml and accelerate_env.txt (main process), and the trackers."""
    if accelerator.is_main_process:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out / "config.yaml")
        (out / "accelerate_env.txt").write_text(accelerate_env_report(accelerator))
    accelerator.init_trackers("accel_gpt", config=cfg.to_dict())
    accelerator.wait_for_everyone()


def accelerate_env_report(accelerator: Accelerator) -> str:
    """`accelerate env` (versions, devices, default config; what a bug report needs), then the state in use."""
    from accelerate.commands.env import env_command, env_command_parser

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        env_command(env_command_parser().parse_args([]))
    return f"{buffer.getvalue()}\n- state of this run:\n{accelerator.state}"


def describe(cfg: TrainConfig, accelerator: Accelerator, run: Run) -> str:
    n_params = sum(p.numel() for p in accelerator.unwrap_model(run.model).parameters())
    return (
        f"{n_params / 1e6:.2f}M parameters | {accelerator.num_processes} process(es) on {accelerator.device.type} "
        f"({accelerator.distributed_type}, mixed precision {accelerator.mixed_precision}) | "
        f"global batch {cfg.total_batch_size:,} tokens = {accelerator.num_processes} x "
        f"{accelerator.gradient_accumulation_steps} micro-steps x {cfg.micro_batch_size} x {cfg.seq_len}"
    )


def save_final(cfg: TrainConfig, accelerator: Accelerator, run: Run, state: TrainState) -> None:
    """Final weights in the run directory; every rank takes part in gathering them (FSDP)."""
    state_dict = accelerator.get_state_dict(run.model)
    if accelerator.is_main_process:
        card = ModelCard(run.card.model, run.card.tokenizer, state.step)
        save_weights(state_dict, card, Path(cfg.out_dir))
        logger.info(f"final weights: {Path(cfg.out_dir) / 'model.safetensors'}")
    accelerator.wait_for_everyone()
