"""The loss-spike guard: the outlier rule by hand, a skipped step changes no weight or optimizer state while the
schedule advances, and real runs (fp32 on CPU): a planted outlier batch is skipped, the same at W=1 and W=2, exactly
across a stop and `--resume auto`, nothing is skipped on clean data, and a run whose every step is an outlier stops.

The planted batch: the data's token ids are folded into [0, 200) of a 256-id vocabulary, and the 4 windows that the
seeded stream gives step `PLANTED` are overwritten with id 255, which the model never sees otherwise; its loss on
them is far above the window (it has learnt to give unseen ids almost no probability).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import accelerate_cmd, python_cmd, run_cmd, write_token_shards
from safetensors.torch import load_file

from accel_gpt.checkpoint import saved_state
from accel_gpt.config import TrainConfig
from accel_gpt.data.loader import WindowSampler
from accel_gpt.errors import ConfigError
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.optim import make_optimizer, make_scheduler
from accel_gpt.spike import SpikeGuard, check_can_skip, optimizer_step

CPU = torch.device("cpu")


def guard(window: int = 16, loss_z: float = 0.0, grad_z: float = 0.0) -> SpikeGuard:
    cfg = TrainConfig(data_dir="unused", spike_loss_zscore=loss_z, spike_grad_zscore=grad_z, spike_window=window)
    return SpikeGuard(cfg, CPU)


def check(g: SpikeGuard, loss: float, grad_norm: float) -> bool:
    """Whether the guard skips the step or scales its gradient."""
    skip, bound = g.check(torch.tensor(loss), torch.tensor(grad_norm))
    return bool(skip) or bool(bound < grad_norm)


# ------------------------------------------------------------------------------------------ the rule


def test_outlier_rule_by_hand() -> None:
    """Grad norms 1, 3, 1, 3, ... have mean 2 and standard deviation 1: with z = 2, 4.0 lies exactly 2 std above
    (applied: the rule is "more than"), 4.01 beyond (skipped). The loss test is off, so no loss is an outlier."""
    g = guard(grad_z=2.0)
    assert not any(check(g, 3.0, 1.0 + 2.0 * (i % 2)) for i in range(16))
    history = g.state_dict()
    assert not check(g, 1e6, 4.0)
    g.load_state_dict(history)
    assert check(g, 3.0, 4.01)
    assert int(g.count) == 17, "a skipped step's values enter the window too (llm.c, OLMo)"
    assert not check(g, 3.0, math.nan), "a NaN is no outlier (the run's divergence check stops it)"


def test_a_lone_spike_is_skipped_once_and_a_new_level_is_taken_in() -> None:
    """A bad batch among steady steps is skipped, and the next steady step is applied. A lasting jump of the loss
    (weights an update broke, which the next updates repair) is skipped for a few steps, then judged against itself
    and applied: the guard cannot hold a run in a streak of skips (a window of applied steps only did)."""
    steady = [4.0 + 0.01 * ((i * 7) % 5) for i in range(40)]
    lone, shifted = guard(window=128, loss_z=6.0), guard(window=128, loss_z=6.0)
    assert not any(check(g, loss, 1.0) for loss in steady for g in (lone, shifted))
    assert check(lone, 9.0, 1.0) and not check(lone, 4.02, 1.0)
    level = [check(shifted, 6.0 + 0.01 * (i % 3), 1.0) for i in range(20)]
    assert level[0] and sum(level) <= 3 and not any(level[level.index(False) :]), level


def test_nothing_is_judged_before_the_window_holds_16_values() -> None:
    g = guard(loss_z=1.0)
    assert not any(check(g, 2.0, 1.0) for _ in range(15))
    assert not check(g, 1e3, 1.0), "the 16th step is only recorded"
    assert check(g, 1e4, 1.0), "from the 17th on, steps are judged (1e4 is far above 15 x 2.0 and 1e3)"


def test_window_keeps_the_last_steps_and_its_state_round_trips() -> None:
    """20 steps through a 16-slot window keep steps 5..20; the state survives JSON (as in a checkpoint) bit for bit;
    a resume under a larger window gets them oldest first, under a smaller one the newest."""
    g = guard(window=16, loss_z=3.0)
    for i in range(1, 21):
        check(g, 2.0 + i / 64, 1.0)
    state = json.loads(json.dumps(g.state_dict()))
    same = guard(window=16, loss_z=3.0)
    same.load_state_dict(state)
    assert torch.equal(same.values, g.values) and int(same.count) == 20
    assert check(same, 9.0, 1.0) and check(g, 9.0, 1.0)
    larger, smaller = guard(window=32, loss_z=3.0), guard(window=16, loss_z=3.0)
    larger.load_state_dict(state)
    assert larger.values[:16, 0].tolist() == [2.0 + i / 64 for i in range(5, 21)] and int(larger.count) == 16
    assert not larger.values[16:].any()
    g32 = guard(window=32, loss_z=3.0)
    for i in range(1, 21):
        check(g32, 2.0 + i / 64, 1.0)
    smaller.load_state_dict(g32.state_dict())
    assert smaller.values[:, 0].tolist() == [2.0 + i / 64 for i in range(5, 21)] and int(smaller.count) == 16


def test_a_gradient_norm_far_above_the_window_is_scaled_to_its_bound_and_applied() -> None:
    """Norms 1, 3, 1, 3, ... (mean 2, std 1) and z = 2: a gradient of norm 8 is scaled to norm 4 (the bound), clipped
    to 5 first by grad_clip; the step is not skipped; an ordinary one is left as it is."""
    g = guard(grad_z=2.0)
    for i in range(16):
        g.check(torch.tensor(3.0), torch.tensor(1.0 + 2.0 * (i % 2)))
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([0.0, 5.0])  # clipped from norm 8 by grad_clip 5
    skip, clipped = g.apply(torch.tensor(3.0), torch.tensor(8.0), [param], 5.0)
    assert not skip and clipped and torch.allclose(param.grad, torch.tensor([0.0, 4.0]))
    param.grad = torch.tensor([0.0, 1.0])
    skip, clipped = g.apply(torch.tensor(3.0), torch.tensor(1.0), [param], 5.0)
    assert not skip and not clipped and torch.equal(param.grad, torch.tensor([0.0, 1.0]))


def optimizer_tensors(state_dict: dict) -> dict[str, torch.Tensor]:
    """Every tensor of an optimizer state (AdamW's, or Muon + AdamW's two), by a path name."""
    parts = state_dict.items() if "adamw" in state_dict else [("adamw", state_dict)]
    return {f"{part}/{i}/{k}": v for part, sd in parts for i, s in sd["state"].items() for k, v in s.items()}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_skipped_step_changes_no_weight_or_optimizer_state_while_the_schedule_advances(name: str) -> None:
    """Through the trainer's own optimizer (fused AdamW, two groups; or Muon on the block matrices + that AdamW)
    and schedule: after 16 ordinary steps, a step whose loss is an outlier leaves every parameter, moment, momentum
    buffer and step counter bit-identical while the learning rate moves on; the next ordinary step updates everything
    again."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=64))
    cfg = TrainConfig(
        data_dir="unused", learning_rate=1e-2, warmup_steps=2, max_steps=40, spike_loss_zscore=4.0, optimizer=name
    )
    optimizer, g = make_optimizer(model, cfg, "cpu"), SpikeGuard(cfg, CPU)
    scheduler = make_scheduler(optimizer, cfg)

    def step(loss: float) -> bool:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        skip, _ = g.apply(torch.tensor(loss), norm, list(model.parameters()), 0.0)
        optimizer_step(optimizer, skip)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return bool(skip)

    assert not any(step(3.0) for _ in range(16))
    params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer_tensors(optimizer.state_dict()))
    assert len(state) == (3 * 16 if name == "adamw" else 3 * 12 + 4)  # 16 tensors; Muon: a buffer for 4 matrices
    lr = scheduler.get_last_lr()
    assert step(30.0), "a loss 10x the usual is an outlier"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in params.items())
    after = optimizer_tensors(optimizer.state_dict())
    assert after.keys() == state.keys()
    assert all(torch.equal(value, after[key]) for key, value in state.items())
    assert scheduler.last_epoch == 17 and scheduler.get_last_lr() != lr
    assert not step(3.0)
    assert all(not torch.equal(v, model.state_dict()[k]) for k, v in params.items())
    after = optimizer_tensors(optimizer.state_dict())
    assert all(v.item() == 17 for k, v in after.items() if k.endswith("/step"))
    assert all(not torch.equal(value, after[key]) for key, value in state.items() if not key.endswith("/step"))


