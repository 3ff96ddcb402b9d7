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
from accel_gpt.spike import MAX_SKIPPED_IN_A_ROW, SpikeGuard, check_can_skip, optimizer_step
from accel_gpt.weights import read_model_config

CPU = torch.device("cpu")


def guard(window: int = 16, loss_z: float = 0.0, grad_z: float = 0.0) -> SpikeGuard:
    cfg = TrainConfig(data_dir="unused", spike_loss_zscore=loss_z, spike_grad_zscore=grad_z, spike_window=window)
    return SpikeGuard(cfg, CPU)


def check(g: SpikeGuard, loss: float, grad_norm: float) -> bool:
    return bool(g.check(torch.tensor(loss), torch.tensor(grad_norm)))


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
    assert int(g.count) == 16, "a skipped step's values stay out of the window"
    assert not check(g, 3.0, math.nan), "a NaN is no outlier (the run's divergence check stops it)"


def test_nothing_is_judged_before_the_window_holds_16_values() -> None:
    g = guard(loss_z=1.0)
    assert not any(check(g, 2.0, 1.0) for _ in range(15))
    assert not check(g, 1e3, 1.0), "the 16th step is only recorded"
    assert check(g, 1e4, 1.0), "from the 17th on, steps are judged (1e4 is far above 15 x 2.0 and 1e3)"


def test_window_keeps_the_last_applied_steps_and_its_state_round_trips() -> None:
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


def optimizer_tensors(state_dict: dict) -> dict[str, torch.Tensor]:
    """Every tensor of an optimizer state (AdamW's, or Muon + AdamW's two), by a path name."""
    parts = state_dict.items() if "adamw" in state_dict else [("adamw", state_dict)]
    return {f"{part}/{i}/{k}": v for part, sd in parts for i, s in sd["state"].items() for k, v in s.items()}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_skipped_step_changes_no_weight_or_optimizer_state_while_the_schedule_advances(name: str) -> None:
    """Through the trainer's own optimizer (fused AdamW, two groups; or Muon on the block matrices + that AdamW)
    and schedule: after 16 ordinary steps, an outlier step leaves every parameter, moment, momentum buffer and step
    counter bit-identical while the learning rate moves on; the next ordinary step updates everything again."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=64))
    cfg = TrainConfig(
        data_dir="unused", learning_rate=1e-2, warmup_steps=2, max_steps=40, spike_grad_zscore=4.0, optimizer=name
    )
    optimizer, g = make_optimizer(model, cfg, "cpu"), SpikeGuard(cfg, CPU)
    scheduler = make_scheduler(optimizer, cfg)

    def step(grad_scale: float) -> bool:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * grad_scale
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        skip = g.check(torch.tensor(3.0), norm)
        optimizer_step(optimizer, skip)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return bool(skip)

    assert not any(step(1e-2) for _ in range(16))
    params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer_tensors(optimizer.state_dict()))
    assert len(state) == (3 * 16 if name == "adamw" else 3 * 12 + 4)  # 16 tensors; Muon: a buffer for 4 matrices
    lr = scheduler.get_last_lr()
    assert step(10.0), "a gradient 1000x the usual is an outlier"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in params.items())
    after = optimizer_tensors(optimizer.state_dict())
    assert after.keys() == state.keys()
    assert all(torch.equal(value, after[key]) for key, value in state.items())
    assert scheduler.last_epoch == 17 and scheduler.get_last_lr() != lr
    assert not step(1e-2)
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
    a copy of the stopped run is kept for `stuck`."""
    train(2, data, out, *GUARD, "--max_steps", "20")
    shutil.copytree(out, out.with_name("stopped-at-20"))
    train(2, data, out, *GUARD, "--resume", "auto")
    return out


def stuck(data: Path, root: Path, after: Path) -> Any:
    """The step-20 checkpoint resumed with a learning rate of 1: its first update breaks the weights, every later
    step is an outlier, and the run stops after MAX_SKIPPED_IN_A_ROW of them."""
    out = root / "stuck"
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
    done["stuck"] = stuck(planted, root, root / "stopped-at-20")
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
    assert f"step {PLANTED} skipped by the spike guard" in stderr and "1 step(s) skipped by the spike guard" in stderr
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
def test_a_run_whose_every_step_is_an_outlier_stops(runs: dict) -> None:
    proc, out = runs["stuck"]
    first = 22  # step 21's update (learning rate 1) breaks the weights; its own loss was measured before it
    last = first + MAX_SKIPPED_IN_A_ROW - 1
    assert proc.returncode == 2
    assert f"error: the spike guard skipped every step from {first} to {last}" in proc.stderr
    written = rows(out)
    assert [r["step"] for r in written] == list(range(1, last + 1))
    assert skipped(out) == list(range(first, last + 1))
    assert read_model_config(out).step == 20, "no final weights written: those in the folder are step 20's"


@pytest.mark.slow
def test_what_the_stuck_line_says_trains(runs: dict, tmp_path: Path) -> None:
    """Each way out the line names, done as it says on a copy of the stopped run: back to the checkpoint from before
    the broken weights with a lower rate (the guard still on: it trains to the end, skipping the planted batch only),
    and on from the
    newest checkpoint without the guard (it trains to the end)."""
    proc, out = runs["stuck"]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    back = checkpoint(out, 20)
    assert (
        f"If updates broke them, resume by path from {back}, the newest checkpoint from before them, with a lower "
        "--learning_rate;" in line
    ), line
    assert line.endswith("train on without it: --resume auto --spike_loss_zscore 0 --spike_grad_zscore 0"), line
    data = runs["root"] / "planted"
    same = ("--lr_schedule", "constant", "--max_steps", "60")
    lower = tmp_path / "lower"
    shutil.copytree(out, lower)
    train(1, data, lower, *GUARD, *same, "--resume", str(checkpoint(lower, 20)), "--learning_rate", "1e-2")
    assert [r["step"] for r in rows(lower)][-1] == 60 and [s for s in skipped(lower) if s > 20] == [PLANTED]
    unguarded = tmp_path / "unguarded"
    shutil.copytree(out, unguarded)
    train(
        1, data, unguarded, *same, "--learning_rate", "1", "--resume", "auto", *line.split("--resume auto ")[1].split()
    )
    assert [r["step"] for r in rows(unguarded)][-1] == 60 and (unguarded / "model.safetensors").is_file()
