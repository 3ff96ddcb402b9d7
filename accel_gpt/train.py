"""`run.py train`: build, resume, then optimizer steps until `max_steps`, then the final weights.

`train()` only calls parts that own their cadence and state: the `RunDir` (the folder's checks before anything
is built, then its lock for the whole run), the `MetricsLogger` (the one host sync per `log_every` window, where a
non-finite loss stops the run), the `Evaluator` (validation loss, HellaSwag, samples), the `Checkpointer`
(saving, pruning, resuming) and the `StopSignal` (SIGTERM/SIGINT/SIGHUP, or the launcher's death, finish the current
step and save). Devices, DDP wrapping, mixed precision and gradient sync belong to Accelerate; this module never
names a rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    ProjectConfiguration,
    set_seed,
)
from torch.utils.data import DataLoader

from accel_gpt.budget import TimeBudget
from accel_gpt.checkpoint import (
    Checkpointer,
    TrainState,
    best_checkpoint,
    complete_checkpoints,
    data_identity,
    tokenizer_mismatch,
)
from accel_gpt.choices import RunChoices, apply_threads, choose_compiling, choose_precision, resumed_config
from accel_gpt.config import MODEL_FIELDS, TrainConfig, pad_vocab
from accel_gpt.data import shards
from accel_gpt.data.loader import WindowSampler, check_vocab, train_windows
from accel_gpt.errors import ConfigError, DataError, UserError
from accel_gpt.evaluate.evaluator import Evaluator
from accel_gpt.files import tensor_bytes, write_failure
from accel_gpt.limits import check_file_size, check_open_files
from accel_gpt.memory import MemoryBudget, budget, parameter_counts
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.optim import make_optimizer, make_scheduler
from accel_gpt.precision import Capability, Choice, detect, newton_schulz_precision
from accel_gpt.rundir import RunDir, same_on_every_rank
from accel_gpt.runtime import StopSignal, make_accelerator, use_attention_backend
from accel_gpt.shared_storage import check_shared_out_dir
from accel_gpt.spike import SpikeGuard, check_can_skip, optimizer_step
from accel_gpt.tokenizer import Tokenizer
from accel_gpt.tracking import MetricsLogger, resolve_trackers, show_logs_above_progress_bar
from accel_gpt.weights import (
    CHECKPOINTS,
    MODEL_CONFIG,
    WEIGHTS,
    ModelCard,
    load_model,
    load_weights,
    read_model_config,
    save_weights,
)

logger = get_logger(__name__)


def train(cfg: TrainConfig) -> None:
    run_dir = RunDir(cfg)  # checks out_dir on every rank; nothing is written before run_dir.start
    resumed = resumed_config(cfg)  # a resume keeps what its checkpoint chose where the settings leave it to auto
    accelerator, precision = build_accelerator(cfg, resumed)
    check_shared_out_dir(cfg.out_dir, accelerator)  # every process must see the one folder that checkpoints go to
    run = build(cfg, accelerator, RunChoices(precision), resumed)
    state = TrainState(config=cfg.to_dict(), data=run.data, spike=run.guard, num_processes=accelerator.num_processes)
    state.budget = run.budget
    checkpointer = Checkpointer(cfg, accelerator, run.card, state, run.model, run.optimizer)
    checkpointer.resume(cfg.resume)
    run.scheduler.scheduler.refresh()  # a resumed time budget (restored after the schedule) moves its horizon
    evaluator = Evaluator(cfg, accelerator, run.model, run.card, run.splits)
    with run_dir.start(accelerator, state.run), StopSignal(accelerator) as stop:  # the lock, held until the run ends
        checkpointer.retire_later_line()  # resumed by path: the old line's later checkpoints are moved aside
        horizon = run.budget.horizon if run.budget.on else None  # the bar's total and ETA follow a budget
        schedule, vocab = run.scheduler.scheduler, run.card.tokenizer.vocab_size
        log = MetricsLogger(cfg, accelerator, run.flops_per_token, state.step, vocab, schedule.warmup, horizon)
        batches = run.batches(state.data_position)  # the stream position follows from the step
        logger.info(describe(cfg, accelerator, run))
        while state.step < cfg.max_steps and not run.budget.done:
            run.budget.begin_step()
            log.add(train_step(run, batches, accelerator, cfg))
            state.advance(cfg)
            run.budget.end_step(state.step)
            last, stopping = state.step == cfg.max_steps or run.budget.done, stop.requested()
            saving, evals = checkpointer.due(state.step, last, stopping), {}
            if log.due(state.step, last) or evaluator.due(state.step, last) or saving or stopping:
                rows = log.collect(state.step)  # the one host sync; raises on a non-finite loss, before any save
                evals = evaluator.run(state.step, last)
                state.last_val_loss = evals.get("val_loss", state.last_val_loss)
                log.write(rows, evals)  # a save step writes its rows first: a resume keeps the rows up to it
            if saving:
                checkpointer.save(val_loss=evals.get("val_loss"))  # keep_best ranks a checkpoint by its own loss
                log.restart_clock()
            if stopping:
                logger.info(f"stop requested: stopped after step {state.step}; {stop_hint(cfg)}")
                break
        finished = state.step == cfg.max_steps or run.budget.done
        weights = save_final(cfg, accelerator, run, state) if finished else None
        pauses = [t.describe() for t in (evaluator.tally, checkpointer.tally) if t.count]  # what each one costs
        budget = [run.budget.summary()] if run.budget.on else []
        logger.info("; ".join([log.summary(state, cfg, weights), run.memory.measured(), *pauses, *budget]))
        accelerator.end_training()


def largest_saved_file(cfg: TrainConfig) -> tuple[int, str]:
    """About the bytes of the largest file a run writes: a checkpoint's optimizer.bin (AdamW's two fp32 moments of
    every parameter; Muon's one momentum of the matrices and AdamW's of the rest), or the fp32 weights."""
    params, matrices = parameter_counts(cfg)
    moments = 2 * params if cfg.optimizer == "adamw" else matrices + 2 * (params - matrices)
    if cfg.save_every and moments > params:
        return 4 * moments, "a checkpoint's optimizer.bin"
    return 4 * params, "model.safetensors"


def stop_hint(cfg: TrainConfig) -> str:
    return "resume with --resume auto" if cfg.save_every else "save_every=0, so no checkpoint was written"


def train_step(run: Run, batches: Iterator, accelerator: Accelerator, cfg: TrainConfig) -> dict[str, Any]:
    """One optimizer step: accumulate over micro-steps, clip, update unless the spike guard skips it (the schedule
    advances either way) or with the gradient it scaled down. Returns device tensors (no host sync)."""
    loss = accumulate_gradients(run.model, batches, accelerator) / accelerator.gradient_accumulation_steps
    lr = run.scheduler.get_last_lr()[0]  # the rate this update uses
    # The norm of the mean gradient over the whole global batch: DDP has already averaged the ranks' gradients.
    grad_norm = accelerator.clip_grad_norm_(run.params, cfg.grad_clip or math.inf)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns the norm as a replicated DTensor: its plain value
        grad_norm = grad_norm.full_tensor()
    row = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
    if run.guard is not None:
        # The same decisions on every rank: the global batch's loss (a device all-reduce, not a host sync) and norm.
        mean_loss = accelerator.reduce(loss, "mean")
        row["skipped"], row["clipped"] = run.guard.apply(mean_loss, grad_norm, run.params, cfg.grad_clip)
    optimizer_step(run.optimizer, row.get("skipped"))
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return row


def accumulate_gradients(model: torch.nn.Module, batches: Iterator, accelerator: Accelerator) -> torch.Tensor:
    """Forward/backward over this rank's micro-batches; gradients sync on the last one only.

    The summed (detached) micro-batch losses stay on the device: reading them here would stall the GPU.
    """
    if not model.training:  # evaluations put the mode back; model.train() itself walks every module (0.5 ms)
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
    data: dict[str, Any]  # `checkpoint.data_identity`: what a resume must train on
    memory: MemoryBudget  # the estimate said at start-up, and the measured peak said at the end
    guard: SpikeGuard | None = None  # the loss-spike guard, when on
    capability: Capability | None = None  # the device's class: what it computes fast
    budget: TimeBudget = field(default_factory=lambda: TimeBudget(None, torch.device("cpu"), 1))  # --time_budget
    choices: RunChoices | None = None  # precision, compile and threads, as resolved, with why

    def __post_init__(self) -> None:
        # The prepared model's parameters, listed once: walking the modules for them at every step's clip costs more
        # than the clip's own norm on a small model.
        self.params = list(self.model.parameters())

    def batches(self, position: int) -> Iterator:
        """The training stream from window `position` on (O(1): nothing before it is read)."""
        self.sampler.start = position
        return iter(self.train_dl)


def build_accelerator(cfg: TrainConfig, resumed: dict[str, Any]) -> tuple[Accelerator, Choice]:
    """The run's Accelerator, and its mixed precision with the reason. A `mixed_precision` other than auto replaces
    the launch's, so that a launcher without an Accelerate config (plain torchrun, SLURM's srun) can train in bf16;
    auto takes the launch's, else what this device does fast (`choices.choose_precision`)."""
    given = cfg.mixed_precision
    chosen: list[Choice] = []

    def precision(capability: Capability) -> str:
        chosen.append(choose_precision(cfg, capability, resumed))
        return cfg.mixed_precision

    accelerator = make_accelerator(
        cfg.grad_accum_steps,
        precision=precision,
        keep_memory=True,
        timeout=timedelta(seconds=cfg.dist_timeout) if cfg.dist_timeout else None,
        log_with=resolve_trackers(cfg.log_with),
        project_config=ProjectConfiguration(project_dir=cfg.out_dir, logging_dir=str(Path(cfg.out_dir) / "logs")),
        # The schedule is a function of the optimizer step; a prepared scheduler would otherwise step
        # once per process per optimizer step.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if given != "auto" and launched not in (None, cfg.mixed_precision):
        logger.warning(f"mixed_precision {cfg.mixed_precision} (train setting) replaces the launch's {launched}")
    use_attention_backend(cfg.attention_backend, accelerator.device)
    show_logs_above_progress_bar()
    return accelerator, chosen[0]


def build_model(cfg: TrainConfig, tokenizer: Tokenizer) -> GPT:
    """A fresh GPT, or the weights `init_from` names, checked against the config's shape and the data's tokenizer."""
    gpt_config = GPTConfig(**cfg.model_settings())
    if cfg.init_from == "none":
        model = GPT(gpt_config)
    else:
        loaded = load_init_from(cfg, tokenizer)
        for name in MODEL_FIELDS:
            if getattr(loaded.config, name) != getattr(gpt_config, name):
                raise ConfigError(
                    f"init_from {cfg.init_from} has {name}={getattr(loaded.config, name)} but the config says "
                    f"{getattr(gpt_config, name)}; set --{name} {str(getattr(loaded.config, name)).lower()}"
                )
        model = GPT(replace(loaded.config, dropout=cfg.dropout))  # this run's dropout, not the source's
        model.load_state_dict(loaded.state_dict())
    model.activation_checkpointing = cfg.activation_checkpointing
    model.loss_chunk = cfg.loss_chunk
    model.vocab_in_use = tokenizer.vocab_size  # at most vocab_size: `check_vocab` has seen to it
    return model


def load_init_from(cfg: TrainConfig, tokenizer: Tokenizer) -> GPT:
    """`init_from`: an accel_gpt run dir (its final weights, else its newest complete checkpoint) or checkpoint, or
    a transformers GPT-2 folder or hub id (its embedding padded to vocab_size). Weights trained with another
    tokenizer than the data's are refused: their token ids would mean other text."""
    source = Path(cfg.init_from)
    if not (source / MODEL_CONFIG).is_file() and not (source / CHECKPOINTS).is_dir():
        from accel_gpt.hf import folder_tokenizer, load_transformers

        theirs = folder_tokenizer(cfg.init_from)
        if "bpe" in (theirs.name, tokenizer.name) and theirs != tokenizer:
            raise ConfigError(f"init_from {source}: {tokenizer_mismatch(theirs, tokenizer)} in {cfg.data_dir}")
        logger.info(f"init_from: the transformers weights of {cfg.init_from}")
        return load_transformers(cfg.init_from, vocab_size=cfg.vocab_size, tokenizer_ids=tokenizer.vocab_size)
    model, card = load_model(source)  # a run dir without final weights: its newest checkpoint
    if card.tokenizer != tokenizer:
        raise ConfigError(f"init_from {source}: {tokenizer_mismatch(card.tokenizer, tokenizer)} in {cfg.data_dir}")
    logger.info(f"init_from: the weights of {source}, step {card.step}")
    return model


def build(cfg: TrainConfig, accelerator: Accelerator, choices: RunChoices, resumed: dict[str, Any]) -> Run:
    """Data (checked against the model), model, optimizer and schedule, all through `accelerator.prepare`."""
    if cfg.vocab_size is None:  # the manifest was unreadable when the config was read: size it now, or say why not
        cfg.vocab_size = pad_vocab(shards.read_manifest(cfg.data_dirs[0])["vocab_size"])
    choices.threads = apply_threads(accelerator.device)
    capability = detect(accelerator.device)
    choices.compile = choose_compiling(cfg, capability, accelerator.num_processes, resumed, choices.threads)
    memory = budget(cfg, accelerator)  # refuses a run that cannot fit, before anything large is allocated
    for note in cfg.notes():
        logger.warning(note)
    set_seed(cfg.seed)  # the same initial weights on every rank and for any W
    # every rank checks the shards' sizes; one reader per node hashes those not verified as they are now
    checksums = accelerator.is_local_main_process
    train_ds = train_windows(cfg.data_dirs, cfg.seq_len, checksums=checksums, verify=cfg.verify_data)
    check_vocab(train_ds.manifest, cfg.vocab_size, cfg.data_dir)
    if accelerator.is_local_main_process:  # the manifest's record, or one read of the shards per node
        check_token_ids(cfg.data_dirs, [source.manifest for source in train_ds.sources], cfg.vocab_size)
    too_few_files = check_open_files(cfg.num_workers, accelerator.num_processes)
    if too_few_files:
        raise ConfigError(too_few_files)
    too_large = check_file_size(*largest_saved_file(cfg))
    if too_large:
        raise ConfigError(too_large)
    weights, per_step = cfg.source_weights(), cfg.windows_per_step
    sampler = WindowSampler(train_ds.sizes, cfg.seed, weights=weights, windows_per_step=per_step)
    train_dl = DataLoader(
        train_ds,
        sampler=sampler,
        batch_size=cfg.micro_batch_size,
        drop_last=True,
        num_workers=cfg.num_workers,
        pin_memory=accelerator.device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
        # Its own generator: each new iterator draws a seed from it, not from the global RNG, which dropout's masks
        # come from and a checkpoint restores (a resume creates the iterator after the restore, a run from 0 before).
        generator=torch.Generator(),
    )
    tokenizer = shards.tokenizer(train_ds.manifest, cfg.data_dirs[0])
    model = build_model(cfg, tokenizer)
    card = ModelCard(model.config, tokenizer)
    flops_per_token = model.flops_per_token()
    if cfg.optimizer == "muon" and accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError(
            "optimizer=muon cannot train under FSDP: torch.optim.Muon would orthogonalize each process's shard of a "
            "matrix, not the matrix; use a DDP launch (multi_gpu) or --optimizer adamw"
        )
    set_seed(cfg.seed, device_specific=True)  # from here each rank draws its own dropout masks
    newton_schulz = newton_schulz_precision(cfg.muon_ns_dtype, capability) if cfg.optimizer == "muon" else None
    if newton_schulz is not None and newton_schulz.warning:
        logger.warning(newton_schulz.warning)
    optimizer = make_optimizer(model, cfg, accelerator.device.type, newton_schulz)
    clock = TimeBudget(
        cfg.budget_seconds(), accelerator.device, accelerator.num_processes, cfg.warmup_steps or 0, cfg.max_steps
    )
    scheduler = make_scheduler(optimizer, cfg, clock.horizon)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    if cfg.compile:
        model.compile(mode=cfg.compile_mode)  # in place: state_dict keys stay those of the uncompiled model
    splits = train_ds.splits
    data = data_identity([source.manifest for source in train_ds.sources], cfg.source_weights())
    guard = None
    if cfg.spike_loss_zscore or cfg.spike_grad_zscore:
        check_can_skip(optimizer, accelerator.scaler)
        guard = SpikeGuard(cfg, accelerator.device)
    parts = (model, optimizer, scheduler, train_dl, sampler, card, splits, flops_per_token, data, memory)
    return Run(*parts, guard=guard, capability=capability, budget=clock, choices=choices)


def check_token_ids(data_dirs: list[str], manifests: list[dict[str, Any]], vocab_size: int) -> None:
    """Every token id must index the embedding and be one of the tokenizer's (the logits stop there): shards that
    agree with their manifest can still hold a larger id, which would crash an embedding lookup or the loss mid-run."""
    for data_dir, manifest in zip(data_dirs, manifests, strict=True):
        for split in manifest["splits"]:
            top = shards.max_token_id(data_dir, manifest, split)
            if top >= vocab_size:
                raise DataError(
                    f"the {split} shards in {data_dir} hold token id {top} but the model's vocab_size is "
                    f"{vocab_size}: ids must be below it; set vocab_size > {top} or prepare the data again"
                )
            if top >= manifest["vocab_size"]:
                raise DataError(
                    f"the {split} shards in {data_dir} hold token id {top}, which their tokenizer "
                    f"({manifest['tokenizer']}, {manifest['vocab_size']} ids) does not have: prepare the data again"
                )


def describe(cfg: TrainConfig, accelerator: Accelerator, run: Run) -> str:
    n_params = sum(p.numel() for p in accelerator.unwrap_model(run.model).parameters())
    optimizer = f"{cfg.arch} block | " + ("Muon + AdamW" if cfg.optimizer == "muon" else "AdamW")
    if cfg.optimizer == "muon":
        optimizer += f", {newton_schulz_line(run.optimizer)}"
    if cfg.dropout:
        optimizer += f", dropout {cfg.dropout}"
    return (
        f"{n_params / 1e6:.2f}M parameters | {accelerator.num_processes} process(es) on {accelerator.device.type}"
        f"{parallelism(accelerator)} | {accelerator.device.type} {run.capability.units} | {run.choices.describe()} | "
        f"global batch {cfg.total_batch_size:,} tokens = {accelerator.num_processes} process(es) x "
        f"{accelerator.gradient_accumulation_steps} micro-steps x {cfg.micro_batch_size} sequences x {cfg.seq_len} "
        f"tokens | {optimizer} | {run.memory.line()}"
    )


def parallelism(accelerator: Accelerator) -> str:
    """How the processes share the work, in words (Accelerate's DistributedType names mean little to a reader)."""
    kind = {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed"}.get(
        accelerator.distributed_type, "data parallel"
    )
    backend = getattr(accelerator.state, "backend", None)
    return "" if accelerator.num_processes == 1 else f" ({kind}" + (f" over {backend})" if backend else ")")


def newton_schulz_line(optimizer: torch.optim.Optimizer) -> str:
    """What Muon's Newton-Schulz runs in, and why (the start-up line)."""
    muon = getattr(optimizer, "optimizer", optimizer).muon  # Accelerate's wrapper holds the MuonAdamW
    if muon.fallback:
        instead = f" with its quintic, not {muon.coefficients}," if muon.coefficients != "quintic" else ""
        return f"Newton-Schulz in torch's bfloat16{instead} ({muon.fallback} that accel_gpt's step does not know)"
    steps, name = muon.param_groups[0]["ns_steps"], muon.coefficients
    return f"{muon.precision.describe()}, {steps} {name} iteration{'s' if steps > 1 else ''}"


def save_final(cfg: TrainConfig, accelerator: Accelerator, run: Run, state: TrainState) -> str:
    """Final weights in the run directory: the last step's, or with `final_weights best` those of the checkpoint
    with the lowest val loss (kept by its pruning). Every rank takes part (FSDP gathers). Returns what they are; a
    write that fails (a full disk, a folder gone read-only) stops every rank with one line."""
    best = best_checkpoint(cfg.out_dir) if cfg.final_weights == "best" else None
    best_step = read_model_config(best[0]).step if best is not None else None
    if best is not None and best_step != state.step:
        state_dict, card = None, None
        if accelerator.is_main_process:
            model, card = load_weights(best[0])
            state_dict = model.state_dict()
    else:
        state_dict = accelerator.get_state_dict(run.model)
        card = ModelCard(run.card.model, run.card.tokenizer, state.step, state.segments, run=state.run)
    what = f"the weights of step {state.step if best is None else best_step}"
    if best is not None:
        what += f", whose val_loss ({best[1]:.4f}) is the lowest of the run's evaluated checkpoints"
        if card is not None:
            card = replace(card, picked={"val_loss": best[1], "last_step": state.step})
    error = None
    if accelerator.is_main_process:
        write = partial(save_weights, state_dict, card, Path(cfg.out_dir))
        error = write_failure(Path(cfg.out_dir), write, tensor_bytes(state_dict.values()))
    error = same_on_every_rank(accelerator, error)
    if error is not None:
        raise UserError(f"cannot write the final weights {Path(cfg.out_dir) / WEIGHTS}: {error}; {final_hint(cfg)}")
    return f"{WEIGHTS} holds {what}"


def final_hint(cfg: TrainConfig) -> str:
    """What is left when the final weights could not be written, and what to do."""
    done = complete_checkpoints(cfg.out_dir)
    if not done:
        return "no checkpoint holds them (save_every 0), so they are lost: make room, then train again"
    return f"the newest checkpoint, {done[-1]}, is intact: make room, then run again with --resume auto to write them"