def test_guard_settings_are_validated() -> None:
    for bad in ({"spike_loss_zscore": -1.0}, {"spike_grad_zscore": "nan"}, {"spike_window": 8}):
        with pytest.raises(ConfigError):
            TrainConfig(data_dir="unused", **bad)


def test_guard_needs_fused_adamw_and_no_grad_scaler() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    check_can_skip(torch.optim.AdamW(params, fused=True), scaler=None)
    with pytest.raises(ConfigError, match="fused AdamW"):
        check_can_skip(torch.optim.AdamW(params, fused=False), scaler=None)
    with pytest.raises(ConfigError, match="fp16"):
        check_can_skip(torch.optim.AdamW(params, fused=True), scaler=torch.amp.GradScaler("cpu"))


# ------------------------------------------------------------------------------------------ real runs

VOCAB, SEQ, WINDOWS_PER_STEP, SEED = 256, 16, 4, 7
PLANTED = 24  # the 4 windows of this step are garbage; the window then holds 23 applied steps
FLAGS = [
    *("--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", str(SEQ), "--vocab_size", str(VOCAB)),
    *("--micro_batch_size", "2", "--total_batch_size", str(WINDOWS_PER_STEP * SEQ), "--seed", str(SEED)),
    *("--max_steps", "30", "--schedule_steps", "30", "--learning_rate", "1e-2", "--warmup_steps", "2"),
    *("--eval_every", "0", "--sample_tokens", "0", "--log_every", "5", "--log_with", "none"),
    *("--save_every", "10", "--keep_checkpoints", "0"),
]
GUARD = ("--spike_loss_zscore", "5")
NANOCHAT = ("--arch", "nanochat", "--optimizer", "muon", "--muon_momentum_warmup", "40")


