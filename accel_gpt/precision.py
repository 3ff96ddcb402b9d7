"""What this device computes fast, read once at start: the dtype of Muon's Newton-Schulz, and whether the launch's
mixed precision runs on units that do it fast.

Why: torch computes a bf16 matmul fast only on bf16 matrix units: CUDA compute capability >= 8.0, and CPUs with
AVX512-BF16 or AMX (where oneDNN may use them). Elsewhere it is emulated. On an AVX2-only EPYC (one thread, torch
2.13) five Newton-Schulz iterations on 128x128 took 31 ms in bf16 against 1.6 ms in fp32; on an AVX512-BF16 EPYC with
oneDNN capped at AVX2, 4 such matrices took 50 ms against 2.5, and a bf16-autocast forward and backward of nanoGPT's
CPU recipe 9.6x its fp32 time (`bench/newton_schulz.py`, bench/RESULTS.md).

The decisions are pure functions of a `Capability`, so that tests can hand in any device class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from accel_gpt.errors import UserError

# oneDNN runs torch's bf16 matmuls on x86 CPUs. ONEDNN_MAX_CPU_ISA (or its former name DNNL_MAX_CPU_ISA) caps the
# instructions it may use, in this order (oneDNN's `cpu_isa_t`; AVX10_1_512 is AVX512_CORE_FP16's newer name): a cap
# below AVX512_CORE_BF16 leaves bf16 matmuls emulated on any CPU.
ONEDNN_ISAS = (
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16",
    "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16",
)  # fmt: skip
# On a CPU with bf16 units, matrices narrower than this run Newton-Schulz in fp32 all the same: on an AVX512-BF16
# EPYC one 64x64 matrix took 0.26 ms in bf16 and 0.11 in fp32 (a batch of 4: 0.34 and 0.37), while from 128 wide on
# bf16 wins at any batch (4 x 128x128: 0.84 against 2.51; one: 0.40 against 0.65). bench/RESULTS.md.
CPU_BF16_MIN_SIDE = 128


@dataclass(frozen=True)
class Capability:
    """One device's class, as the start-up line and the bench scripts name it."""

    device: str  # torch's device type: cpu | cuda | mps | xpu ...
    name: str  # the class: AMX | AVX512-BF16 | AVX512 | AVX2 | ... on a CPU; the GPU's name and compute capability
    bf16_units: bool  # bf16 matrix units that torch's kernels use here

    @property
    def units(self) -> str:
        return f"{self.name}, {'with' if self.bf16_units else 'no'} bf16 matrix units"


def cpu_capability(env: dict[str, str] | None = None) -> Capability:
    """This CPU's class: AMX or AVX512-BF16 where those units exist and oneDNN may use them, else torch's vector
    level (`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2, DEFAULT, ...)."""
    env = os.environ if env is None else env
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    allowed = ONEDNN_ISAS.index(cap) if cap in ONEDNN_ISAS else len(ONEDNN_ISAS)  # ALL, DEFAULT: no cap
    mkldnn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    cpu = torch.cpu
    if mkldnn and _has(cpu, "_is_amx_tile_supported") and allowed >= ONEDNN_ISAS.index("AVX512_CORE_AMX"):
        return Capability("cpu", "AMX", True)
    if mkldnn and _has(cpu, "_is_avx512_bf16_supported") and allowed >= ONEDNN_ISAS.index("AVX512_CORE_BF16"):
        return Capability("cpu", "AVX512-BF16", True)
    return Capability("cpu", torch.backends.cpu.get_cpu_capability(), False)


def _has(module: object, probe: str) -> bool:
    """torch's own CPU feature probes (private: where a torch lacks one, the unit counts as absent)."""
    check = getattr(module, probe, None)
    return bool(check()) if check is not None else False


def detect(device: torch.device) -> Capability:
    """The class of the device a run computes on."""
    if device.type == "cpu":
        return cpu_capability()
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        return Capability("cuda", name, (major, minor) >= (8, 0))
    return Capability(device.type, device.type, False)  # MPS, XPU: not measured here, so fp32 where it is our choice


@dataclass(frozen=True)
class NewtonSchulzPrecision:
    """The dtype Muon orthogonalizes its updates in: `dtype` for matrices whose shorter side is at least `min_side`,
    fp32 for narrower ones. `reason`: why, for the start-up line; `warning`: a setting that will run slowly."""

    dtype: torch.dtype
    min_side: int = 0
    reason: str = ""
    warning: str | None = None

    def dtype_for(self, shape: torch.Size | tuple[int, ...]) -> torch.dtype:
        return self.dtype if min(shape) >= self.min_side else torch.float32

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        below = f", float32 under {self.min_side} wide" if self.min_side and self.dtype != torch.float32 else ""
        return f"Newton-Schulz in {name}{below} ({self.reason})"


NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz_precision(setting: str, capability: Capability) -> NewtonSchulzPrecision:
    """`muon_ns_dtype`: auto is bf16 on bf16 matrix units (on a CPU from CPU_BF16_MIN_SIDE wide on), else fp32;
    bfloat16 and float32 are taken as given, bf16 without the units with a warning."""
    if setting != "auto":
        warning = None
        if setting == "bfloat16" and not capability.bf16_units:
            warning = (
                f"muon_ns_dtype bfloat16 on {capability.units}: its matmuls are emulated, about 20x slower than "
                "float32 (bench/RESULTS.md); --muon_ns_dtype auto picks float32 here"
            )
        return NewtonSchulzPrecision(NS_DTYPES[setting], reason=f"muon_ns_dtype {setting}", warning=warning)
    if not capability.bf16_units:
        return NewtonSchulzPrecision(torch.float32, reason="auto: no bf16 matrix units")
    min_side = CPU_BF16_MIN_SIDE if capability.device == "cpu" else 0
    return NewtonSchulzPrecision(torch.bfloat16, min_side, reason="auto: bf16 matrix units")


def check_mixed_precision(precision: str, capability: Capability) -> str | None:
    """bf16 mixed precision where bf16 is emulated: refused on a GPU (fp16 is what such GPUs do fast), a warning on a
    CPU (it trains, about 10x slower than fp32: measured, see the module). Returns the warning, or None."""
    if precision != "bf16" or capability.bf16_units:
        return None
    if capability.device == "cuda":
        raise UserError(
            f"mixed_precision bf16 on {capability.name}, which has no bf16 tensor cores (compute capability 8.0 "
            "and newer do): use fp16 (--mixed_precision fp16, or mixed_precision: fp16 in the accelerate config)"
        )
    if capability.device != "cpu":
        return None
    return (
        f"mixed_precision bf16 on a CPU without bf16 matrix units ({capability.name}): its matmuls are emulated "
        "there, about 10x slower than fp32 (bench/RESULTS.md); train with --mixed_precision no"
    )


# ------------------------------------------------------------------------------------ mixed precision and compile

# On a CPU with bf16 units, bf16 autocast pays from this width on; narrower models train in fp32. Measured on an
# AVX512-BF16 EPYC (bench/RESULTS.md): nanoGPT's CPU recipe, 128 wide, took 0.81x its fp32 time per micro-step, and
# nanochat's block 6 x 384 trained at 2.4x fp32's tokens/s; under 128 wide the matmuls are too small for the units
# (a 64x64 Newton-Schulz ran 2.4x slower in bf16 than in fp32), so fp32 keeps the fp32 numbers there.
CPU_BF16_MIN_WIDTH = 128


@dataclass(frozen=True)
class Choice:
    """A runtime setting as the run resolved it, and why (the start-up line)."""

    value: str | bool
    why: str


def choose_mixed_precision(
    setting: str, launched: str | None, capability: Capability, n_embd: int, resumed: str | None = None
) -> Choice:
    """`mixed_precision`: a setting other than auto (a flag or YAML) is taken as given; then the launch's (an
    accelerate config or `accelerate launch --mixed_precision`, in ACCELERATE_MIXED_PRECISION); then, for a resume,
    what the checkpoint trained in, where this device still does it fast; else bf16 where the device has bf16 matrix
    units (on a CPU from CPU_BF16_MIN_WIDTH wide on), fp32 elsewhere."""
    if setting != "auto":
        return Choice(setting, "mixed_precision setting")
    if launched:
        return Choice(launched, "the launch's")
    fast = _fast_precision(capability, n_embd)
    if resumed in ("no", "bf16", "fp16"):
        if resumed == "no" or capability.bf16_units or resumed == "fp16" and capability.device == "cuda":
            return Choice(resumed, "auto: as the checkpoint trained")
        return Choice(fast.value, f"auto: the checkpoint trained in {resumed}, which {capability.name} emulates")
    return fast


def _fast_precision(capability: Capability, n_embd: int) -> Choice:
    if not capability.bf16_units:
        return Choice("no", f"auto: {capability.name} has no bf16 matrix units")
    if capability.device == "cpu" and n_embd < CPU_BF16_MIN_WIDTH:
        return Choice("no", f"auto: {n_embd} wide, under the {CPU_BF16_MIN_WIDTH} where bf16 pays on a CPU")
    return Choice("bf16", "auto: bf16 matrix units")


