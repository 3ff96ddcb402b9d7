"""The process side of a run: the Accelerator every command builds, and stop signals.

`make_accelerator` forms one process group of the size the launch asked for, on whatever devices the
launch gave (the Accelerate config decides; nothing here names a rank or a device). Under an FSDP launch it hands
Accelerate the launch's FSDP settings with one change, gradients reduced in fp32 (`fsdp_plugin`). Under torchrun's
elastic restarts it gives each attempt of the group a store namespace of its own (`ElasticLaunch`). The group is
freed at exit, before the interpreter's finalization (`release_group_at_exit`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before any group forms: see `release_group_at_exit`
from accelerate import Accelerator, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin, GradientAccumulationPlugin

from accel_gpt.allocator import keep_freed_memory
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.limits import check_open_files
from accel_gpt.precision import Capability, check_mixed_precision, detect
from accel_gpt.workarounds import (
    check_claims_can_hold,
    check_fsdp_can_run,
    check_group,
    cpu_only,
    forget_previous_precision,
)


def make_accelerator(
    accumulation: Callable[[int], int] | None = None,
    keep_memory: bool = False,
    timeout: timedelta | None = None,
    precision: Callable[[Capability], str] | None = None,
    **kwargs: Any,
) -> Accelerator:
    """An Accelerator on the launch's devices; `accumulation(world_size)` gives the micro-steps per optimizer step,
    and `precision(capability)` the mixed precision, once the device it runs on is known.

    Raises if the group is smaller than WORLD_SIZE. The training stream is endless, so gradients sync on
    the accumulation count alone, never at "the end of the dataloader". `timeout`: how long a collective waits for
    every rank before it fails (None: torch's defaults). The group is formed here, before the Accelerator, so
    Accelerate's `InitProcessGroupKwargs` would come too late for it.
    """
    cpu = cpu_only()
    check_fsdp_can_run(cpu)
    check_claims_can_hold(cpu, kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    if cpu and keep_memory:  # training's fixed shapes reuse the kept buffers; eval's varying ones fragment them
        keep_freed_memory()
    too_few_files = check_open_files(0, int(os.environ.get("WORLD_SIZE", "1")))
    if too_few_files:  # before the group forms: below the limit it would wait 15 minutes for ranks that cannot join
        raise UserError(too_few_files)
    launch = ElasticLaunch.from_env()
    group = launch.group_kwargs(timeout) if launch is not None and not dist.is_initialized() else {}
    if timeout is not None:
        group["timeout"] = timeout
    state = PartialState(cpu=cpu, **group)  # Accelerate hands `group` to init_process_group
    check_group(state)
    release_group_at_exit()
    if precision is not None:
        kwargs["mixed_precision"] = precision(detect(state.device))
        check_claims_can_hold(cpu, kwargs["mixed_precision"])
    fsdp = fsdp_plugin(kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    steps = accumulation(state.num_processes) if accumulation else 1
    plugin = GradientAccumulationPlugin(num_steps=steps, sync_with_dataloader=False)
    forget_previous_precision(kwargs.get("mixed_precision"))
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_plugin=plugin, fsdp_plugin=fsdp, **kwargs)
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (TF32)
        torch.backends.cudnn.allow_tf32 = True
    warnings = [check_mixed_precision(accelerator.mixed_precision, detect(accelerator.device))]
    warnings.append(launch.restart_warning() if launch is not None else None)
    for warning in filter(None, warnings):
        if accelerator.is_main_process:
            sys.stderr.write(f"warning: {warning}\n")
    return accelerator


_HELD_GROUPS: list[Any] = []  # the default group, held by `release_group_at_exit` until the exit handler drops it


def release_group_at_exit() -> None:
    """Free the default process group in an exit handler, while threads may still take the GIL.

    Left to the interpreter's finalization, the group's Gloo worker threads outlive the point where Python refuses
    them the GIL, and one still dropping a finished collective's tensors (freeing their Python objects needs it) is
    unwound inside a destructor: std::terminate, SIGABRT, and a finished run's launch fails now and then.

    The handler collects the finished command's objects (the DDP model and its reducer hold the group), so the
    reference kept here is the group's last: dropping it makes torch free the group with the GIL released, its
    workers finishing and joined (were the reducer's the last, it would be freed holding the GIL, waiting on a worker
    that waits for it). torch.distributed.nn.functional is imported before any group forms because its functions'
    `group=group.WORLD` defaults are evaluated at import, and DDP imports it: the group would be held for good.
    Under FSDP, DTensor's caches hold the group to the end, so the handler only lets go of the GIL for a moment,
    long enough for such a worker. A command stopped by an error left its group formed: a Gloo group is ended here
    too (ending it waits on no peer; ending NCCL's may, so that is left alone).
    """
    if _HELD_GROUPS or not dist.is_initialized():
        return
    _HELD_GROUPS.append(dist.group.WORLD)

    def release() -> None:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()  # a command that failed left it formed; Gloo's ending waits on no peer
        gc.collect()  # the finished command's models, their DDP reducers among them
        held_elsewhere = sys.getrefcount(_HELD_GROUPS[0]) > 2  # more than the list's reference and the argument
        _HELD_GROUPS.clear()
        if held_elsewhere:  # FSDP: DTensor's caches keep its meshes, and their groups, for the life of the process
            time.sleep(0.1)  # a worker still finishing a collective takes the GIL now, while it may

    atexit.register(release)


@dataclass(frozen=True)
class ElasticLaunch:
    """What torchrun's elastic agent tells each worker it starts, read from the worker's environment
    (torch/distributed/elastic/agent/server/local_elastic_agent.py, `_start_workers`).

    Why it matters: with `--max_restarts N` the agent replaces a failed group by a new one, whose ranks form their
    process group through a TCP store. Unless `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is set under c10d rendezvous,
    that store is the launcher's own (`shared_store`), which outlives every attempt: the static rendezvous (the
    accelerate configs' and accelerate's default) keeps one store for the launcher's whole life, and c10d (also
    `torchrun --standalone`) keeps the one it made at its first round. Gloo and NCCL publish each rank's address or
    communicator id there under fixed keys, so the dead group's entries are still in place when the new group
    starts: a rank that looks a peer up before the peer has written its new entry reads the dead process's (Gloo:
    `connectFullMesh failed ... Connection refused`; NCCL: it waits for a communicator that no longer exists).

    On one machine (one launcher: `machines == 1`), every worker of an attempt is told the same restart count and
    the count grows with each restart, so a key prefix per count gives each attempt a store of its own without
    anything from the user (`group_kwargs`). With several launchers the count is not shared: under c10d a launcher
    whose workers were healthy restarts them without counting it, so only a fresh store per attempt works there;
    c10d with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` makes one (the new group's rank 0 hosts it on a new port), which
    `restart_warning` asks for.
    """

    restart: int  # TORCHELASTIC_RESTART_COUNT: 0 for the first group, then one more per restart
    max_restarts: int  # TORCHELASTIC_MAX_RESTARTS: the launch's --max_restarts
    machines: int  # GROUP_WORLD_SIZE: launchers (one per machine) in this group
    shared_store: bool  # TORCHELASTIC_USE_AGENT_STORE: the workers meet in the launcher's store
    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ElasticLaunch | None:
        """The launch this process was started by, or None when torchrun's agent did not start it."""
        if "TORCHELASTIC_RUN_ID" not in env or "MASTER_PORT" not in env:
            return None
        return cls(
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            machines=int(env.get("GROUP_WORLD_SIZE", "1")),
            shared_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env["MASTER_PORT"]),
        )

    @property
    def own_namespace(self) -> bool:
        """Whether this group forms in a namespace of its own in the launcher's store (see the class)."""
        return self.shared_store and self.machines == 1 and self.max_restarts > 0 and self.world_size > 1

    def group_kwargs(self, timeout: timedelta | None = None) -> dict[str, Any]:
        """`init_process_group` arguments: the launcher's store under this attempt's prefix; {} for torch's own
        `env://` rendezvous, which is right when there are no restarts or the store is new for each attempt."""
        if not self.own_namespace:
            return {}
        from torch.distributed.constants import default_pg_timeout

        store = dist.TCPStore(  # a client, as env:// makes it: the launcher hosts this store
            self.master_addr, self.master_port, self.world_size, is_master=False, timeout=timeout or default_pg_timeout
        )
        prefixed = dist.PrefixStore(f"accel_gpt/attempt_{self.restart}", store)  # keys become PREFIX/key
        return {"store": prefixed, "rank": self.rank, "world_size": self.world_size}

    def restart_warning(self) -> str | None:
        """One line when this launch can restart its group but the group meets in a store that outlives it."""
        if not (self.shared_store and self.machines > 1 and self.max_restarts > 0):
            return None
        return (
            f"max_restarts {self.max_restarts} over {self.machines} machines: a restarted group would meet in the "
            "launcher's store, where the failed group's addresses are still written, and can hang or fail to connect; "
            "launch with --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment of every "
            "machine (docs/distributed.md: Elastic restarts)"
        )


def fsdp_plugin(mixed_precision: str) -> FullyShardedDataParallelPlugin | None:
    """Under an FSDP launch (ACCELERATE_USE_FSDP): its settings (the FSDP_* variables `accelerate launch` sets from the
    config) with gradients reduced in fp32; None otherwise.

    Accelerate's own policy reduces gradients in the compute dtype, so under bf16 the mean over the ranks would
    keep 8 bits of mantissa where DDP, which reduces fp32 gradients, keeps 24. Parameters are still gathered and
    used in the compute dtype (FSDP2's mixed precision: no autocast, fp32 master weights), and outputs stay as
    computed: Accelerate's policy would also cast the fp32 loss to bf16. Only FSDP2 is supported.
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(f"accel_gpt trains with FSDP2: set fsdp_version: 2 in the accelerate config (not {version})")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    return FullyShardedDataParallelPlugin(mixed_precision_policy=policy)


def use_attention_backend(name: str, device: torch.device) -> None:
    """Force one scaled-dot-product attention kernel on CUDA (`auto` leaves PyTorch's choice).

    Global switches rather than an `sdpa_kernel` context: they hold for compiled and eager code alike. A kernel
    that cannot run a call makes that call fail instead of falling back, so a forced choice is a real A/B.
    """
    if name == "auto":
        return
    if device.type != "cuda":
        raise ConfigError(f"attention_backend {name} chooses a CUDA kernel; this run is on {device.type}: use auto")
    for kernel, enable in ATTENTION_SWITCHES.items():
        enable(kernel == name)


ATTENTION_SWITCHES: dict[str, Callable[[bool], None]] = {
    "flash": torch.backends.cuda.enable_flash_sdp,
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "math": torch.backends.cuda.enable_math_sdp,
}


def stop_signals() -> list[signal.Signals]:
    """The signals that stop a run; SIGHUP only where it is not ignored, as `nohup` asks the run to outlive its
    terminal."""
    stops = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        stops.append(signal.SIGHUP)
    return stops


class StopSignal:
    """SIGTERM, SIGHUP and SIGINT ask the run to finish its current step, save and exit 0; a second Ctrl-C aborts.

    SIGHUP (a closed terminal or ssh session) is taken as SIGTERM, so losing the terminal costs no steps; a run
    started with SIGHUP ignored (`nohup`) keeps it ignored, and a hangup never aborts a save a Ctrl-C began.
    torchrun forwards the SIGHUP it gets to the workers, as it does SIGTERM.

    A signal may reach the ranks at different steps (or only some of them), so `requested()` makes every
    rank agree after each step: a one-number all-reduce over a CPU (gloo) group, which adds no device sync.

    Under `accelerate launch`, Ctrl-C reaches the launcher alone (torchrun starts each worker in its own session):
    it forwards a SIGINT to every worker, and on a second Ctrl-C sends them SIGTERM. So after a SIGINT, another
    SIGINT or a SIGTERM aborts; repeated SIGTERMs (a scheduler signalling the launcher and the workers, which the
    launcher forwards again) stop the run once. A worker whose launcher is gone (killed alone, e.g. SIGKILL of its
    process group) would train on as an orphan: after each step, a worker started by torchrun checks that its
    parent is still the launcher, and stops and saves as on SIGTERM when it is not.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.flag = False
        self.first: int | None = None  # the first signal received
        self.speak = accelerator.is_main_process
        self.group: Any = None
        self.world = accelerator.num_processes
        if self.world > 1:
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in stop_signals()}

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.flag and signum != signal.SIGHUP and signal.SIGINT in (signum, self.first):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the second Ctrl-C: stop now, no save
            return
        if self.flag:
            return
        self.flag, self.first = True, signum
        again = " (Ctrl-C again: abort)" if signum == signal.SIGINT else ""  # a repeated SIGTERM/SIGHUP is one
        self._say(f"{signal.Signals(signum).name}: finishing the current step, then saving and exiting{again}")

    def _say(self, message: str) -> None:
        if self.speak:
            with contextlib.suppress(OSError):  # an orphan's stderr may be a pipe nobody reads any more
                sys.stderr.write(f"\n{message}\n")

    def _orphaned(self) -> bool:
        """The launcher that started this worker has died (the worker was re-parented)."""
        if self.launcher is None or os.getppid() == self.launcher:
            return False
        self._say(f"the launcher (pid {self.launcher}) is gone: finishing the current step, then saving and exiting")
        return True

    def requested(self) -> bool:
        """Whether any rank was signalled or lost its launcher; the same answer on every rank."""
        if not self.flag and self._orphaned():
            self.flag = True
        if self.world == 1:
            return self.flag
        flag = torch.tensor([int(self.flag)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
