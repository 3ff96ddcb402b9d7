"""Precision by capability: each device class's decisions (the class handed in by the test), the CPU's class as read
from torch and the environment, Muon's step against torch's in bf16 and in fp32, and the start-up line of real runs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import python_cmd, run_cmd, write_token_shards

from accel_gpt import muon as muon_module
from accel_gpt.errors import UserError
from accel_gpt.muon import Muon, orthogonalize
from accel_gpt.precision import (
    Capability,
    NewtonSchulzPrecision,
    check_mixed_precision,
    cpu_capability,
    detect,
    newton_schulz_precision,
)

AMX = Capability("cpu", "AMX", True)
AVX512_BF16 = Capability("cpu", "AVX512-BF16", True)
AVX512 = Capability("cpu", "AVX512", False)  # Skylake/Cascade Lake: AVX512 without bf16 units
AVX2 = Capability("cpu", "AVX2", False)
ARM = Capability("cpu", "DEFAULT", False)
H100 = Capability("cuda", "NVIDIA H100 (compute capability 9.0)", True)
T4 = Capability("cuda", "Tesla T4 (compute capability 7.5)", False)
MPS = Capability("mps", "mps", False)
BF16, FP32 = torch.bfloat16, torch.float32

# class -> (auto's dtype for a 128x512 matrix, for a 64x256 one, mixed precision bf16: None | "warn" | "refuse")
DECISIONS = {
    AMX: (BF16, FP32, None),
    AVX512_BF16: (BF16, FP32, None),
    AVX512: (FP32, FP32, "warn"),
    AVX2: (FP32, FP32, "warn"),
    ARM: (FP32, FP32, "warn"),
    H100: (BF16, BF16, None),
    T4: (FP32, FP32, "refuse"),
    MPS: (FP32, FP32, None),
}


@pytest.mark.parametrize("capability", DECISIONS, ids=lambda c: c.name.split(" (")[0])
def test_each_class_gets_the_dtype_it_does_fast(capability: Capability) -> None:
    wide, narrow, mixed = DECISIONS[capability]
    auto = newton_schulz_precision("auto", capability)
    assert (auto.dtype_for((128, 512)), auto.dtype_for((256, 64))) == (wide, narrow)
    assert auto.warning is None
    assert auto.describe().endswith(f"(auto: {'' if capability.bf16_units else 'no '}bf16 matrix units)")
    for setting, dtype in (("float32", FP32), ("bfloat16", BF16)):
        chosen = newton_schulz_precision(setting, capability)
        assert chosen.dtype_for((128, 512)) == chosen.dtype_for((16, 16)) == dtype, "a setting applies to every size"
        assert chosen.describe() == f"Newton-Schulz in {setting} (muon_ns_dtype {setting})"
        slow = setting == "bfloat16" and not capability.bf16_units
        assert (chosen.warning is not None) == slow
        if slow:
            assert chosen.warning.startswith(f"muon_ns_dtype bfloat16 on {capability.name}, no bf16 matrix units")
    if mixed == "refuse":
        with pytest.raises(UserError, match=r"^mixed_precision bf16 on Tesla T4 .* use fp16 \(--mixed_precision fp16"):
            check_mixed_precision("bf16", capability)
    else:
        warning = check_mixed_precision("bf16", capability)
        assert (warning is not None) == (mixed == "warn")
        if warning:
            assert f"without bf16 matrix units ({capability.name})" in warning
            assert warning.endswith("train with --mixed_precision no") and "\n" not in warning
    for other in ("no", "fp16"):
        assert check_mixed_precision(other, capability) is None


def test_auto_on_a_cpu_with_bf16_units_keeps_narrow_matrices_in_float32() -> None:
    auto = newton_schulz_precision("auto", AVX512_BF16)
    assert [auto.dtype_for(s) for s in [(128, 128), (384, 128), (127, 4096), (32, 96)]] == [BF16, BF16, FP32, FP32]
    assert auto.describe() == "Newton-Schulz in bfloat16, float32 under 128 wide (auto: bf16 matrix units)"


@pytest.fixture
def cpu_flags(monkeypatch: pytest.MonkeyPatch):
    """Set torch's CPU probes: which of AMX and AVX512-BF16 this 'CPU' has."""

    def set_flags(amx: bool, avx512_bf16: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)

    return set_flags


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "env", "name"),
    [
        (True, True, {}, "AMX"),
        (False, True, {}, "AVX512-BF16"),
        (True, True, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "AVX512-BF16"),  # AMX capped away
        (True, True, {"DNNL_MAX_CPU_ISA": "avx512_core_amx"}, "AMX"),
        (True, True, {"ONEDNN_MAX_CPU_ISA": "ALL"}, "AMX"),
        (True, True, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, None),  # bf16 emulated: torch's own vector level
        (False, True, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, None),
        (False, False, {}, None),
    ],
)
def test_the_cpu_class_reads_the_units_and_the_onednn_cap(cpu_flags, amx, avx512_bf16, env, name) -> None:
    cpu_flags(amx, avx512_bf16)
    got = cpu_capability(env)
    assert got.device == "cpu" and got.bf16_units == (name is not None)
    assert got.name == (name or torch.backends.cpu.get_cpu_capability())