@dataclass(frozen=True)
class CompileCost:
    """What `torch.compile` costs and saves on one kind of device, measured (bench/RESULTS.md, "Compile")."""

    seconds: float  # the first step's extra time, a model of one layer, with an empty compile cache
    seconds_per_layer: float  # and for each more block
    gain: float  # the share of a step's time it saves afterwards


# Keyed by (device type, mixed precision). CPU: 2-vCPU EPYCs, torch 2.13, an empty compile cache (a run compiled
# before costs a fifth): 21-29 s at 2 layers, 36 s at 6, 49 s at 12. In fp32 it saved 2-3.5% of a 6 x 384 step on
# AVX2 and cost 36% on a 2 x 128 one, so auto leaves fp32 CPU runs eager; under bf16 autocast it saved 17% of the
# 6 x 384 step on AVX512-BF16 (bench/RESULTS.md, "Compile"). CUDA: not measured here yet; nanoGPT's README reports
# 250 -> 135 ms per GPT-2 124M step on an A100, and the GPU plan measures it.
COMPILE_COSTS = {
    ("cpu", "no"): CompileCost(24.0, 2.2, 0.0),
    ("cpu", "bf16"): CompileCost(24.0, 2.2, 0.17),
    ("cuda", "no"): CompileCost(30.0, 3.0, 0.30),
    ("cuda", "bf16"): CompileCost(30.0, 3.0, 0.30),
    ("cuda", "fp16"): CompileCost(30.0, 3.0, 0.30),
}
# FLOP/s one process achieves in a training step, to estimate a run's length before it starts: per CPU thread, or
# per GPU. CPU: nanochat's block 6 x 384 at 2 threads (bench/RESULTS.md); GPU: a third of an H100's bf16 peak.
STEP_FLOPS = {
    ("cpu", False, "no"): 40e9,  # AVX2 EPYC, fp32: 85 GFLOP/s on 2 threads
    ("cpu", True, "no"): 85e9,  # AVX512-BF16 EPYC, fp32: 174 GFLOP/s
    ("cpu", True, "bf16"): 200e9,  # AVX512-BF16 EPYC, bf16 autocast: 416 GFLOP/s
    ("cuda", True, "bf16"): 330e12,
}


@dataclass(frozen=True)
class Workload:
    """What a run has left to do, as far as it is known before it starts."""

    steps: int  # optimizer steps left
    step_flops: float  # training FLOPs of one optimizer step, on one process
    n_layer: int
    threads: int = 1  # CPU threads of one process
    budget_seconds: float | None = None  # a time budget's seconds left

    def seconds(self, capability: Capability, precision: str) -> float:
        """The steps' expected seconds: the budget where it ends them first, else from the FLOPs."""
        own = [rate for (device, *_), rate in STEP_FLOPS.items() if device == capability.device]
        rate = STEP_FLOPS.get((capability.device, capability.bf16_units, precision)) or min(own, default=40e9)
        if capability.device == "cpu":
            rate *= self.threads
        by_steps = self.steps * self.step_flops / rate
        return min(by_steps, self.budget_seconds) if self.budget_seconds else by_steps


def choose_compile(
    setting: str | bool, capability: Capability, precision: str, work: Workload, launch_compiles: bool = False
) -> Choice:
    """`compile`: true or false as given; auto compiles where the time it saves over the run's expected length is
    at least twice its own cost, so a misjudged length still leaves it ahead (never where the launch compiles the
    model itself: an accelerate config's dynamo_backend)."""
    if setting != "auto":
        return Choice(bool(setting), "compile setting")
    if launch_compiles:
        return Choice(False, "auto: the launch compiles the model (dynamo_backend)")
    cost = COMPILE_COSTS.get((capability.device, precision))
    dtype = "fp32" if precision == "no" else precision
    if cost is None:
        return Choice(False, f"auto: not measured on {capability.device} in {dtype}")
    if cost.gain <= 0:
        return Choice(False, f"auto: it gains nothing measurable on a {capability.device.upper()} in {dtype}")
    seconds = work.seconds(capability, precision)
    spend = cost.seconds + cost.seconds_per_layer * (work.n_layer - 1)
    saves = cost.gain * seconds
    length = f"about {_duration(seconds)} of steps"
    if saves >= 2 * spend:
        return Choice(True, f"auto: {length} saves {_duration(saves)} for {_duration(spend)} of compiling")
    return Choice(False, f"auto: {length} would save {_duration(saves)}, under twice its {_duration(spend)}")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