def make_data(root: Path, shakespeare_tokens: list[int], planted: bool) -> Path:
    tokens = np.asarray([t % 200 for t in shakespeare_tokens[:40_000]])
    train = tokens[:36_000].copy()
    if planted:
        stream = iter(WindowSampler((len(train) - 1) // SEQ, SEED, start=(PLANTED - 1) * WINDOWS_PER_STEP))
        for window in [next(stream) for _ in range(WINDOWS_PER_STEP)]:
            train[window * SEQ : (window + 1) * SEQ + 1] = VOCAB - 1  # one shard: window i starts at token i*SEQ
    return write_token_shards(root, train.tolist(), tokens[36_000:].tolist(), vocab_size=VOCAB)


def train(processes: int, data: Path, out: Path, *extra: str, check: bool = True) -> Any:
    args = ["train", *FLAGS, "--data_dir", str(data), "--out_dir", str(out), *extra]
    proc = run_cmd(python_cmd(*args) if processes == 1 else accelerate_cmd(processes, *args), check=check)
    assert f"{processes} process(es) on cpu" in proc.stderr, proc.stderr[-4000:]
    return proc


def stopped_and_resumed(data: Path, out: Path) -> Path:
    """W=2 stopped after step 20 (its checkpoint holds a window of 20 applied steps), then `--resume auto` to 30;
    a copy of the stopped run is kept for `broken`."""
    train(2, data, out, *GUARD, "--max_steps", "20")
    shutil.copytree(out, out.with_name("stopped-at-20"))
    train(2, data, out, *GUARD, "--resume", "auto")
    return out


def broken(data: Path, root: Path, after: Path) -> Any:
    """The step-20 checkpoint resumed with a learning rate of 1: its first update breaks the weights, and every later
    loss lies far above the window's."""
    out = root / "broken"
    shutil.copytree(after, out)
    extra = ("--resume", "auto", "--learning_rate", "1", "--lr_schedule", "constant", "--max_steps", "60")
    return train(1, data, out, *GUARD, *extra, check=False), out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("spike")
    clean, planted = (make_data(root / name, shakespeare_tokens, name == "planted") for name in ("clean", "planted"))
    jobs = {
        "clean_off": lambda: train(1, clean, root / "clean_off"),
        "clean_on": lambda: train(1, clean, root / "clean_on", *GUARD),
        "w1": lambda: train(1, planted, root / "w1", *GUARD, "--save_every", "1"),
        "muon": lambda: train(1, planted, root / "muon", *GUARD, "--optimizer", "muon", "--save_every", "1"),
        "nanochat": lambda: train(1, planted, root / "nanochat", *GUARD, *NANOCHAT, "--save_every", "1"),
        "w2": lambda: train(2, planted, root / "w2", *GUARD),
        "resumed": lambda: stopped_and_resumed(planted, root / "resumed"),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        done = {name: future.result() for name, future in futures.items()}
    done["broken"] = broken(planted, root, root / "stopped-at-20")
    return {"root": root, **done}


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def skipped(run: Path) -> list[int]:
    return [r["step"] for r in rows(run) if r.get("skipped")]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.mark.slow
def test_clean_run_skips_nothing_and_trains_exactly_as_without_the_guard(runs: dict) -> None:
    root = runs["root"]
    on, off = root / "clean_on", root / "clean_off"
    assert skipped(on) == [] and all("skipped" not in r for r in rows(on))
    assert "skipped" not in runs["clean_on"].stderr
    assert [(r["loss"], r["grad_norm"]) for r in rows(on)] == [(r["loss"], r["grad_norm"]) for r in rows(off)]
    assert all(torch.equal(a, weights(off)[k]) for k, a in weights(on).items())


@pytest.mark.slow
def test_planted_outlier_batch_is_skipped_and_changes_nothing(runs: dict) -> None:
    """Only the planted step is skipped (its loss is the outlier; the clean run's step is ordinary); its checkpoint
    holds the weights and optimizer state of the step before, bit for bit, with the schedule and data moved on."""
    root = runs["root"]
    run, clean = root / "w1", root / "clean_on"
    assert skipped(run) == [PLANTED]
    assert rows(run)[PLANTED - 1]["loss"] > 7 and rows(clean)[PLANTED - 1]["loss"] < 6
    stderr = runs["w1"].stderr
    assert f"step {PLANTED} skipped by the spike guard" in stderr
    assert "the spike guard skipped 1 step(s) and scaled down 0 gradient(s)" in stderr
    before, at = checkpoint(run, PLANTED - 1), checkpoint(run, PLANTED)
    a, b = load_file(str(before / "model.safetensors")), load_file(str(at / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (torch.load(c / "optimizer.bin", weights_only=True)["state"] for c in (before, at))
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][name], sb[i][name]) for i in sa for name in sa[i])
    schedule = [torch.load(c / "scheduler.bin", weights_only=True)["last_epoch"] for c in (before, at)]
    assert schedule == [PLANTED - 1, PLANTED]
    assert saved_state(at).data_position == saved_state(before).data_position + WINDOWS_PER_STEP
    after = checkpoint(run, PLANTED + 1)
    moved = load_file(str(after / "model.safetensors"))
    assert all(not torch.equal(moved[k], b[k]) for k in b), "the next step is applied again"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "matrices"), [("muon", 4), ("nanochat", 6)])