def test_without_onednn_or_its_probes_there_are_no_bf16_units(cpu_flags, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_flags(True, True)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not cpu_capability({}).bf16_units, "oneDNN off: bf16 matmuls take torch's emulated path"
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert not cpu_capability({}).bf16_units


@pytest.mark.parametrize(("capability", "bf16"), [((8, 0), True), ((9, 0), True), ((7, 5), False), ((7, 0), False)])
def test_a_gpu_has_bf16_units_from_compute_capability_8(monkeypatch: pytest.MonkeyPatch, capability, bf16) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    got = detect(torch.device("cuda", 0))
    assert got == Capability("cuda", f"GPU (compute capability {capability[0]}.{capability[1]})", bf16)
    assert detect(torch.device("mps")) == Capability("mps", "mps", False)


# ------------------------------------------------------------------------------------------ Muon's step

SHAPES = [(48, 16), (16, 16), (64, 16), (16, 64), (48, 16), (16, 16), (24, 40)]  # repeated shapes batch together
OPTIONS = [
    {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_steps": 5},
    {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9, "nesterov": False, "ns_steps": 3},
    {"lr": 0.01, "weight_decay": 0.05, "momentum": 0.95, "nesterov": True, "adjust_lr_fn": "match_rms_adamw"},
]


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in SHAPES]


def steps(optimizer: torch.optim.Optimizer, ps: list[torch.nn.Parameter], n: int = 4) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("options", OPTIONS)
def test_muon_in_bfloat16_is_torchs_muon_bit_for_bit(options: dict) -> None:
    """The same matrices, gradients and options: torch.optim.Muon's step and accel_gpt's (same shapes batched, in bf16)
    give equal weights and momentum buffers, and state_dicts each can load."""
    ours, theirs = params(), params()
    mine = Muon(ours, NewtonSchulzPrecision(BF16), **options)
    torchs = torch.optim.Muon(theirs, **options)
    steps(mine, ours)
    steps(torchs, theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(mine.state[a]["momentum_buffer"], torchs.state[b]["momentum_buffer"])
    swapped = torch.optim.Muon(params(), **options)
    swapped.load_state_dict(copy.deepcopy(mine.state_dict()))  # a checkpoint holds torch's Muon state
    assert swapped.state_dict()["state"].keys() == mine.state_dict()["state"].keys()


def newton_schulz_float64(g: torch.Tensor, steps: int) -> torch.Tensor:
    """torch's iteration, one matrix, in float64 (returned as fp32): the reference for the fp32 path."""
    a, b, c = torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if g.size(0) > g.size(1) else x).float()


def test_muon_in_float32_follows_the_iteration_to_float32_round_off() -> None:
    """fp32 Newton-Schulz (batched) against the same iteration in float64, matrix by matrix: the plain iteration (a
    square matrix) to 1e-5, the Gram form (3:1 and 4:1 matrices) to 5e-4 (exact in float64); bf16 only roughly."""
    generator = torch.Generator().manual_seed(3)
    schedule = [(torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C)] * 5
    for shape, tolerance in [((3, 48, 16), 5e-4), ((2, 16, 64), 5e-4), ((2, 128, 128), 1e-5), ((2, 40, 32), 1e-5)]:
        g = torch.randn(*shape, generator=generator)
        reference = torch.stack([newton_schulz_float64(m, 5) for m in g])
        fp32 = orthogonalize(g, schedule, 1e-7, FP32)
        bf16 = orthogonalize(g, schedule, 1e-7, BF16)
        assert fp32.dtype == FP32 and bf16.dtype == BF16
        assert (fp32 - reference).abs().max() < tolerance, shape
        assert 1e-4 < (bf16.float() - reference).abs().max() < 0.1
        exact = orthogonalize(g.double(), schedule, 1e-7, torch.float64)
        assert (exact.float() - reference).abs().max() < 1e-6, "the Gram form is the same iteration"
        singular = torch.linalg.svdvals(fp32)  # orthogonalized: most near 1 (a square one's smallest lag behind)
        assert 0.7 < singular.median() < 1.3 and singular.max() < 1.3


def test_each_shape_runs_in_its_own_dtype() -> None:
    """With float32 under 32 wide: the 16-wide matrices take the fp32 path's values, the 24x40 one the bf16 path's."""
    split = NewtonSchulzPrecision(BF16, min_side=24)
    runs = {}
    for name, precision in (
        ("split", split),
        ("fp32", NewtonSchulzPrecision(FP32)),
        ("bf16", NewtonSchulzPrecision(BF16)),
    ):
        ps = params()
        steps(Muon(ps, precision, **OPTIONS[0]), ps, n=2)
        runs[name] = ps
    for i, shape in enumerate(SHAPES):
        expected = runs["bf16" if min(shape) >= 24 else "fp32"][i]
        assert torch.equal(runs["split"][i], expected), shape
        assert not torch.equal(runs["fp32"][i], runs["bf16"][i])


def test_a_torch_muon_with_options_unknown_here_runs_its_own_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were torch's Muon to take an option this step does not implement, torch's own step runs (and says so)."""
    monkeypatch.setattr(muon_module, "KNOWN_OPTIONS", muon_module.KNOWN_OPTIONS - {"eps"})
    ours, theirs = params(), params()
    mine = Muon(ours, NewtonSchulzPrecision(FP32), **OPTIONS[0])
    assert mine.fallback == f"torch {torch.__version__}'s Muon has options ['eps']"
    steps(mine, ours)
    steps(torch.optim.Muon(theirs, **OPTIONS[0]), theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


# ------------------------------------------------------------------------------------------ the start-up line

VOCAB = 256
FLAGS = [
    *("--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)),
    *("--micro_batch_size", "2", "--total_batch_size", "64", "--max_steps", "2", "--optimizer", "muon"),
    *("--eval_every", "0", "--save_every", "0", "--sample_tokens", "0", "--log_with", "none"),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:6_000]]
    return write_token_shards(
        tmp_path_factory.mktemp("precision") / "data", tokens[:5_000], tokens[5_000:], vocab_size=VOCAB
    )


def test_the_start_up_line_names_the_class_and_the_newton_schulz_dtype(data: Path, tmp_path: Path) -> None:
    """This machine's own class, then the same run with oneDNN capped at AVX2 (bf16 emulated on any x86 CPU): auto
    picks fp32 and says why, and bf16 asked for anyway is warned about, for Muon and for mixed precision alike."""
    own = cpu_capability()
    proc = run_cmd(python_cmd("train", *FLAGS, "--data_dir", str(data), "--out_dir", str(tmp_path / "own")))
    expected = newton_schulz_precision("auto", own).describe()
    assert f"| cpu {own.units} |" in proc.stderr and f"Muon + AdamW, {expected}" in proc.stderr, proc.stderr[-3000:]
    assert "warning" not in proc.stderr.lower()

    capped = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = run_cmd(python_cmd("train", *FLAGS, "--data_dir", str(data), "--out_dir", str(tmp_path / "avx2")), **capped)
    avx2 = cpu_capability(capped)
    assert f"| cpu {avx2.name}, no bf16 matrix units |" in proc.stderr, proc.stderr[-3000:]
    assert "Muon + AdamW, Newton-Schulz in float32 (auto: no bf16 matrix units), 5 quintic iterations" in proc.stderr

    args = [*FLAGS, "--muon_ns_dtype", "bfloat16", "--mixed_precision", "bf16"]
    args += ["--muon_ns_coefficients", "polar_express"]
    proc = run_cmd(python_cmd("train", *args, "--data_dir", str(data), "--out_dir", str(tmp_path / "bf16")), **capped)
    lines = [line for line in proc.stderr.splitlines() if "no bf16 matrix units" in line or "without bf16" in line]
    assert any(line.startswith("warning: mixed_precision bf16 on a CPU without bf16 matrix units") for line in lines)
    assert any("muon_ns_dtype bfloat16 on" in line and "auto picks float32 here" in line for line in lines)
    assert "Newton-Schulz in bfloat16 (muon_ns_dtype bfloat16), 5 polar_express iterations" in proc.stderr
    assert "finished at step 2/2" in proc.stderr
