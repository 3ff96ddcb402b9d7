"""What a training run needs in memory per process, estimated before it starts, against what the device has.

A run that cannot fit fails late and badly: on a CPU the kernel's out-of-memory killer ends it without a word, on a
GPU the first step fails after the whole start-up. So `build` estimates the need from the config before anything is
allocated, says it in the start-up line, and refuses in one line a run that cannot fit, naming the settings that
lower it. The summary line gives the measured peak beside the estimate.

The need per process:
- weights, gradients and optimizer state: 4 bytes per parameter each for fp32 weights and gradients (mixed
  precision keeps fp32 masters), 8 for AdamW's two moments, 4 for Muon's momentum; under FSDP a 1/W share;
  autocast's half-precision copy of the weights, 2 bytes per parameter;
- activations of one micro-batch: what autograd keeps per token and layer (`SAVED_BYTES_PER_WIDTH`), or with
  activation checkpointing the block inputs plus one block;
- the LM head: logits, their fp32 copy, the log-softmax and its gradient, over micro_batch_size x seq_len tokens
  (`loss_chunk` rows at a time when set), which for GPT-2's 50,304 ids is most of a small model's need;
- on a CPU, the freed buffers glibc keeps (`allocator.keep_freed_memory`): a step's transient buffers, the logits'
  copies first, are kept for reuse and not all fit the next requests, so the resident peak runs over what is alive
  at once by a share of the activations measured per block (`KEPT_PER_ACTIVATION`).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from accel_gpt.allocator import keeps_freed_memory
from accel_gpt.config import TrainConfig
from accel_gpt.errors import ConfigError
from accel_gpt.limits import cgroup_memory_room, rlimit_memory_room
from accel_gpt.model import CPU_FP32_ATTENTION_MAX_T

logger = get_logger(__name__)

# Bytes autograd keeps per token and layer, in widths of the residual stream (n_embd), by block and for fp32 or
# half-precision autocast: measured with saved-tensor hooks (tests/test_memory.py measures them again). Under
# autocast the norms' outputs and the residual stream stay fp32, so half precision saves less than half.
SAVED_BYTES_PER_WIDTH = {("gpt2", False): 65, ("gpt2", True): 61, ("nanochat", False): 57, ("nanochat", True): 74}
# Under bf16 on a CPU, attention over up to CPU_FP32_ATTENTION_MAX_T positions runs in fp32 (model.attend), which keeps
# its inputs and output in fp32: 9.5 more bytes per width under GPT-2's block, 9.4 under nanochat's (measured alike).
CPU_FP32_ATTENTION_BYTES_PER_WIDTH = 9.5
# Freed buffers glibc keeps on a CPU (`keep_freed_memory`), per byte of activations, by block: the resident peak over
# the tensors alive at once. Measured on tiny-cpu's shape over 1 to 32 sequences per micro-batch (bench/RESULTS.md,
# "Memory"): the peak ran 1.3-2.6x the activations over the states under GPT-2's block, 1.7-2.4x under nanochat's,
# whose soft-capped logits make more transient copies, and more beside other busy processes; with glibc's defaults
# (buffers returned) it stayed under the estimate without them. A GPU's caching allocator is counted by torch itself.
KEPT_PER_ACTIVATION = {"gpt2": 0.8, "nanochat": 1.1}
# What a CPU run must have free over its estimate: the spread of the kept share between identical runs (+-20%).
CPU_RESIDENT_FACTOR = 1.25
# What every CPU run holds beside its model's tensors and the kept buffers: the evaluation's, the sample's and the
# checkpoint's own buffers, the tokenizer, Python's and torch's bookkeeping. Measured on the quick start (tiny-cpu on
# its BPE data, 4 sequences a micro-batch): a peak of 91-118 MB against 74 MB estimated without it, over 5 to 2,000
# steps; at 16 sequences 261-298 MB against 267 (bench/RESULTS.md, "Memory").
CPU_RUNTIME_BYTES = 40_000_000
# fp32 tensors over the logits that the loss keeps alive at its peak (log-softmax, its gradient, the logits' fp32
# copy), and one more where the soft-cap's tanh is kept.
LOGIT_COPIES = 3


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes per process."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    kept: int = 0  # freed buffers the allocator keeps (CPU)
    runtime: int = 0  # what every run holds beside its tensors (CPU: `CPU_RUNTIME_BYTES`)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kept + self.runtime

    def describe(self) -> str:
        parts = ("weights", "gradients", "optimizer", "activations")
        parts += tuple(extra for extra in ("kept", "runtime") if getattr(self, extra))
        names = {"kept": "freed buffers kept"}
        said = ", ".join(f"{names.get(p, p)} {gb(getattr(self, p))}" for p in parts)
        return f"about {gb(self.total)} per process ({said})"


def estimate(
    cfg: TrainConfig,
    params: int,
    muon_params: int,
    processes: int,
    fsdp: bool,
    half: bool,
    kept: bool = False,
    cpu: bool = False,
) -> MemoryNeed:
    """The need of `cfg` with `params` parameters (`muon_params` of them Muon's), on one of `processes` processes
    (FSDP shards the states over them); `half`: bf16/fp16 autocast; `kept`: a CPU whose allocator keeps freed
    buffers; `cpu`: counted from the process's resident memory, its own buffers included."""
    share = processes if fsdp else 1
    weights = 4 * params // share + (2 * params if half else 0)
    optimizer = (4 * muon_params + 8 * (params - muon_params)) if cfg.optimizer == "muon" else 8 * params
    activations = activation_bytes(cfg, half, cpu)
    held = int(KEPT_PER_ACTIVATION[cfg.arch] * activations) if kept else 0
    return MemoryNeed(weights, 4 * params // share, optimizer // share, activations, held, CPU_RUNTIME_BYTES * cpu)


def activation_bytes(cfg: TrainConfig, half: bool, cpu: bool = False) -> int:
    """One micro-batch's activations kept for backward, and the LM head's logits at the loss's peak."""
    tokens, width = cfg.micro_batch_size * cfg.seq_len, cfg.n_embd
    element = 2 if half else 4
    saved = SAVED_BYTES_PER_WIDTH[cfg.arch, half]
    if half and cpu and cfg.mixed_precision == "bf16" and cfg.seq_len <= CPU_FP32_ATTENTION_MAX_T:
        saved += CPU_FP32_ATTENTION_BYTES_PER_WIDTH
    per_layer = int(saved * width)
    if cfg.activation_checkpointing:  # each block's input (the fp32 residual stream), and one block recomputed
        blocks = tokens * (cfg.n_layer * width * 4 + per_layer)
    else:
        blocks = tokens * cfg.n_layer * per_layer
    rows = min(tokens, cfg.loss_chunk) if cfg.loss_chunk else tokens
    copies = LOGIT_COPIES + (1 if cfg.arch == "nanochat" and cfg.logit_softcap else 0)
    logits = rows * cfg.vocab_size * (element + 4 * copies)
    return blocks + logits


def available(device: torch.device, local_processes: int) -> tuple[int | None, str]:
    """Bytes this process may use, and the limit that sets it: the GPU's free memory, or the machine's available
    memory (within its cgroups' limits) shared by the processes on it, and within its own ulimit (`limits.py`).
    None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], "free on the GPU"
    if device.type != "cpu":
        return None, ""
    # the process's own ulimit is its alone; the machine's and the cgroup's room is shared by the local processes
    share = f"shared by its {local_processes} processes on this machine" if local_processes > 1 else ""
    rooms = {
        "the machine's available memory": _meminfo_available(),
        "its cgroup's memory limit (a container's or a job's)": cgroup_memory_room(),
    }
    limits = {name: size // max(1, local_processes) for name, size in rooms.items() if size is not None}
    limits = {(f"{name}, {share}" if share else name): size for name, size in limits.items()}
    if (size := rlimit_memory_room()) is not None:
        limits["its ulimit (ulimit -v or -d)"] = size
    if not limits:
        return None, ""
    name = min(limits, key=limits.__getitem__)
    return limits[name], name


def check_fits(
    need: MemoryNeed, room: int | None, cfg: TrainConfig, device: torch.device, limit: str = "its free memory"
) -> None:
    """Refuse a run whose need is over what the device has, in one line naming what lowers it. On a GPU the
    estimate is not yet checked against a measured peak (torch.compile fuses the loss and keeps fewer
    activations), so there it is a warning: the first step's out-of-memory error would follow within seconds."""
    factor = CPU_RESIDENT_FACTOR if device.type == "cpu" else 1.0
    if room is None or need.total * factor <= room or not cfg.check_memory:
        return
    if device.type == "cuda":
        logger.warning(
            f"this run may not fit: {need.describe()} against {gb(room)} free on the GPU; if its first step runs out "
            "of memory, lower micro_batch_size or set --activation_checkpointing true or --loss_chunk 4096"
        )
        return
    lower = [f"micro_batch_size (now {cfg.micro_batch_size}: activations scale with it)"]
    if not cfg.activation_checkpointing:
        lower.append("--activation_checkpointing true")
    if not cfg.loss_chunk:
        lower.append("--loss_chunk 4096 (the logits a chunk at a time)")
    lower.append("the model's shape (n_layer, n_embd)")
    resident = f", {factor}x that resident on a CPU" if factor != 1.0 else ""
    raise ConfigError(
        f"this run needs {need.describe()}{resident}, but each process may use {gb(room)} ({limit}): "
        f"lower {', '.join(lower)}; or --check_memory false to try anyway"
    )


def gb(size: int) -> str:
    return f"{size / 1e9:,.1f} GB" if size >= 1e9 else f"{size / 1e6:,.0f} MB"


class PeakMemory:
    """The peak memory of training, from the moment it is created: on a GPU torch's allocator peak, on a CPU the
    growth of the process's peak resident memory over its size then (torch's own libraries are not the run's): the
    growth of its resident file pages (RssFile: library code first touched by the first steps, 0.25 GB for tiny-cpu)
    is left out too."""

    def __init__(self, device: torch.device) -> None:
        import torch._dynamo  # noqa: F401  (the first optimizer imports it anyway: 75 MB of code, not the run's)

        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.start, self.start_files = _resident(), _file_pages()

    def bytes(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.device.type != "cpu" or self.start is None:
            return None
        returned = max(0, (_file_pages() or 0) - (self.start_files or 0)) if self.start_files is not None else 0
        return max(0, _peak_resident() - self.start - returned)


def _resident() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _peak_resident() -> int:
    """This process's peak resident memory since it began its program (VmHWM). Not `ru_maxrss`: Linux carries into it
    the peak of the parent that forked the process before its exec, so a run started from a large process (a test
    runner, a notebook) would report that process's size as its own peak (measured: 1.3 GB for a 0.64 GB run)."""
    peak = _proc_kilobytes("/proc/self/status", "VmHWM:")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _file_pages() -> int | None:
    """The process's resident file-backed pages, in bytes."""
    return _proc_kilobytes("/proc/self/status", "RssFile:")


def _meminfo_available() -> int | None:
    return _proc_kilobytes("/proc/meminfo", "MemAvailable:")


def _proc_kilobytes(path: str, key: str) -> int | None:
    """The `key: N kB` line of a /proc file, in bytes; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class MemoryBudget:
    """A run's estimated need, the room it had, and its measured peak: what the start-up and summary lines say."""

    need: MemoryNeed
    room: int | None
    peak: PeakMemory

    def line(self) -> str:
        return f"memory {self.need.describe()}" + (f" of {gb(self.room)} free" if self.room is not None else "")

    def measured(self) -> str:
        peak = self.peak.bytes()
        said = f"peak memory {gb(peak)}" if peak is not None else "peak memory unknown"
        return f"{said} (estimated {gb(self.need.total)})"


def budget(cfg: TrainConfig, accelerator: Accelerator) -> MemoryBudget:
    """Estimate the need of `cfg` under `accelerator`'s launch from the config alone, and refuse it where it cannot
    fit (see `check_fits`): before the model exists, which for a shape far too large would itself take minutes."""
    room, limit = available(accelerator.device, local_processes(accelerator))
    peak = PeakMemory(accelerator.device)
    params, matrices = parameter_counts(cfg)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    half = accelerator.mixed_precision in ("bf16", "fp16")
    kept = accelerator.device.type == "cpu" and keeps_freed_memory()
    muon = matrices if cfg.optimizer == "muon" else 0
    cpu = accelerator.device.type == "cpu"
    need = estimate(cfg, params, muon, accelerator.num_processes, fsdp, half, kept, cpu)
    check_fits(need, room, cfg, accelerator.device, limit)
    return MemoryBudget(need, room, peak)


def parameter_counts(cfg: TrainConfig) -> tuple[int, int]:
    """The model's parameters, and how many of them are the blocks' matrices (Muon's), from the config's shape:
    what `GPT(cfg)` would hold (tests compare), without building it."""
    C, V = cfg.n_embd, cfg.vocab_size
    if cfg.arch == "nanochat":
        kv = (cfg.n_kv_head or cfg.n_head) * (C // cfg.n_head) * C  # c_k and c_v each
        matrices = cfg.n_layer * (2 * C * C + 2 * kv + 8 * C * C)
        return 2 * V * C + matrices, matrices  # an untied head; the norms have no parameters
    matrices = cfg.n_layer * 12 * C * C
    norms = (2 * cfg.n_layer + 1) * C * (2 if cfg.bias else 1)
    biases = cfg.n_layer * 9 * C if cfg.bias else 0
    return V * C + cfg.seq_len * C + matrices + norms + biases, matrices


def local_processes(accelerator: Accelerator) -> int:
    """The processes of this run on this machine, which share its memory (a GPU each has its own)."""
    if accelerator.device.type == "cuda":
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
