"""Muon's Newton-Schulz coefficients: torch's quintic and Polar Express's table, what each does to singular values,
the table against its derivation, and the setting from the config to the optimizer, the start-up line and a resume."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import python_cmd, run_cmd

from accel_gpt.checkpoint import TRAIN_STATE_FILE, changed_settings
from accel_gpt.config import ConfigError, TrainConfig
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.muon import POLAR_EXPRESS, POLAR_EXPRESS_LOW, POLAR_EXPRESS_MARGIN, Muon, ns_schedule, orthogonalize
from accel_gpt.optim import make_optimizer
from accel_gpt.precision import NewtonSchulzPrecision
from accel_gpt.train import newton_schulz_line
from bench.polar_express import greedy_table

TORCH = (torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C)


def spread(rows: int, cols: int, smallest: float, generator: torch.Generator) -> torch.Tensor:
    """A (1, rows, cols) matrix whose singular values run evenly in log from 1 down to `smallest`."""
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(rows, k, generator=generator))[0]
    v = torch.linalg.qr(torch.randn(cols, k, generator=generator))[0]
    return ((u * torch.logspace(0, torch.log10(torch.tensor(smallest)).item(), k)) @ v.T)[None]


def test_the_schedule_repeats_torchs_quintic_or_walks_the_table_then_keeps_its_last_row() -> None:
    assert ns_schedule("quintic", TORCH, 3) == [TORCH] * 3
    assert ns_schedule("polar_express", TORCH, 2) == list(POLAR_EXPRESS[:2])
    assert ns_schedule("polar_express", TORCH, 9)[-3:] == [POLAR_EXPRESS[-1]] * 3
    with pytest.raises(ValueError, match="less than 100"):
        ns_schedule("quintic", TORCH, 100)


def test_the_table_is_its_derivation() -> None:
    """bench/polar_express.py's Remez exchange, from [POLAR_EXPRESS_LOW, 1] with the table's margin, gives the table."""
    derived = greedy_table(POLAR_EXPRESS_LOW, len(POLAR_EXPRESS), POLAR_EXPRESS_MARGIN)
    assert torch.tensor(derived).sub(torch.tensor(POLAR_EXPRESS)).abs().max() < 1e-9


def test_the_whole_table_sends_every_singular_value_to_1_where_torchs_quintic_stays_within_a_third() -> None:
    """Singular values down to 1e-3 of the Frobenius norm end within 0.2% of 1 after the table's 7 iterations; torch's
    quintic, by design, leaves them between about 0.68 and 1.13 however many it takes."""
    generator = torch.Generator().manual_seed(0)
    for rows, cols in [(128, 384), (96, 96)]:
        g = spread(rows, cols, 0.01, generator)
        assert torch.linalg.svdvals(g[0] / g.norm()).min() > POLAR_EXPRESS_LOW
        for name, low, high in [("polar_express", 0.998, 1.002), ("quintic", 0.6, 1.2)]:
            x = orthogonalize(g, ns_schedule(name, TORCH, len(POLAR_EXPRESS)), 1e-7, torch.float32)
            singular = torch.linalg.svdvals(x[0])
            assert low < singular.min() and singular.max() < high, (name, singular.min(), singular.max())
        x = orthogonalize(g, ns_schedule("quintic", TORCH, len(POLAR_EXPRESS)), 1e-7, torch.float32)
        assert torch.linalg.svdvals(x[0]).min() < 0.75  # the quintic's own spread, which Polar Express closes


def plain_float64(g: torch.Tensor, schedule: list[tuple[float, float, float]]) -> torch.Tensor:
    """The iteration written out on the matrices themselves, in float64: the reference for the Gram form."""
    x = g.double().mT if g.size(-2) > g.size(-1) else g.double()
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    for a, b, c in schedule:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if g.size(-2) > g.size(-1) else x


def test_the_gram_form_is_the_plain_iteration_with_the_tables_coefficients() -> None:
    """Wide fp32 matrices (and tall ones, transposed) take the Gram form; with Polar Express's large first
    coefficients it still agrees with the plain iteration in float64."""
    generator = torch.Generator().manual_seed(3)
    for steps in (4, 7):
        schedule = ns_schedule("polar_express", TORCH, steps)
        for shape in [(3, 48, 16), (2, 16, 64), (2, 128, 512)]:
            g = torch.randn(*shape, generator=generator)
            fp32 = orthogonalize(g, schedule, 1e-7, torch.float32).double()
            assert (fp32 - plain_float64(g, schedule)).abs().max() < 5e-5, (steps, shape)


def test_a_rank_one_update_in_bfloat16_stays_bounded() -> None:
    """A rank-one update has its one singular value at exactly 1 after the norm, the top of the range each quintic is
    fitted to, and bf16's rounding lifts it past 1. The table is fitted to each range widened by 1%, which keeps such
    a value near 1; fitted to the bare ranges, 5 of these 8 matrices reach 8 to 90 in 3 iterations and inf in 5."""
    generator = torch.Generator().manual_seed(1)
    for rows, cols in [(128, 128)] * 4 + [(256, 64)] * 4:
        g = torch.randn(rows, 1, generator=generator) @ torch.randn(1, cols, generator=generator)
        for steps in (3, 4, 5, 7):
            x = orthogonalize(g[None], ns_schedule("polar_express", TORCH, steps), 1e-7, torch.bfloat16)[0].float()
            assert torch.isfinite(x).all() and torch.linalg.svdvals(x).max() < 2, (rows, cols, steps)


def test_each_block_has_its_default_and_a_value_is_checked() -> None:
    gpt2 = TrainConfig(data_dir="x")
    nanochat = TrainConfig(data_dir="x", arch="nanochat")
    assert (gpt2.muon_ns_coefficients, gpt2.muon_ns_steps) == ("quintic", 5)
    assert (nanochat.muon_ns_coefficients, nanochat.muon_ns_steps) == ("polar_express", 4)
    assert TrainConfig(data_dir="x", arch="nanochat", muon_ns_coefficients="quintic").muon_ns_coefficients == "quintic"
    with pytest.raises(ConfigError, match="muon_ns_coefficients='cubic' is not one of quintic, polar_express"):
        TrainConfig(data_dir="x", muon_ns_coefficients="cubic")


def test_the_optimizer_takes_the_setting_and_its_step_iterates_the_table() -> None:
    """From the config to the optimizer, and a step's update is the table's orthogonalization of the momentum."""
    cfg = TrainConfig(data_dir="x", arch="nanochat", n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=32)
    model = GPT(GPTConfig(**cfg.model_settings()))
    for name in ("polar_express", "quintic"):
        chosen = TrainConfig(**{**cfg.__dict__, "optimizer": "muon", "muon_ns_coefficients": name})
        assert make_optimizer(model, chosen, "cpu").muon.coefficients == name
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(24, 40, generator=generator))
    weight.grad = torch.randn(24, 40, generator=generator)
    before = weight.detach().clone()
    precision = NewtonSchulzPrecision(torch.float32)
    muon = Muon([weight], precision, "polar_express", lr=0.05, momentum=0.9, weight_decay=0, ns_steps=4)
    muon.step()
    momentum = torch.zeros(24, 40).lerp_(weight.grad, 0.1)
    update = weight.grad.lerp(momentum, 0.9)  # Nesterov
    expected = orthogonalize(update[None], ns_schedule("polar_express", TORCH, 4), 1e-7, torch.float32)[0]
    torch.testing.assert_close(weight.detach(), before - 0.05 * expected, rtol=0, atol=1e-6)
    quintic = orthogonalize(update[None], ns_schedule("quintic", TORCH, 4), 1e-7, torch.float32)[0]
    assert (weight.detach() - (before - 0.05 * quintic)).abs().max() > 1e-3


def test_the_start_up_line_names_them_and_a_fallback_says_which_it_iterates() -> None:
    muon = Muon([torch.nn.Parameter(torch.ones(4, 4))], NewtonSchulzPrecision(torch.float32), "polar_express")
    line = newton_schulz_line(SimpleNamespace(muon=muon))
    assert line.endswith(", 5 polar_express iterations") and line.startswith("Newton-Schulz in float32")
    muon.fallback = "torch 9.9's Muon has options ['x']"
    assert newton_schulz_line(SimpleNamespace(muon=muon)).startswith(
        "Newton-Schulz in torch's bfloat16 with its quintic, not polar_express, (torch 9.9's Muon has options ['x']"
    )
    with pytest.raises(ValueError, match="'cubic': not quintic or polar_express"):
        ns_schedule("cubic", TORCH, 3)


def test_a_muon_run_saved_before_the_setting_resumes_with_the_change_said() -> None:
    """Such a run iterated torch's quintic: resumed under nanochat's Polar Express, the change is listed (and logged);
    under GPT-2's quintic, or with AdamW, nothing is."""
    old = {"optimizer": "muon", "muon_ns_steps": 4}
    now = {**old, "muon_ns_coefficients": "polar_express"}
    assert changed_settings(old, now) == [("muon_ns_coefficients", "quintic", "polar_express")]
    assert changed_settings(old, {**old, "muon_ns_coefficients": "quintic"}) == []
    adamw = {"optimizer": "adamw", "muon_ns_steps": 4}
    assert changed_settings(adamw, {**adamw, "muon_ns_coefficients": "polar_express"}) == []


