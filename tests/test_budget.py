"""`--time_budget`: the steps' own time, agreed by every rank, with the schedule following it and a resume that
continues what is left. The 2-process runs read a clock the test sets (`tests/workers/budget_clock.py`): each step
takes exactly 0.25 s on rank 0 and 0.5 s on rank 1, so the number of steps is exact and only agreeing on rank 0's
clock keeps the ranks together."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from conftest import accelerate_cmd, python_cmd, run_cmd, write_token_shards

import accel_gpt.budget as budget
from accel_gpt.budget import TimeBudget, parse_duration
from accel_gpt.config import TrainConfig
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.optim import lr_multiplier, warmup_length

WORKER = "tests/workers/budget_clock.py"
VOCAB = 256
FLAGS = [
    *("--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)),
    *("--micro_batch_size", "2", "--total_batch_size", "64", "--max_steps", "1000", "--warmup_steps", "2"),
    *("--learning_rate", "1e-3", "--log_every", "1", "--eval_every", "0", "--sample_tokens", "0"),
    *("--log_with", "none", "--time_budget", "2s"),
]


@pytest.mark.parametrize(
    ("text", "seconds"), [("300", 300.0), ("300s", 300.0), ("5m", 300.0), ("1.5h", 5400.0), (" 2M ", 120.0)]
)
def test_a_budget_is_seconds_or_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "must be a positive, finite duration"),
        ("0m", "must be a positive, finite duration"),
        ("nan", "is not a duration"),
        ("inf", "is not a duration"),
        ("-5", "must be a positive, finite duration"),
        ("5 minutes", "is not a duration"),
        ("1e999", "must be a positive, finite duration"),
    ],
)
def test_a_bad_budget_is_one_line(text: str, message: str, capsys) -> None:
    from accel_gpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--data_dir", "d", "--time_budget", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: time_budget={text!r} {message}" + err[0].split(message, 1)[1]], err


def ticking(monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    """Each reading of the budget's clock is `step` seconds after the last: a step takes exactly that long."""
    ticks = itertools.count()
    monkeypatch.setattr(budget, "clock", lambda: next(ticks) * step)


def steps_until_done(clock: TimeBudget) -> int:
    steps = 0
    while not clock.done:
        clock.begin_step()
        steps += 1
        clock.end_step(steps)
    return steps


def test_the_first_step_is_not_counted_and_a_resume_counts_what_is_left(monkeypatch) -> None:
    import torch

    ticking(monkeypatch, 0.25)
    assert steps_until_done(TimeBudget(2.0, torch.device("cpu"), 1)) == 1 + 8
    resumed = TimeBudget(2.0, torch.device("cpu"), 1)
    resumed.resume({"budget_spent": 1.5, "budget_per_step": 0.25}, 7)
    assert steps_until_done(resumed) == 1 + 2


def test_the_horizon_is_where_the_budget_ends(monkeypatch) -> None:
    """After k counted steps of 0.25 s of a 2 s budget, the schedule's horizon is the step the budget ends at."""
    import torch

    ticking(monkeypatch, 0.25)
    clock = TimeBudget(2.0, torch.device("cpu"), 1)
    assert clock.horizon() is None
    for step in range(1, 9):
        clock.begin_step()
        clock.end_step(step)
        assert clock.horizon() == (None if step == 1 else 9), step
    cfg = TrainConfig(data_dir="d", max_steps=1000, warmup_steps=2, min_lr_ratio=0.1, vocab_size=VOCAB)
    assert lr_multiplier(9, cfg, clock.horizon()) == pytest.approx(0.1)
    assert lr_multiplier(5, cfg, 9.0) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))


def test_a_budget_shorter_than_one_step_is_one_line(monkeypatch) -> None:
    import torch

    ticking(monkeypatch, 0.25)
    with pytest.raises(UserError, match=r"time_budget=0.1s is less than one step \(0.25s here\)"):
        steps_until_done(TimeBudget(0.1, torch.device("cpu"), 1))