def test_muon_skips_the_planted_step_and_changes_nothing(runs: dict, name: str, matrices: int) -> None:
    """With Muon + AdamW the planted step is skipped too, for GPT-2's block and for nanochat's (Muon's momentum
    warming up, the embedding and head at their own rates): weights, AdamW's moments and Muon's momentum buffers in
    its checkpoint are those of the step before, bit for bit, and the next step moves every weight again."""
    run = runs["root"] / name
    assert skipped(run) == [PLANTED]
    before, at, after = (checkpoint(run, step) for step in (PLANTED - 1, PLANTED, PLANTED + 1))
    a, b, c = (load_file(str(ckpt / "model.safetensors")) for ckpt in (before, at, after))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (optimizer_tensors(torch.load(ckpt / "optimizer.bin", weights_only=True)) for ckpt in (before, at))
    assert sa.keys() == sb.keys() and sum(k.startswith("muon/") for k in sa) == 2 * matrices  # 2 blocks
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(c[k], b[k]) for k in b), "the next step is applied again"


@pytest.mark.slow
def test_same_steps_skipped_for_one_and_two_processes(runs: dict) -> None:
    """The loss the guard judges is the global batch's (averaged over the ranks on the device), so both take the
    same decisions. The weights are bit-identical: W=1 sums g0/2 + g1/2 over its 2 micro-steps where DDP averages
    (g0 + g1) / 2 over the ranks, and halving is exact in floating point."""
    root = runs["root"]
    assert skipped(root / "w1") == skipped(root / "w2") == [PLANTED]
    w1, w2 = weights(root / "w1"), weights(root / "w2")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.slow