@pytest.mark.slow
def test_resuming_a_checkpoint_from_before_the_setting(tmp_path: Path, shakespeare_shards: Path) -> None:
    """A nanochat + Muon checkpoint whose recorded config has no `muon_ns_coefficients` (as every one saved before
    it): `--resume auto` goes on with Polar Express and says the change."""
    run = tmp_path / "run"
    args = ["--arch", "nanochat", "--optimizer", "muon", "--n_layer", "1", "--n_head", "2", "--n_embd", "32"]
    args += ["--seq_len", "32", "--micro_batch_size", "2", "--total_batch_size", "64", "--eval_every", "0"]
    args += ["--save_every", "2", "--sample_tokens", "0", "--log_with", "none"]
    args += ["--data_dir", str(shakespeare_shards), "--out_dir", str(run)]
    run_cmd(python_cmd("train", *args, "--max_steps", "2"))
    checkpoint = run / "checkpoints" / "step_00000002"
    state = torch.load(checkpoint / TRAIN_STATE_FILE, weights_only=True)
    config = json.loads(state["config_json"])
    assert config.pop("muon_ns_coefficients") == "polar_express"
    torch.save({**state, "config_json": json.dumps(config)}, checkpoint / TRAIN_STATE_FILE)
    marker = json.loads((checkpoint / "COMPLETE").read_text())  # the checksum it would have been saved with
    marker["sha256"][TRAIN_STATE_FILE] = hashlib.sha256((checkpoint / TRAIN_STATE_FILE).read_bytes()).hexdigest()
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    proc = run_cmd(python_cmd("train", *args, "--max_steps", "3", "--resume", "auto"))
    assert "resume: muon_ns_coefficients quintic -> polar_express" in proc.stderr, proc.stderr[-2000:]
    assert "finished at step 3/3" in proc.stderr