def test_no_budget_changes_nothing() -> None:
    import torch

    clock = TimeBudget(None, torch.device("cpu"), 1)
    clock.begin_step()
    clock.end_step(1)
    assert not clock.on and not clock.done and clock.horizon() is None and clock.summary() == ""
    with pytest.raises(ConfigError):
        TrainConfig(data_dir="d", time_budget="soon", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:20_000]]
    return write_token_shards(tmp_path_factory.mktemp("budget") / "data", tokens, vocab_size=VOCAB)


def budgeted(control: Path, data: Path, out: Path, die_at: int = 0, *extra: str, check: bool = True):
    control.mkdir(exist_ok=True)
    launch = accelerate_cmd(2, "x")[:-2]  # the launcher without "run.py x"
    args = [WORKER, str(control), "0.25", str(die_at) if die_at else "--", *(["--"] if die_at else [])]
    flags = ["train", *FLAGS, "--data_dir", str(data), "--out_dir", str(out), *extra]
    return run_cmd([*launch, *args, *flags], check=check, timeout=240)


def rates(control: Path) -> list[list[float]]:
    return [json.loads((control / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


def test_every_rank_follows_rank_0s_clock(tmp_path: Path, data: Path) -> None:
    """Rank 1's clock runs twice as fast; both ranks take rank 0's 1 + 8 steps with the same rates, those of a run
    of 9 steps by count (the decay follows the budget), and the run ends with its final weights and a line on the
    time counted."""
    proc = budgeted(tmp_path / "control", data, tmp_path / "run")
    assert "| 2 process(es) on cpu" in proc.stderr
    zero, one = rates(tmp_path / "control")
    assert zero == one and len(zero) == 9
    by_steps = TrainConfig(data_dir="d", max_steps=9, warmup_steps=2, vocab_size=VOCAB)
    assert zero == pytest.approx([1e-3 * lr_multiplier(u, by_steps) for u in range(9)], rel=1e-9)
    assert "time budget 2s: 2.0s of step time counted (8 steps this start)" in proc.stderr
    assert (tmp_path / "run" / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 9


def test_a_resume_after_a_kill_continues_the_budget(tmp_path: Path, data: Path) -> None:
    """Killed before step 6 (checkpoints every step: step 5's holds 1.0 s spent), the resume counts the 1.0 s
    left: its own first step is not counted, so it ends at step 10, not 9, and not 5 + 9; its rates are those of a
    10-step run from the first update on (the checkpoint holds the time per step)."""
    control = tmp_path / "control"
    killed = budgeted(control, data, tmp_path / "run", 6, "--save_every", "1", check=False)
    assert killed.returncode != 0 and (control / "died_0").exists()
    proc = budgeted(control, data, tmp_path / "run", 0, "--save_every", "1", "--resume", "auto")
    zero, one = rates(control)
    assert zero == one and len(zero) == 5  # steps 6..10
    by_steps = TrainConfig(data_dir="d", max_steps=10, warmup_steps=2, vocab_size=VOCAB)
    assert zero == pytest.approx([1e-3 * lr_multiplier(u, by_steps) for u in range(5, 10)], rel=1e-9)
    assert "time budget 2s: 2.0s of step time counted (4 steps this start)" in proc.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 10


def test_a_finished_budget_continued_by_steps_says_its_rate_jump(tmp_path: Path, data: Path) -> None:
    """The budget ended the run at its floor at step 9; `--resume auto --max_steps 36` with no budget moves the
    horizon to 36, so step 10 updates near the peak again: the resume says that, and that the budget is gone."""
    budgeted(tmp_path / "control", data, tmp_path / "run")
    flags = [f for f in FLAGS if f not in ("--time_budget", "2s")]
    flags = [*flags, "--data_dir", str(data), "--out_dir", str(tmp_path / "run"), "--resume", "auto"]
    proc = run_cmd(python_cmd("train", *flags, "--max_steps", "36"))
    # the budget's own schedule, resumed: its clock ends it at step 10 (the coming first step is not counted)
    floor = 1e-3 * lr_multiplier(9, TrainConfig(data_dir="d", max_steps=10, warmup_steps=2, vocab_size=VOCAB))
    now = 1e-3 * lr_multiplier(9, TrainConfig(data_dir="d", max_steps=36, warmup_steps=2, vocab_size=VOCAB))
    assert "resume: time_budget 2s -> none" in proc.stderr
    assert (
        f"resume: the learning-rate schedule changed: step 10 updates at {now:.3g}, where the checkpoint's schedule "
        f"gave {floor:.3g} (--schedule_steps 10 keeps its horizon" in proc.stderr
    ), proc.stderr[-3000:]


def test_a_budget_shorter_than_a_step_leaves_nothing_that_refuses_its_advice(tmp_path: Path, data: Path) -> None:
    """The refusal comes after the first counted step (the run had claimed its folder and logged a row): its files
    are taken back, so the longer budget the error advises runs (before: "holds another run"); files of the user's in
    the folder stay."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    flags = [f for f in FLAGS if f not in ("--time_budget", "2s")] + ["--data_dir", str(data), "--out_dir", str(out)]
    refused = run_cmd(python_cmd("train", *flags, "--max_steps", "3", "--time_budget", "0.001"), check=False)
    assert refused.returncode == 2 and "is less than one step" in refused.stderr.splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.txt"]
    proc = run_cmd(python_cmd("train", *flags, "--max_steps", "3", "--time_budget", "10m"))
    assert "finished at step 3/3" in proc.stderr and (out / "notes.txt").read_text() == "mine"


def test_a_budget_that_ends_in_the_warm_up_says_so_once(tmp_path: Path, data: Path) -> None:
    """9 steps fit the budget, the warm-up is 20: after the first counted step rank 0 warns (once, not per rank)."""
    proc = budgeted(tmp_path / "control", data, tmp_path / "run", 0, "--warmup_steps", "20")
    assert "| 2 process(es) on cpu" in proc.stderr
    warning = "time_budget=2s: at 0.25s per step it ends near step 9, inside the 20 warm-up steps, so the learning"
    assert proc.stderr.count(warning) == 1, proc.stderr[-3000:]
    assert "time_budget" not in budgeted(tmp_path / "control2", data, tmp_path / "run2").stderr.split("finished")[0]


def test_max_steps_still_caps_a_budget(tmp_path: Path, data: Path) -> None:
    """An hour's budget and 3 steps: the run ends at step 3 with its final weights, and says what it counted."""
    flags = [*FLAGS, "--time_budget", "1h", "--max_steps", "3", "--data_dir", str(data), "--out_dir", str(tmp_path)]
    proc = run_cmd(python_cmd("train", *flags))
    assert "finished at step 3/3" in proc.stderr and "time budget 3600s: " in proc.stderr
    assert (tmp_path / "model.safetensors").is_file()


# ------------------------------------------------------------------------------- schedules that follow the budget


def test_a_budgets_warm_up_is_a_fraction_of_its_horizon_unless_steps_are_given() -> None:
    """warmup_steps unset: 715 steps without a budget; with one, warmup_fraction of the horizon (the step cap
    until a step is timed, so the first updates take the smallest rates). Given steps stay steps."""
    assert TrainConfig(data_dir="d", vocab_size=VOCAB).warmup_steps == 715
    cfg = TrainConfig(data_dir="d", max_steps=1000, time_budget="2s", vocab_size=VOCAB)
    assert cfg.warmup_steps is None and cfg.warmup_fraction == 0.05
    assert warmup_length(cfg) == 50 and warmup_length(cfg, 40.0) == 2.0
    assert lr_multiplier(0, cfg) == pytest.approx(1 / 50)
    assert [lr_multiplier(u, cfg, 40.0) for u in range(3)] == pytest.approx([0.5, 1.0, 1.0])
    steps = TrainConfig(data_dir="d", max_steps=1000, time_budget="2s", warmup_steps=20, vocab_size=VOCAB)
    assert warmup_length(steps, 40.0) == 20 and lr_multiplier(9, steps, 40.0) == pytest.approx(0.5)


@pytest.mark.parametrize("horizon", [12, 36, 400, 5000])
def test_a_budgeted_schedule_peaks_early_and_ends_near_its_floor(horizon: int) -> None:
    """The rates of a budget that fits `horizon` steps, its horizon known from the third update on (the first
    step is not timed): the peak within the first 30% of the steps, the last rate at most 0.2x the peak."""
    cfg = TrainConfig(data_dir="d", max_steps=100_000, time_budget="1h", vocab_size=VOCAB)
    rates = [lr_multiplier(u, cfg, None if u < 3 else float(horizon)) for u in range(horizon)]
    assert rates.index(max(rates)) <= 0.3 * horizon and max(rates) >= 0.9
    assert rates[-1] <= 0.2 * max(rates)


def without_warmup_steps(flags: list[str]) -> list[str]:
    """The flags less `--warmup_steps N`: the schedule's default under a budget."""
    i = flags.index("--warmup_steps")
    return flags[:i] + flags[i + 2 :]


def rates_of_a_budget(tmp_path: Path, data: Path, *extra: str, die_at: int = 0, check: bool = True):
    """A 2-process budgeted run on the test's clock (steps of 0.05 s, a 2 s budget: 1 + 40 steps) with the
    schedule's defaults, and the rates each rank used."""
    flags = without_warmup_steps(FLAGS)
    control = tmp_path / "control"
    control.mkdir(exist_ok=True)
    launch = accelerate_cmd(2, "x")[:-2]
    args = [WORKER, str(control), "0.05", str(die_at) if die_at else "--", *(["--"] if die_at else [])]
    train = ["train", *flags, "--data_dir", str(data), "--out_dir", str(tmp_path / "run"), *extra]
    proc = run_cmd([*launch, *args, *train], check=check, timeout=240)
    return proc, rates(control)


def test_a_budgeted_run_with_default_settings_peaks_early_and_ends_at_its_floor(tmp_path: Path, data: Path) -> None:
    proc, (zero, one) = rates_of_a_budget(tmp_path, data)
    assert zero == one and len(zero) in (41, 42), proc.stderr[-2000:]  # 40 x 0.05 s may fall short of 2 s by round-off
    assert zero.index(max(zero)) <= 0.3 * len(zero) and max(zero) >= 0.99e-3
    assert zero[-1] <= 0.2 * max(zero)
    assert "warm-up steps" not in proc.stderr  # no warning of a budget inside its warm-up


def test_a_budgeted_resume_keeps_its_fractions(tmp_path: Path, data: Path) -> None:
    """Killed before step 6 and resumed, a budget whose warm-up is 80% of its horizon goes on warming up over 80%
    of the horizon the checkpoint's time per step gives (10 steps: the resume's first step is not counted)."""
    frac = ("--warmup_fraction", "0.8", "--save_every", "1", "--time_budget", "2s")
    control = tmp_path / "control"
    control.mkdir()
    launch = accelerate_cmd(2, "x")[:-2]
    flags = without_warmup_steps(FLAGS)
    train = ["train", *flags, *frac, "--data_dir", str(data), "--out_dir", str(tmp_path / "run")]
    killed = run_cmd([*launch, WORKER, str(control), "0.25", "6", "--", *train], check=False, timeout=240)
    assert killed.returncode != 0 and (control / "died_0").exists()
    run_cmd([*launch, WORKER, str(control), "0.25", "--", *train, "--resume", "auto"], timeout=240)
    zero, one = rates(control)
    assert zero == one and len(zero) == 5  # steps 6..10
    cfg = TrainConfig(data_dir="d", max_steps=1000, time_budget="2s", warmup_fraction=0.8, vocab_size=VOCAB)
    assert zero == pytest.approx([1e-3 * lr_multiplier(u, cfg, 10.0) for u in range(5, 10)], rel=1e-9)
    assert zero[:2] == pytest.approx([1e-3 * 6 / 8, 1e-3 * 7 / 8])  # still warming up, over 8 steps