def test_stop_and_resume_equals_uninterrupted(runs: dict) -> None:
    """Resumed at step 20, the restored window (not an empty one, which would judge nothing before step 36) skips
    step 24 again: weights, optimizer state and every metrics row equal the uninterrupted W=2 run's."""
    root = runs["root"]
    run, ref = runs["resumed"], root / "w2"
    assert skipped(run) == [PLANTED]
    assert all(torch.equal(a, weights(ref)[k]) for k, a in weights(run).items())
    sa, sb = (torch.load(checkpoint(r, 30) / "optimizer.bin", weights_only=True)["state"] for r in (run, ref))
    assert all(torch.equal(sa[i][name], sb[i][name]) for i in sa for name in sa[i])
    keys = ("step", "loss", "lr", "grad_norm", "skipped")
    assert [[r.get(k) for k in keys] for r in rows(run)] == [[r.get(k) for k in keys] for r in rows(ref)]


@pytest.mark.slow
def test_a_run_whose_weights_were_broken_is_not_held_in_skips(runs: dict) -> None:
    """Step 21's update (learning rate 1) breaks the weights: the guard skips the first steps of the new loss level,
    then takes it in and trains on to the end, as the run without a guard would (before: every later step was
    skipped and the run was stopped)."""
    proc, out = runs["broken"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in rows(out)][-1] == 60 and (out / "model.safetensors").is_file()
    late = [s for s in skipped(out) if s > 21]
    assert 1 <= len(late) <= 4 and late[-1] <= 30, late  # a few skips soon after, then the new level is taken in


@pytest.mark.slow
def test_a_run_scales_its_outlier_gradients_and_says_so(runs: dict, tmp_path: Path) -> None:
    """The gradient test alone (z 0.5: step 11's norm of 31, before judging began, widened the window), no grad_clip:
    the planted batch's gradient is an outlier and is scaled to the window's bound, not skipped; its row says
    `clipped`, the final line counts it, and the run trains to its end."""
    out = tmp_path / "run"
    proc = train(1, runs["root"] / "planted", out, "--spike_grad_zscore", "0.5", "--grad_clip", "0", "--log_every", "1")
    written = rows(out)
    clipped = [r["step"] for r in written if r.get("clipped")]
    assert PLANTED in clipped and not skipped(out) and written[-1]["step"] == 30, [r["grad_norm"] for r in written]
    assert all(step > 16 for step in clipped)  # nothing is judged before the window holds 16 steps
    assert f"the spike guard skipped 0 step(s) and scaled down {len(clipped)} gradient(s)" in proc.stderr
