"""Learning-rate schedules: values worked out by hand at their boundaries, and horizons that can be extended.

Every case below uses learning_rate 1, warmup_steps 2 and min_lr_ratio 0.1, so a multiplier is the rate.
`lr_multiplier(k)` is the rate of the update of step k (0-based); metrics row k+1 logs it.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import python_cmd, run_cmd, write_token_shards
from safetensors.torch import load_file

from accel_gpt.config import TrainConfig
from accel_gpt.errors import ConfigError
from accel_gpt.optim import (
    MuonAdamW,
    apply_settings,
    can_skip_steps,
    lr_multiplier,
    make_optimizer,
    make_scheduler,
    schedule_horizon,
    schedule_moved,
)


def cfg(**overrides: object) -> TrainConfig:
    base = {"data_dir": "unused", "learning_rate": 1.0, "warmup_steps": 2, "min_lr_ratio": 0.1, "max_steps": 10}
    return TrainConfig(**(base | overrides))


def rates(c: TrainConfig, steps: list[int]) -> list[float]:
    return [lr_multiplier(k, c) for k in steps]


def test_cosine_by_hand() -> None:
    """Warm-up 1/2, 2/2; the cosine over the 8 steps 2..9: 0.1 + 0.45 * (1 + cos(pi * (k - 2) / 8)); 0.1 from 10."""
    c = cfg(lr_schedule="cosine")
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.8681980515, 6: 0.55, 9: 0.1342542104, 10: 0.1, 15: 0.1}
    assert rates(c, list(expected)) == pytest.approx(list(expected.values()), abs=1e-9)


def test_cosine_is_the_former_schedule_exactly() -> None:
    """The default is what the trainer did before schedules could be chosen, to the last bit."""

    def former(step: int, warmup: int, max_steps: int, floor: float) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step >= max_steps:
            return floor
        progress = (step - warmup) / max(1, max_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    for warmup, max_steps, floor in [(2, 10, 0.1), (715, 19_073, 0.1), (0, 7, 0.0), (5, 5, 0.3), (9, 4, 0.1)]:
        c = cfg(warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=floor)
        for step in range(0, max_steps + 3, max(1, max_steps // 200)):
            assert lr_multiplier(step, c) == former(step, warmup, max_steps, floor), (warmup, max_steps, step)


def test_linear_by_hand() -> None:
    """From 1 at step 2 down by 0.9 / 8 per step: 0.775 at 4, 0.55 at 6, 0.2125 at 9, the floor 0.1 from 10."""
    c = cfg(lr_schedule="linear")
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 3: 0.8875, 4: 0.775, 6: 0.55, 9: 0.2125, 10: 0.1, 20: 0.1}
    assert rates(c, list(expected)) == pytest.approx(list(expected.values()), abs=1e-12)


def test_wsd_by_hand() -> None:
    """decay_fraction 0.2 of a 10-step horizon: 2 decay steps starting at 8 (1, then 0.55), the floor from 10."""
    c = cfg(lr_schedule="wsd", decay_fraction=0.2)
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 5: 1.0, 7: 1.0, 8: 1.0, 9: 0.55, 10: 0.1, 11: 0.1}
    assert rates(c, list(expected)) == pytest.approx(list(expected.values()), abs=1e-12)


def test_wsd_decay_length_rounds_half_up_and_never_starts_inside_warm_up() -> None:
    """0.25 of 10 is 2.5 -> 3 decay steps from 7 (1, 0.7, 0.4). With warm-up 5, half of 6 steps would start the
    decay at 3: it starts when warm-up ends (5), and step 5 is the peak."""
    c = cfg(lr_schedule="wsd", decay_fraction=0.25)
    assert rates(c, [6, 7, 8, 9, 10]) == pytest.approx([1.0, 1.0, 0.7, 0.4, 0.1], abs=1e-12)
    c = cfg(lr_schedule="wsd", decay_fraction=0.5, warmup_steps=5, max_steps=6)
    assert rates(c, [3, 4, 5, 6]) == pytest.approx([0.8, 1.0, 1.0, 0.1], abs=1e-12)


def test_constant_by_hand() -> None:
    """Warm-up, then the peak for ever: min_lr_ratio and the horizon do not apply."""
    c = cfg(lr_schedule="constant", schedule_steps=4)
    assert rates(c, [0, 1, 2, 4, 10, 1000]) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_the_horizon_not_max_steps_shapes_the_schedule(kind: str) -> None:
    """A run that stops at step 4 of an 8-step horizon gets the rates of the 8-step run's first 4 updates; a
    horizon shorter than max_steps leaves the steps past it at the floor."""
    part, whole = cfg(lr_schedule=kind, max_steps=4, schedule_steps=8), cfg(lr_schedule=kind, max_steps=8)
    assert schedule_horizon(part) == schedule_horizon(whole) == 8
    assert rates(part, list(range(12))) == rates(whole, list(range(12)))
    short = cfg(lr_schedule=kind, max_steps=12, schedule_steps=6)
    assert rates(short, [6, 9, 11]) == ([1.0] * 3 if kind == "constant" else [0.1] * 3)


def test_wsd_horizon_extended_from_the_stable_phase() -> None:
    """Steps 0..5 of wsd are the same for an 8-step and a 12-step horizon (decay_fraction 0.25: 2 and 3 decay
    steps); after that each follows its own horizon."""
    short = cfg(lr_schedule="wsd", decay_fraction=0.25, max_steps=8)
    long = cfg(lr_schedule="wsd", decay_fraction=0.25, max_steps=12)
    assert rates(short, list(range(6))) == rates(long, list(range(6)))
    assert rates(short, [6, 7, 8]) == pytest.approx([1.0, 0.55, 0.1])
    assert rates(long, [6, 8, 9, 10, 11, 12]) == pytest.approx([1.0, 1.0, 1.0, 0.7, 0.4, 0.1])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lr_schedule": "cosin"}, "did you mean cosine"),
        ({"schedule_steps": -1}, "schedule_steps=-1 must be in [0, 1e12]"),
        ({"decay_fraction": 0.0}, "decay_fraction=0.0 must be in (0, 1]"),
        ({"decay_fraction": 1.5}, "decay_fraction=1.5 must be in (0, 1]"),
    ],
)
def test_schedule_settings_are_validated(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg(**overrides)


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_resumed_schedule_takes_the_rate_from_this_runs_config() -> None:
    """Loading a saved schedule keeps only its step: the rate comes from the config the run resumes with (a new
    horizon or learning_rate applies to the first resumed update), and is bit-identical when nothing changed."""
    old = cfg(lr_schedule="wsd", max_steps=4, schedule_steps=8, decay_fraction=0.25, learning_rate=1e-3)
    opt = _optimizer(old.learning_rate)
    sched = make_scheduler(opt, old)
    for _ in range(7):
        opt.step()
        sched.step()
    saved_opt, saved_sched, saved_lr = opt.state_dict(), sched.state_dict(), sched.get_last_lr()
    assert saved_lr == [1e-3 * 0.55]  # step 7 of the 8-step horizon: half-way down its 2 decay steps

    same_opt = _optimizer(old.learning_rate)
    same = make_scheduler(same_opt, old)
    same_opt.load_state_dict(saved_opt)
    same.load_state_dict(saved_sched)
    assert same.get_last_lr() == saved_lr and same_opt.param_groups[0]["lr"] == saved_lr[0]

    new = cfg(lr_schedule="wsd", max_steps=12, schedule_steps=12, decay_fraction=0.25, learning_rate=2e-3)
    new_opt = _optimizer(new.learning_rate)
    resumed = make_scheduler(new_opt, new)
    new_opt.load_state_dict(saved_opt)  # Accelerate loads the optimizer first, then the scheduler
    resumed.load_state_dict(saved_sched)
    assert resumed.last_epoch == 7
    assert resumed.get_last_lr() == [2e-3] and new_opt.param_groups[0]["lr"] == 2e-3  # stable in the 12-step one
    for step in (8, 9, 10):
        new_opt.step()
        resumed.step()
        assert resumed.get_last_lr() == [2e-3 * lr_multiplier(step, new)]
    assert resumed.get_last_lr() == pytest.approx([2e-3 * 0.7])


# ------------------------------------------------------------------------------------------ real runs

VOCAB = 256
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
COMMON = [
    *TINY,
    *("--learning_rate", "1e-3", "--warmup_steps", "2", "--seed", "7", "--micro_batch_size", "2"),
    *("--total_batch_size", "64", "--eval_every", "0", "--log_every", "1", "--sample_tokens", "0"),
    *("--log_with", "none", "--keep_checkpoints", "0"),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens = np.random.default_rng(0).integers(0, VOCAB, 20_000).tolist()
    return write_token_shards(tmp_path_factory.mktemp("optim") / "data", tokens, vocab_size=VOCAB)


def _train(out: Path, data: Path, *flags: str) -> str:
    """The run's stderr (its log)."""
    cmd = python_cmd("train", *COMMON, "--data_dir", str(data), "--out_dir", str(out), *flags)
    return run_cmd(cmd, timeout=600).stderr


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_run_stopped_inside_its_horizon_then_continued_equals_one_straight_run(tmp_path: Path, data: Path) -> None:
    """`--max_steps 4 --schedule_steps 8`, resumed with `--max_steps 8 --schedule_steps 8`: the same 8 steps as
    one 8-step run, bit for bit (weights, losses, rates)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(straight, data, "--max_steps", "8", "--schedule_steps", "8", "--save_every", "0")
    _train(split, data, "--max_steps", "4", "--schedule_steps", "8", "--save_every", "4")
    log = _train(split, data, "--max_steps", "8", "--schedule_steps", "8", "--save_every", "4", "--resume", "auto")
    assert "resume: max_steps 4 -> 8" in log and "schedule changed" not in log  # the rates go on as they were
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = _rows(straight), _rows(split)
    assert [r["step"] for r in rb] == list(range(1, 9))
    assert [(r["loss"], r["lr"]) for r in ra] == [(r["loss"], r["lr"]) for r in rb]


@pytest.mark.slow
def test_wsd_run_stopped_in_its_stable_phase_continues_on_a_longer_horizon(tmp_path: Path, data: Path) -> None:
    """wsd over 8 steps, stopped at step 4 (stable), continued to 12 with a 12-step horizon: rows 1-4 have the
    rates of the first horizon, rows 5-12 those of the new one (below the peak at steps 10-11, not 7)."""
    out = tmp_path / "wsd"
    flags = ["--lr_schedule", "wsd", "--decay_fraction", "0.25", "--save_every", "4"]
    _train(out, data, *flags, "--max_steps", "4", "--schedule_steps", "8")
    _train(out, data, *flags, "--max_steps", "12", "--schedule_steps", "12", "--resume", "auto")
    new = TrainConfig(
        data_dir="x", learning_rate=1e-3, warmup_steps=2, lr_schedule="wsd", decay_fraction=0.25, max_steps=12
    )
    logged = [r["lr"] for r in _rows(out)]
    assert logged == pytest.approx([1e-3 * lr_multiplier(k, new) for k in range(12)], rel=1e-12)
    assert logged[4:] == pytest.approx([1e-3] * 6 + [7e-4, 4e-4], rel=1e-9)


@pytest.mark.slow
def test_a_longer_run_resumed_says_its_rate_jumps_back_up(tmp_path: Path, data: Path) -> None:
    """A finished 4-step cosine run resumed with --max_steps 6: the cosine now ends at step 6, so step 5 updates
    well above the floor that step 4 reached; the log says so, with the flag that keeps the old horizon."""
    out = tmp_path / "run"
    _train(out, data, "--max_steps", "4", "--save_every", "4")
    log = _train(out, data, "--max_steps", "6", "--save_every", "4", "--resume", "auto")
    before, now = (1e-3 * lr_multiplier(4, TrainConfig(data_dir="x", warmup_steps=2, max_steps=n)) for n in (4, 6))
    assert now > 5 * before
    assert (
        f"resume: the learning-rate schedule changed: step 5 updates at {now:.3g}, where the checkpoint's schedule "
        f"gave {before:.3g} (--schedule_steps 4 keeps its horizon: past step 4 the rate stays at the floor)"
    ) in log
    assert _rows(out)[4]["lr"] == pytest.approx(now, rel=1e-12)


def test_a_time_budget_dropped_or_changed_at_resume_says_its_rate_jump() -> None:
    """A budget's horizon is its clock's: 60 s at 1 s a step, 59 of them spent at step 58, ends at step 60 (the
    first step of a start is not counted). Continued by steps, or with another budget, the next rate is what that
    schedule gives, said as for a run by steps; the same budget resumed says nothing."""
    saved = {"max_steps": 100_000, "warmup_steps": 2, "time_budget": "60"}
    record = {"budget_spent": 59.0, "budget_per_step": 1.0}
    budgeted = TrainConfig(data_dir="x", learning_rate=1e-3, **saved)
    assert schedule_moved(budgeted, saved, 58, record) is None
    floor = 1e-3 * lr_multiplier(58, budgeted, 60.0)
    by_steps = TrainConfig(data_dir="x", learning_rate=1e-3, warmup_steps=2, max_steps=232)
    now = 1e-3 * lr_multiplier(58, by_steps)
    assert now > 5 * floor
    assert schedule_moved(by_steps, saved, 58, record) == (
        f"resume: the learning-rate schedule changed: step 59 updates at {now:.3g}, where the checkpoint's schedule "
        f"gave {floor:.3g} (--schedule_steps 60 keeps its horizon: past step 60 the rate stays at the floor)"
    )
    longer = TrainConfig(data_dir="x", learning_rate=1e-3, **(saved | {"time_budget": "2m"}))
    moved = schedule_moved(longer, saved, 58, record)
    assert moved == (
        f"resume: the learning-rate schedule changed: step 59 updates at "
        f"{1e-3 * lr_multiplier(58, longer, 120.0):.3g}, where the checkpoint's schedule gave {floor:.3g}"
    )
    steps_then_budget = schedule_moved(budgeted, {"max_steps": 4, "warmup_steps": 2}, 4, {})
    assert steps_then_budget is not None and "step 5 updates at" in steps_then_budget  # the clock's first horizon


# ------------------------------------------------------------------------------------------ Muon + AdamW


def tiny_gpt(**overrides: object) -> torch.nn.Module:
    from accel_gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**({"n_layer": 2, "n_head": 2, "n_embd": 16, "seq_len": 8, "vocab_size": 64} | overrides)))


def muon_cfg(**overrides: object) -> TrainConfig:
    return cfg(optimizer="muon", learning_rate=1e-3, muon_lr=0.02, max_steps=20, **overrides)


def test_muon_takes_the_block_matrices_and_adamw_the_rest() -> None:
    model = tiny_gpt()
    optimizer = make_optimizer(model, muon_cfg(), "cpu")
    assert isinstance(optimizer, MuonAdamW) and isinstance(optimizer.muon, torch.optim.Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in optimizer.muon.param_groups for p in g["params"])
    adamw = sorted(names[id(p)] for g in optimizer.adamw.param_groups for p in g["params"])
    matrices = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    assert muon == sorted(f"transformer.h.{i}.{m}" for i in range(2) for m in matrices)
    assert "transformer.wte.weight" in adamw and "transformer.wpe.weight" in adamw  # the tied head is wte
    assert sorted(muon + adamw) == sorted(names.values()), "every parameter exactly once"
    assert optimizer.adamw.param_groups[0]["fused"] and optimizer.param_groups[0] is optimizer.adamw.param_groups[0]
    assert can_skip_steps(optimizer)


def test_the_schedule_scales_both_optimizers_by_the_same_factor() -> None:
    optimizer = make_optimizer(tiny_gpt(), muon_cfg(), "cpu")
    scheduler = make_scheduler(optimizer, muon_cfg())
    for step in range(6):
        factor = lr_multiplier(step, muon_cfg())
        adamw, muon = optimizer.adamw.param_groups, optimizer.muon.param_groups
        assert [g["lr"] for g in adamw] == pytest.approx([1e-3 * factor] * 2, rel=1e-12)
        assert [g["lr"] for g in muon] == pytest.approx([0.02 * factor], rel=1e-12)
        assert scheduler.get_last_lr()[0] == adamw[0]["lr"], "the logged rate is AdamW's"
        optimizer.step()
        scheduler.step()


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x = torch.randint(0, 64, (4, 8), generator=generator)
        _, loss = model(x, x.roll(1, dims=1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def test_muon_state_round_trips_and_continues_bit_identically() -> None:
    """3 steps, then the state (weights, both optimizers, schedule) into fresh objects: 3 more steps there equal 3
    more steps of the original, bit for bit."""
    c = muon_cfg()
    model = tiny_gpt()
    optimizer = make_optimizer(model, c, "cpu")
    scheduler = make_scheduler(optimizer, c)
    train_steps(model, optimizer, scheduler, range(3))
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), scheduler.state_dict()))
    assert set(saved[1]) == {"adamw", "muon"} and len(saved[1]["muon"]["state"]) == 8
    train_steps(model, optimizer, scheduler, range(3, 6))

    other = tiny_gpt()
    other.load_state_dict(saved[0])
    other_opt = make_optimizer(other, c, "cpu")
    other_sched = make_scheduler(other_opt, c)
    other_opt.load_state_dict(saved[1])
    other_sched.load_state_dict(saved[2])
    train_steps(other, other_opt, other_sched, range(3, 6))
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="not a Muon"):
        other_opt.load_state_dict(torch.optim.AdamW(tiny_gpt().parameters()).state_dict())


def test_resume_settings_reach_each_optimizer_and_only_its_own_groups() -> None:
    optimizer = make_optimizer(tiny_gpt(), muon_cfg(), "cpu")
    config = muon_cfg(weight_decay=0.3, beta2=0.9, muon_momentum=0.8, muon_weight_decay=0.05).to_dict()
    config["muon_adjust_lr_fn"], config["muon_ns_steps"] = "match_rms_adamw", 3
    apply_settings(optimizer, config)
    decayed, plain = optimizer.adamw.param_groups
    assert decayed["weight_decay"] == 0.3 and plain["weight_decay"] == 0.0 and decayed["betas"] == (0.9, 0.9)
    (muon,) = optimizer.muon.param_groups
    assert (muon["momentum"], muon["weight_decay"], muon["adjust_lr_fn"]) == (0.95, 0.05, "match_rms_adamw")
    assert muon["ns_steps"] == 3
    assert "betas" not in muon
    make_scheduler(optimizer, muon_cfg(muon_momentum=0.8))  # the momentum is the schedule's, from this run's config
    assert muon["momentum"] == 0.8


def test_muon_refusals_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ({"muon_lr": 0.0}, {"muon_momentum": 1.0}, {"muon_weight_decay": -0.1}, {"dropout": 1.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            cfg(**bad)
    with pytest.raises(ConfigError, match=r"optimizer='sgd' is not one of adamw, muon"):
        cfg(optimizer="sgd")
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match=r"optimizer=muon needs torch.optim.Muon \(torch >= 2.9\)"):
        make_optimizer(tiny_gpt(), muon_cfg(), "cpu")
