"""Checkpoints: exact resume after SIGKILL and SIGTERM (W=1 and W=2), SIGHUP saving as SIGTERM does, a kill while
resuming under another world size, a run crossing epochs of its data, refusals (shape change, corrupt files,
unsafe pickles), and init_from.

Every run is a real process (`accelerate launch` for W=2, a CPU gloo group), shared between tests through module
fixtures that run independent jobs two at a time. Interruptions land at exact points:
`tests/workers/interrupted_train.py` pauses the real trainer at a given step (or inside a save) and the test then
signals every process, so nothing races the loop. The reference for "exact" is the same command never
interrupted: weights, optimizer state and metrics must be bit-identical on CPU fp32.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import REPO, accelerate_cmd, python_cmd, run_cmd, subprocess_env, write_token_shards
from safetensors.torch import load_file

from accel_gpt.checkpoint import (
    RESUME_FIELDS,
    TrainState,
    check_resume_config,
    find_resume_checkpoint,
    prune,
    saved_state,
)
from accel_gpt.errors import UserError
from accel_gpt.runtime import StopSignal
from accel_gpt.weights import load_model
from accel_gpt.workarounds import check_pickles_are_safe

VOCAB = 256  # token ids folded into a small vocabulary: these tests check bookkeeping, not language
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
# 8 steps of 4 sequences (W=1: 2 micro-steps of 2; W=2: 1 each). Saves at 3, 6, 8; metrics rows flushed at even
# steps and save steps; validation at 4 and 8, so the last val loss rides through the resumes too.
FLAGS = [
    *TINY,
    *("--micro_batch_size", "2", "--total_batch_size", "64", "--max_steps", "8", "--seed", "7"),
    *("--learning_rate", "1e-3", "--warmup_steps", "2", "--save_every", "3", "--keep_checkpoints", "3"),
    *("--log_every", "2", "--eval_every", "4", "--eval_steps", "1", "--sample_tokens", "0", "--log_with", "none"),
]
WORKER = "tests/workers/interrupted_train.py"
STEPS = list(range(1, 9))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:40_000]]
    return write_token_shards(
        tmp_path_factory.mktemp("ckpt") / "data", tokens[:36_000], tokens[36_000:], shard_size=9_000, vocab_size=VOCAB
    )


# An epoch of EPOCH_WINDOWS windows lasts 2.5 steps of 4: step 3 reads the last 2 windows of epoch 0 and the first
# 2 of epoch 1, step 6 starts epoch 2 exactly, and step 8 ends 2 windows into epoch 3.
EPOCH_WINDOWS = 10


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:400]]
    train = tokens[: EPOCH_WINDOWS * 16 + 1]  # a shard of n tokens holds (n - 1) // seq_len windows
    return write_token_shards(tmp_path_factory.mktemp("tiny") / "data", train, tokens[200:300], vocab_size=VOCAB)


# ------------------------------------------------------------------------------------------ launching


def launcher(processes: int, *extra: str) -> list[str]:
    """The command prefix that runs a script as `processes` processes (python itself for one)."""
    if processes == 1:
        return [sys.executable]
    launch = accelerate_cmd(processes, "x")[:-2]  # without "run.py x"
    return [*launch[:-2], *extra, *launch[-2:]]  # extra launcher flags go before --main_process_port


def train_flags(data: Path, out: Path, *extra: str) -> list[str]:
    return [*FLAGS, "--data_dir", str(data), "--out_dir", str(out), *extra]


def train(processes: int, data: Path, out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    """An ordinary `run.py train` (accelerate launch for W > 1)."""
    flags = train_flags(data, out, *extra)
    cmd = python_cmd("train", *flags) if processes == 1 else accelerate_cmd(processes, "train", *flags)
    return run_cmd(cmd, timeout=300, check=check)


def interrupted(
    processes: int, data: Path, out: Path, control: str, sig: signal.Signals, *extra: str, only_rank: int | None = None
) -> tuple[int, str]:
    """Run the trainer until the worker pauses at `control` (e.g. `--pause_at 4`), send `sig` to every process
    (launcher and workers, as a scheduler or a dying node would) or to rank `only_rank` alone, let the paused
    rank go on, and return the launcher's exit code and the output."""
    ctl = out.parent / f"{out.name}-ctl-{time.monotonic_ns()}"
    ctl.mkdir(parents=True)
    cmd = [*launcher(processes), WORKER, str(ctl), *control.split(), "--", *train_flags(data, out, *extra)]
    log = ctl / "output.txt"
    with open(log, "w") as f:  # a file, not a pipe: a paused process must never block on a full pipe
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while not (ctl / "paused").exists():
                assert proc.poll() is None, f"exited ({proc.returncode}) before pausing:\n{log.read_text()[-6000:]}"
                assert time.monotonic() < deadline, "never paused"
                time.sleep(0.02)
            workers = [int(p.read_text()) for p in sorted(ctl.glob("pid_*"))]
            assert len(workers) == processes, workers
            targets = [proc.pid, *workers] if only_rank is None else [workers[only_rank]]
            for group in targets:  # torchrun gives each worker its own session
                _signal_group(group, sig)
            (ctl / "release").touch()
            proc.wait(timeout=120)
            _wait_gone(workers)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, log.read_text()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pids: list[int], timeout: float = 60) -> None:
    """Workers are the launcher's children, not ours: poll until each has exited (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        status = Path(f"/proc/{pid}/status")
        while status.exists() and "\nState:\tZ" not in _read(status):
            assert time.monotonic() < deadline, f"worker {pid} still running"
            time.sleep(0.02)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # exited between the check and the read
        return "\nState:\tZ"


@contextlib.contextmanager
def accelerate_state() -> Iterator[None]:
    """accelerate's logger (the skip warning) needs a process state; drop it afterwards, for other tests."""
    from accelerate import PartialState

    PartialState(cpu=True)
    try:
        yield
    finally:
        PartialState._reset_state()


def assert_group(output: str, processes: int, times: int = 1) -> None:
    """The run really formed a group of `processes` (once per start of the group)."""
    assert output.count(f"{processes} process(es) on cpu") == times, output[-6000:]


# ------------------------------------------------------------------------------------------ reading runs


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def assert_tree_equal(a: object, b: object, where: str = "") -> None:
    """Nested dicts/lists of tensors and numbers, equal bit for bit."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_tree_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b or (a != a and b != b), (where, a, b)  # NaN == NaN here


def assert_same_run(run: Path, ref: Path) -> None:
    """Resumed == never stopped: final weights, the step-8 optimizer/scheduler/trainer state, every metrics row."""
    wa, wb = load_file(str(run / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"final weight {k} differs"
    for name in ("optimizer.bin", "scheduler.bin"):
        a, b = (torch.load(ckpt(r, 8) / name, weights_only=True) for r in (run, ref))
        assert_tree_equal(a, b, name)
    sa, sb = saved_state(ckpt(run, 8)), saved_state(ckpt(ref, 8))
    for name in ("step", "tokens_seen", "data_position", "last_val_loss"):
        assert getattr(sa, name) == getattr(sb, name), name
    ra, rb = rows(run), rows(ref)
    assert [r["step"] for r in ra] == STEPS, "each step exactly once"
    for a, b in zip(ra, rb, strict=True):
        for key in ("loss", "lr", "grad_norm", "val_loss"):
            assert a.get(key) == b.get(key), (key, a, b)
    assert [r["step"] for r in ra if "val_loss" in r] == [4, 8]


# ------------------------------------------------------------------------------------------ the runs


def reference(processes: int, data: Path, out: Path, *extra: str) -> Path:
    """The 8 steps never interrupted."""
    stderr = train(processes, data, out, *extra).stderr
    assert_group(stderr, processes)
    assert "Removed shared tensor" not in stderr  # the tied head is left out quietly, not by accelerate's warning
    return out


def w1_chain_runs(data: Path, out: Path) -> dict:
    """One W=1 run interrupted three ways, then finished:
    0. metrics.jsonl starts with bogus rows 1-2, as an attempt killed before its first checkpoint leaves them
       (e.g. under an elastic restart); starting at step 0, `resume: auto` must drop them;
    1. SIGKILL during step 4 (newest checkpoint: step 3; step 3's row was written when it saved);
    2. resumed, SIGTERM during step 4: it finishes the step, saves step_4 and exits 0;
    3. resumed, SIGKILL while saving step 6: files written into .tmp-step_00000006, not yet published;
       then a `step_00000007` folder without COMPLETE is added, as a half-written save would leave it;
    4. resumed with `auto` (skipping step 7 with a warning, from step 4) to the end."""
    seen: dict = {"run": out}
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 99.0}\n{"step": 2, "loss": 99.0}\n')
    rc, seen["kill_out"] = interrupted(1, data, out, "--pause_at 4", signal.SIGKILL, "--resume", "auto")
    assert rc == -signal.SIGKILL
    seen["after_kill"] = (checkpoints(out), [r["step"] for r in rows(out)])
    seen["term_rc"], seen["term_out"] = interrupted(1, data, out, "--pause_at 1", signal.SIGTERM, "--resume", "auto")
    seen["after_term"] = (checkpoints(out), [r["step"] for r in rows(out)])
    rc, seen["save_kill_out"] = interrupted(1, data, out, "--pause_in_save 1", signal.SIGKILL, "--resume", "auto")
    assert rc == -signal.SIGKILL
    seen["after_save_kill"] = checkpoints(out)
    half = out / "checkpoints" / "step_00000007"
    shutil.copytree(ckpt(out, 4), half)
    (half / "COMPLETE").unlink()
    _truncate(half / "model.safetensors")
    seen["final"] = train(1, data, out, "--resume", "auto")
    return seen


def w2_chain_runs(data: Path, out: Path) -> dict:
    """The same with 2 processes: SIGKILL of every process during step 4, then SIGTERM of every process during
    the resumed step 4 (as a scheduler stops a job), then resume to the end."""
    seen: dict = {"run": out}
    rc, seen["kill_out"] = interrupted(2, data, out, "--pause_at 4", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    seen["after_kill"] = (checkpoints(out), [r["step"] for r in rows(out)])
    seen["term_rc"], seen["term_out"] = interrupted(2, data, out, "--pause_at 1", signal.SIGTERM, "--resume", "auto")
    seen["after_term"] = (checkpoints(out), [r["step"] for r in rows(out)])
    seen["final"] = train(2, data, out, "--resume", "auto")
    return seen


# Rows are flushed every 4 steps and checkpoints written at 5 and 8, so step 3 is neither: a stop there must not
# wait for the next flush (step 4). Neither setting changes what is trained, so the references still apply.
LOG_EVERY_4 = ("--log_every", "4", "--save_every", "5")


def log_every_4_sigterm_runs(processes: int, data: Path, out: Path) -> dict:
    """SIGTERM while rank 0 is paused before step 3: to every process under W=1; under W=2 to rank 1 alone (which
    cannot get past step 3's gradient sync without rank 0), so only the ranks' agreement after every step can
    stop rank 0 there. Then resumed."""
    seen: dict = {"run": out}
    target = None if processes == 1 else 1
    seen["term_rc"], seen["term_out"] = interrupted(
        processes, data, out, "--pause_at 3", signal.SIGTERM, *LOG_EVERY_4, only_rank=target
    )
    seen["after_term"] = (checkpoints(out), [r["step"] for r in rows(out)])
    seen["final"] = train(processes, data, out, *LOG_EVERY_4, "--resume", "auto")
    return seen


# Checkpoints every 2 steps, all kept: step 2 sits at stream position 8 (epoch 0), step 4 at 16 (epoch 1).
EPOCH_FLAGS = ("--save_every", "2", "--keep_checkpoints", "0")


def epoch_chain_runs(data: Path, out: Path) -> dict:
    """W=1 on EPOCH_WINDOWS windows: SIGKILL during step 3 (newest checkpoint step 2, on the near side of the
    first epoch boundary: the resume crosses it), resumed and SIGKILLed during step 5 (newest checkpoint step 4,
    on the far side: the resume starts inside epoch 1), then resumed to the end."""
    seen: dict = {"run": out}
    rc, seen["near_out"] = interrupted(1, data, out, "--pause_at 3", signal.SIGKILL, *EPOCH_FLAGS)
    assert rc == -signal.SIGKILL
    seen["after_near"] = (checkpoints(out), [r["step"] for r in rows(out)])
    rc, seen["far_out"] = interrupted(1, data, out, "--pause_at 3", signal.SIGKILL, *EPOCH_FLAGS, "--resume", "auto")
    assert rc == -signal.SIGKILL
    seen["after_far"] = (checkpoints(out), [r["step"] for r in rows(out)])
    seen["final"] = train(1, data, out, *EPOCH_FLAGS, "--resume", "auto")
    return seen


# Muon's Newton-Schulz in each dtype: bf16 with GPT-2's block, fp32 with nanochat's (below).
MUON = ("--optimizer", "muon", "--muon_ns_dtype", "bfloat16")
DROPOUT = ("--dropout", "0.2", "--bias", "false")
# The nanochat block under Muon, its momentum still warming up at the kill (step 4 of 6): the momentum, the own-rate
# groups of the embedding and head, and the rotary tables (rebuilt, not saved) all ride through the resume.
NANOCHAT = ("--arch", "nanochat", "--optimizer", "muon", "--muon_momentum_warmup", "6", "--muon_ns_dtype", "float32")


def killed_and_resumed(processes: int, data: Path, out: Path, *extra: str) -> dict:
    """SIGKILL of every process during step 4 (newest checkpoint: step 3), then `--resume auto` to the end."""
    rc, kill_out = interrupted(processes, data, out, "--pause_at 4", signal.SIGKILL, *extra)
    assert rc == -signal.SIGKILL, kill_out[-4000:]
    after_kill = checkpoints(out)
    return {"run": out, "after_kill": after_kill, "final": train(processes, data, out, *extra, "--resume", "auto")}


def elastic_run(data: Path, out: Path) -> dict:
    """`accelerate launch --max_restarts 1 --rdzv_backend c10d`, `resume: auto`; rank 1 SIGKILLs itself once,
    before step 5.

    c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, not the default static rendezvous: static keeps one agent
    store for every attempt, so the restarted group can read the dead group's gloo addresses and hang or be
    refused in init_process_group (seen here: 1 hang in 3 runs); this way each attempt's rank 0 hosts a fresh
    store. accelerate passes no rendezvous endpoint for one machine; torchrun reads it from PET_RDZV_ENDPOINT."""
    ctl = out.parent / f"{out.name}-ctl"
    ctl.mkdir(parents=True)
    launch = launcher(2, "--max_restarts", "1", "--monitor_interval", "0.1", "--rdzv_backend", "c10d")
    cmd = [*launch, WORKER, str(ctl), "--die_once_at", "5", "--", *train_flags(data, out, "--resume", "auto")]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    proc = run_cmd(cmd, timeout=300, PET_RDZV_ID=f"elastic-{os.getpid()}", **env)
    return {"run": out, "proc": proc, "died": (ctl / "died").read_text()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_runs(data: Path, root: Path) -> dict:
    """A random transformers GPT-2 (weights drawn wide, std 0.5, so its loss is far from a fresh init's ln 256),
    saved with save_pretrained; 2 steps trained from it, and a run whose config disagrees with its shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf_config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, initializer_range=0.5)
    hf_model = GPT2LMHeadModel(hf_config).eval()
    hf_model.save_pretrained(root / "hf")
    extra = ["--init_from", str(root / "hf"), "--max_steps", "2", "--save_every", "0", "--eval_every", "0"]
    return {
        "hf_model": hf_model,
        "ok_run": root / "ok",
        "ok": train(1, data, root / "ok", *extra, check=False),
        "mismatch": train(1, data, root / "mismatch", *extra, "--n_embd", "64", check=False),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data: Path, tiny_data: Path) -> dict:
    """Every run that needs only the data, two at a time (2 cores: a W=1 run beside a W=2 one); longest first.
    A failed job is kept as its exception, raised only by the tests that use it."""
    root = tmp_path_factory.mktemp("runs")
    jobs = {
        "w2_chain": lambda: w2_chain_runs(data, root / "w2" / "run"),
        "w1_chain": lambda: w1_chain_runs(data, root / "w1" / "run"),
        "elastic": lambda: elastic_run(data, root / "elastic" / "run"),
        "epoch_chain": lambda: epoch_chain_runs(tiny_data, root / "epoch" / "run"),
        "log4_w2": lambda: log_every_4_sigterm_runs(2, data, root / "log4_w2" / "run"),
        "log4_w1": lambda: log_every_4_sigterm_runs(1, data, root / "log4_w1" / "run"),
        "ref2": lambda: reference(2, data, root / "ref2"),
        "ref1": lambda: reference(1, data, root / "ref1"),
        "epoch_ref": lambda: reference(1, tiny_data, root / "epoch_ref", *EPOCH_FLAGS),
        "init_from": lambda: init_from_runs(data, root / "init"),
        "muon_chain": lambda: killed_and_resumed(1, data, root / "muon" / "run", *MUON),
        "muon_ref": lambda: reference(1, data, root / "muon_ref", *MUON),
        "dropout_chain": lambda: killed_and_resumed(2, data, root / "dropout" / "run", *DROPOUT),
        "dropout_ref": lambda: reference(2, data, root / "dropout_ref", *DROPOUT),
        "nanochat_chain": lambda: killed_and_resumed(1, data, root / "nanochat" / "run", *NANOCHAT),
        "nanochat_ref": lambda: reference(1, data, root / "nanochat_ref", *NANOCHAT),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.exception() or future.result() for name, future in futures.items()}


def result(runs: dict, name: str) -> Any:
    if isinstance(runs[name], BaseException):
        raise runs[name]
    return runs[name]


@pytest.fixture(scope="module")
def ref(runs: dict) -> dict[int, Path]:
    return {1: result(runs, "ref1"), 2: result(runs, "ref2")}


# ------------------------------------------------------------------------------------------ reference runs


@pytest.mark.slow
def test_reference_runs_save_every_3_and_at_the_end(ref: dict[int, Path]) -> None:
    for run in ref.values():
        assert checkpoints(run) == ["step_00000003", "step_00000006", "step_00000008"]
        for step in (3, 6, 8):
            marker = json.loads((ckpt(run, step) / "COMPLETE").read_text())
            assert marker["step"] == step and marker["tokens_seen"] == 64 * step
        assert json.loads((ckpt(run, 8) / "COMPLETE").read_text())["val_loss"] == rows(run)[-1]["val_loss"]
        assert json.loads((ckpt(run, 6) / "COMPLETE").read_text())["val_loss"] is None  # not evaluated at 6


@pytest.mark.slow
def test_checkpoint_weights_have_the_same_keys_for_any_world_size(ref: dict[int, Path]) -> None:
    """accelerate saves the module it was given, not the DDP wrapper: no `module.` prefix under W=2, so a
    checkpoint resumes under any W. The tied LM head is stored once, as wte."""
    keys = [set(load_file(str(ckpt(ref[w], 3) / "model.safetensors"))) for w in (1, 2)]
    assert keys[0] == keys[1]
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in keys[0])
    assert "lm_head.weight" not in keys[0] and "transformer.wte.weight" in keys[0]


@pytest.mark.slow
def test_load_model_reads_a_checkpoint(ref: dict[int, Path]) -> None:
    """eval/sample/export accept a checkpoint folder: the step-8 checkpoint holds the final weights."""
    model, card = load_model(ckpt(ref[2], 8))
    assert card.step == 8 and card.model.n_layer == 2
    final = load_file(str(ref[2] / "model.safetensors"))
    state = model.state_dict()
    for k, v in final.items():
        assert torch.equal(state[k], v), k
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


# ------------------------------------------------------------------------------------------ exact resume


@pytest.fixture(scope="module")
def w1_chain(runs: dict) -> dict:
    return result(runs, "w1_chain")


@pytest.mark.slow
def test_w1_sigkill_leaves_last_checkpoint_and_its_rows(w1_chain: dict) -> None:
    assert w1_chain["after_kill"] == (["step_00000003"], [1, 2, 3])


@pytest.mark.slow
def test_w1_sigterm_saves_at_the_stop_step_and_exits_0(w1_chain: dict) -> None:
    assert w1_chain["term_rc"] == 0, w1_chain["term_out"][-4000:]
    assert f"resumed from {ckpt(w1_chain['run'], 3)} at step 3" in w1_chain["term_out"]
    assert "stop requested: stopped after step 4" in w1_chain["term_out"]
    assert "(metrics.jsonl, config.yaml, checkpoints/; no final weights yet)" in w1_chain["term_out"]  # none written
    assert "SIGTERM: finishing the current step, then saving and exiting\n" in w1_chain["term_out"]  # no "Ctrl-C"
    assert w1_chain["after_term"] == (["step_00000003", "step_00000004"], [1, 2, 3, 4])


@pytest.mark.slow
def test_w1_kill_while_saving_leaves_previous_checkpoint_loadable(w1_chain: dict) -> None:
    run = w1_chain["run"]
    assert w1_chain["after_save_kill"] == [".tmp-step_00000006", "step_00000003", "step_00000004"]
    final = w1_chain["final"].stderr
    assert f"skipping incomplete checkpoint {ckpt(run, 7)}" in final
    assert f"resumed from {ckpt(run, 4)} at step 4" in final  # not the half-written .tmp-step_6 nor step_7
    model, card = load_model(ckpt(run, 4))
    assert card.step == 4 and sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_w1_interrupted_run_equals_uninterrupted(w1_chain: dict, ref: dict[int, Path]) -> None:
    assert_same_run(w1_chain["run"], ref[1])
    names = checkpoints(w1_chain["run"])
    assert not [n for n in names if n.startswith(".")], "leftovers of the killed save were not cleaned"
    assert names == ["step_00000004", "step_00000006", "step_00000007", "step_00000008"]  # 3 complete + step_7


@pytest.mark.slow
def test_w2_sigkill_then_sigterm_then_resume_equals_uninterrupted(runs: dict, ref: dict[int, Path]) -> None:
    w2_chain = result(runs, "w2_chain")
    for key in ("kill_out", "term_out"):
        assert_group(w2_chain[key], 2)
    assert_group(w2_chain["final"].stderr, 2)
    assert w2_chain["after_kill"] == (["step_00000003"], [1, 2, 3])
    # torchrun itself exits 1 on SIGTERM; the workers finished step 4, saved and returned normally
    assert "stop requested: stopped after step 4" in w2_chain["term_out"], w2_chain["term_out"][-4000:]
    assert "finished at step 4/8" in w2_chain["term_out"]
    assert w2_chain["after_term"] == (["step_00000003", "step_00000004"], [1, 2, 3, 4])
    assert_same_run(w2_chain["run"], ref[2])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "processes"), [("muon", 1), ("dropout", 2), ("nanochat", 1)])
def test_killed_and_resumed_equals_uninterrupted(runs: dict, name: str, processes: int) -> None:
    """Muon + AdamW (both states in the checkpoint; Newton-Schulz in bf16), dropout 0.2 without biases on 2
    processes (each rank's random state in the checkpoint: the resumed steps draw the masks the uninterrupted run
    drew), and the nanochat block (`NANOCHAT`, Newton-Schulz in fp32): SIGKILL during step 4, `--resume auto`,
    bit-identical to the run never stopped."""
    chain, ref = result(runs, f"{name}_chain"), result(runs, f"{name}_ref")
    assert chain["after_kill"] == ["step_00000003"]
    assert_group(chain["final"].stderr, processes)
    assert_same_run(chain["run"], ref)


@pytest.mark.slow
def test_dropout_and_muon_runs_differ_from_the_plain_run(runs: dict, ref: dict[int, Path]) -> None:
    """The settings took effect: each changes the losses from step 1 (dropout) or 2 (the first Muon update), and the
    dropout run's weights have no biases; its saved model_config records both settings."""
    plain = rows(ref[1])
    muon, dropout = rows(result(runs, "muon_ref")), rows(result(runs, "dropout_ref"))
    assert muon[0]["loss"] == plain[0]["loss"] and muon[1]["loss"] != plain[1]["loss"]
    assert dropout[0]["loss"] != rows(ref[2])[0]["loss"]
    weights = load_file(str(result(runs, "dropout_ref") / "model.safetensors"))
    assert not any(k.endswith(".bias") for k in weights) and any(k.endswith("ln_f.weight") for k in weights)
    model, _ = load_model(result(runs, "dropout_ref"))
    assert (model.config.dropout, model.config.bias) == (0.2, False) and not model.training


@pytest.mark.slow
def test_elastic_restart_after_a_worker_dies(runs: dict, ref: dict[int, Path]) -> None:
    """torchrun restarts the group after rank 1 dies; `resume: auto` takes it from step 3 to the uninterrupted
    run's weights."""
    elastic = result(runs, "elastic")
    stderr = elastic["proc"].stderr
    assert elastic["died"] == "rank 1 step call 5"
    assert_group(stderr, 2, times=2)  # the first group and the restarted one
    assert "resume: auto found no complete checkpoint" in stderr
    assert f"resumed from {ckpt(elastic['run'], 3)} at step 3" in stderr
    assert_same_run(elastic["run"], ref[2])


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_between_log_steps_stops_after_that_step(runs: dict, ref: dict[int, Path], processes: int) -> None:
    """With log_every 4, SIGTERM during step 3 stops after step 3, not at the next log step: step 3 is saved,
    its metrics row written, the exit is 0, and the resumed run ends where the uninterrupted one does. Under W=2
    only rank 1 was signalled, so rank 0 stopping at the same step shows that the ranks agree after every step;
    torchrun, not signalled itself, returns the workers' 0."""
    chain = result(runs, f"log4_w{processes}")
    term, final = chain["term_out"], chain["final"].stderr
    assert chain["term_rc"] == 0, term[-4000:]
    assert_group(term, processes)
    assert "stop requested: stopped after step 3" in term and "finished at step 3/8" in term, term[-4000:]
    assert chain["after_term"] == (["step_00000003"], [1, 2, 3])
    assert_group(final, processes)
    assert f"resumed from {ckpt(chain['run'], 3)} at step 3" in final
    assert checkpoints(chain["run"]) == ["step_00000003", "step_00000005", "step_00000008"]
    assert_same_run(chain["run"], ref[processes])


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sighup_saves_at_the_stop_step_like_sigterm(data: Path, tmp_path: Path, processes: int) -> None:
    """A closed terminal or ssh session (SIGHUP to every process, during step 2) stops the run as SIGTERM does:
    step 2 finished, saved and logged, the workers exit 0. torchrun itself exits 1 on the SIGHUP it forwards."""
    out = tmp_path / "run"
    with hangups_delivered():
        rc, output = interrupted(processes, data, out, "--pause_at 2", signal.SIGHUP)
    assert rc == (0 if processes == 1 else 1), output[-4000:]
    assert_group(output, processes)
    assert "SIGHUP: finishing the current step, then saving and exiting\n" in output
    assert "stop requested: stopped after step 2" in output and "finished at step 2/8" in output, output[-4000:]
    assert (checkpoints(out), [r["step"] for r in rows(out)]) == (["step_00000002"], [1, 2])


def test_a_hangup_is_a_stop_that_never_aborts_and_nohup_is_kept() -> None:
    """In-process: SIGHUP sets the stop flag; after a Ctrl-C (whose save is under way) a hangup does not abort as a
    second Ctrl-C would; a process started with SIGHUP ignored (`nohup`) keeps ignoring it."""
    one = SimpleNamespace(is_main_process=False, num_processes=1)
    with hangups_delivered(), StopSignal(one) as stop:
        assert signal.getsignal(signal.SIGHUP) == stop._handle  # else the kill below would end pytest
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested() and stop.first == signal.SIGHUP
    with hangups_delivered(), StopSignal(one) as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle  # else the kill below would interrupt pytest itself
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested() and stop.first == signal.SIGINT
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignal(one):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


@contextlib.contextmanager
def hangups_delivered() -> Iterator[None]:
    """SIGHUP at its default disposition meanwhile, as under a terminal. A suite started with `nohup` ignores it,
    and a process inherits an ignored signal: the runs it starts would keep ignoring SIGHUP, as they should."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


# ------------------------------------------------------------------------------------------ epochs of the data


@pytest.mark.slow
def test_run_across_epoch_boundaries_killed_and_resumed_equals_uninterrupted(runs: dict) -> None:
    chain, ref = result(runs, "epoch_chain"), result(runs, "epoch_ref")
    positions = [saved_state(ckpt(ref, step)).data_position for step in (2, 4, 6, 8)]
    assert positions == [8, 16, 24, 32]  # 4 windows a step; an epoch is EPOCH_WINDOWS = 10
    assert chain["after_near"] == (["step_00000002"], [1, 2])
    assert f"resumed from {ckpt(chain['run'], 2)} at step 2" in chain["far_out"]  # position 8: epoch 0
    assert chain["after_far"] == (["step_00000002", "step_00000004"], [1, 2, 3, 4])
    assert f"resumed from {ckpt(chain['run'], 4)} at step 4" in chain["final"].stderr  # position 16: epoch 1
    assert checkpoints(chain["run"]) == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    assert_same_run(chain["run"], ref)


@pytest.mark.slow
def test_steps_across_an_epoch_boundary_read_the_next_epochs_permutation(runs: dict, tiny_data: Path) -> None:
    """The step-k loss row is the loss of the step-(k-1) weights on step k's windows. Step 3 must read the
    last 2 windows of epoch 0's permutation, then the first 2 of epoch 1's; step 5 windows 6-9 of epoch 1's."""
    from accel_gpt.data.loader import TokenWindows, WindowSampler

    ref = result(runs, "epoch_ref")
    windows = TokenWindows(tiny_data, "train", 16)
    assert len(windows) == EPOCH_WINDOWS
    sampler = WindowSampler(EPOCH_WINDOWS, seed=7)
    p0, p1 = sampler.permutation(0).tolist(), sampler.permutation(1).tolist()
    logged = {r["step"]: r["loss"] for r in rows(ref)}

    def loss(step: int, ids: list[int]) -> float:
        model, _ = load_model(ckpt(ref, step - 1))
        x = torch.stack([windows[i][0] for i in ids])
        y = torch.stack([windows[i][1] for i in ids])
        with torch.no_grad():
            return model(x, y)[1].item()

    assert loss(3, p0[8:] + p1[:2]) == pytest.approx(logged[3], abs=1e-5)
    assert loss(5, p1[6:]) == pytest.approx(logged[5], abs=1e-5)
    assert abs(loss(3, p0[8:] + p0[:2]) - logged[3]) > 1e-3, "epoch 0 repeated would give the same loss"


# ------------------------------------------------------------------------------------------ runs from a checkpoint


class Payload:
    """Pickles as a call to os.mkdir(path): unpickling it with weights_only=False creates the folder."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def from_ref(tmp_path_factory: pytest.TempPathFactory, data: Path, ref: dict[int, Path]) -> dict:
    """Resumes from the reference runs' checkpoints, two at a time: W=2's step-3 checkpoint resumed by W=1, and
    resumes that must be refused, each from its own copy of the W=1 run (shape change, truncated weights, a
    trainer-state pickle that would run code)."""
    root = tmp_path_factory.mktemp("from_ref")
    cases: dict[str, tuple[Path, list[str]]] = {"w2_to_w1": (root / "w2_to_w1", ["--resume", "auto"])}
    shutil.copytree(ckpt(ref[2], 3), ckpt(cases["w2_to_w1"][0], 3))
    for name in ("shape", "truncated_weights", "unsafe_pickle", "optimizer", "bias"):
        shutil.copytree(ref[1], root / name)
        cases[name] = (root / name, ["--resume", "auto"])
    cases["shape"][1].extend(["--n_layer", "3"])
    cases["optimizer"][1].extend(["--optimizer", "muon"])
    cases["bias"][1].extend(["--bias", "false"])
    _truncate(ckpt(cases["truncated_weights"][0], 8) / "model.safetensors")
    complete = ckpt(cases["truncated_weights"][0], 8) / "COMPLETE"  # as saved before checksums: the load fails
    complete.write_text(json.dumps({k: v for k, v in json.loads(complete.read_text()).items() if k != "sha256"}))
    marker = root / "payload_ran"
    torch.save({"step": Payload(marker)}, ckpt(cases["unsafe_pickle"][0], 8) / "custom_checkpoint_0.pkl")
    # with its checksums rewritten (or from before them): the checksums would otherwise name it damaged first
    complete = ckpt(cases["unsafe_pickle"][0], 8) / "COMPLETE"
    complete.write_text(json.dumps({k: v for k, v in json.loads(complete.read_text()).items() if k != "sha256"}))
    before = {name: _snapshot(out) for name, (out, _) in cases.items()}

    def run(name: str) -> subprocess.CompletedProcess:
        out, extra = cases[name]
        return train(1, data, out, *extra, check=False)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(run, cases), strict=True))
    after = {name: _snapshot(out) for name, (out, _) in cases.items()}
    return {"results": results, "before": before, "after": after, "marker": marker, "runs": dict(cases)}


@pytest.mark.slow
def test_resume_under_another_world_size(from_ref: dict, ref: dict[int, Path]) -> None:
    """W=2's step-3 checkpoint (accumulation 1) resumed by W=1 (accumulation 2). The odd step matters:
    accelerate's restored micro-step counter (3) made W=1 sync after one micro-step and then skip every update,
    until load_checkpoint reset it. The other direction loads the same files (same keys, see above)."""
    proc, out = from_ref["results"]["w2_to_w1"], from_ref["runs"]["w2_to_w1"][0]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_group(proc.stderr, 1)
    assert f"resume: {ckpt(out, 3)} was saved by 2 process(es) and resumes in 1: the global batches" in proc.stderr
    assert [r["step"] for r in rows(out)] == [4, 5, 6, 7, 8]
    expected = {r["step"]: r for r in rows(ref[1])}
    for r in rows(out):
        assert abs(r["loss"] - expected[r["step"]]["loss"]) < 1e-5, (r, expected[r["step"]])
        assert r["lr"] == expected[r["step"]]["lr"]
    wa, wb = load_file(str(out / "model.safetensors")), load_file(str(ref[1] / "model.safetensors"))
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert diff < 1e-5, f"final weights differ by {diff}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("shape", "n_layer was 2 there but is 3 now"),
        ("truncated_weights", "cannot load checkpoint"),
        ("unsafe_pickle", "refusing to unpickle it"),
        ("optimizer", "it was trained with --optimizer adamw, whose state does not carry over to muon"),
        ("bias", "bias was True there but is False now"),
    ],
)
def test_refused_resume_is_one_line_exit_2_and_touches_nothing(from_ref: dict, case: str, expected: str) -> None:
    proc = from_ref["results"][case]
    assert proc.returncode == 2, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert from_ref["after"][case] == from_ref["before"][case], "a refused resume changed the run directory"


@pytest.mark.slow
def test_unsafe_pickle_is_refused_before_anything_runs(from_ref: dict) -> None:
    """The payload is live (unpickling it with weights_only=False runs it), yet the refused resume never ran it."""
    marker: Path = from_ref["marker"]
    assert not marker.exists(), "the checkpoint's pickle ran code during the refused resume"
    assert "GLOBAL posix.mkdir" in from_ref["results"]["unsafe_pickle"].stderr
    torch.load(ckpt(from_ref["runs"]["unsafe_pickle"][0], 8) / "custom_checkpoint_0.pkl", weights_only=False)
    assert marker.is_dir()


@pytest.mark.slow
def test_check_pickles_refuses_unsafe_and_corrupt_files(tmp_path: Path, ref: dict[int, Path]) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(ckpt(ref[1], 3), folder)
    check_pickles_are_safe(folder)  # the real checkpoint passes
    optimizer = (folder / "optimizer.bin").read_bytes()
    torch.save({"state": {}, "param_groups": [Payload(tmp_path / "ran")]}, folder / "optimizer.bin")
    with pytest.raises(UserError, match="optimizer.bin holds something other than tensors.*refusing to unpickle"):
        check_pickles_are_safe(folder)
    assert not (tmp_path / "ran").exists()
    (folder / "optimizer.bin").write_bytes(optimizer[: len(optimizer) // 2])
    with pytest.raises(UserError, match="optimizer.bin is corrupt or truncated"):
        check_pickles_are_safe(folder)
    (folder / "optimizer.bin").write_bytes(b"\x80\x02not a checkpoint" * 10)
    with pytest.raises(UserError, match="optimizer.bin"):
        check_pickles_are_safe(folder)
    (folder / "optimizer.bin").write_bytes(optimizer)
    (folder / "custom_checkpoint_0.pkl").unlink()
    with pytest.raises(UserError, match="has no custom_checkpoint_0.pkl"):
        saved_state(folder)


def test_prune_keeps_the_newest_and_the_best_by_its_own_val_loss(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step, val_loss in ((2, 3.0), (4, 1.0), (6, None), (8, 2.0), (10, None)):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "COMPLETE").write_text(json.dumps({"step": step, "val_loss": val_loss}))
    (root / "step_00000012").mkdir()  # incomplete: not counted, not touched
    prune(tmp_path, keep=2, keep_best=False)
    assert checkpoints(tmp_path) == ["step_00000008", "step_00000010", "step_00000012"]
    for step, val_loss in ((2, 3.0), (4, 1.0)):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "COMPLETE").write_text(json.dumps({"step": step, "val_loss": val_loss}))
    prune(tmp_path, keep=1, keep_best=True)
    assert checkpoints(tmp_path) == ["step_00000004", "step_00000010", "step_00000012"]


def test_an_unreadable_marker_makes_its_checkpoint_incomplete(tmp_path: Path) -> None:
    """A truncated or garbled COMPLETE vouches for nothing: `auto`, pruning and keep_best skip that folder (and say
    so) instead of failing; a marker whose val_loss is not a finite number is unscored."""
    root = tmp_path / "checkpoints"
    markers = {2: '{"step": 2, "val_loss": 0.5}', 4: '{"step": 4, "val_lo', 6: '{"step": 6, "val_loss": "x"}', 8: "[8]"}
    markers |= {10: '{"step": 10, "val_loss": 2.0}', 12: '{"step": 12, "val_loss": NaN}'}
    for step, text in markers.items():
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "COMPLETE").write_text(text)
    with accelerate_state():  # the warnings go through accelerate's logger
        assert find_resume_checkpoint("auto", tmp_path) == ckpt(tmp_path, 12)
        with pytest.raises(UserError, match="has an unreadable COMPLETE marker"):
            find_resume_checkpoint(str(ckpt(tmp_path, 4)), tmp_path)
        prune(tmp_path, keep=1, keep_best=True)
    # 2 is the best scored; 12 the newest; 4 and 8 are incomplete, so untouched; 6 (unscored) and 10 pruned
    assert checkpoints(tmp_path) == [f"step_{s:08d}" for s in (2, 4, 8, 12)]


@pytest.mark.parametrize("name", RESUME_FIELDS)
def test_resume_config_refuses_each_shape_or_batch_field(name: str) -> None:
    saved = {field: 64 for field in RESUME_FIELDS}
    check_resume_config(saved, {**saved, "learning_rate": 1.0, "max_steps": 99}, Path("ck"))  # other fields may change
    with pytest.raises(UserError, match=f"{name} was 64 there but is 128 now"):
        check_resume_config(saved, {**saved, name: 128}, Path("ck"))


@pytest.mark.slow
def test_find_resume_checkpoint_choices(tmp_path: Path, ref: dict[int, Path]) -> None:
    run = tmp_path / "run"
    shutil.copytree(ref[1] / "checkpoints", run / "checkpoints")
    assert find_resume_checkpoint("auto", run) == ckpt(run, 8)
    assert find_resume_checkpoint("auto", tmp_path / "empty") is None
    assert find_resume_checkpoint("none", tmp_path / "empty") is None
    assert find_resume_checkpoint(str(ckpt(run, 3)), tmp_path / "elsewhere") == ckpt(run, 3)
    assert find_resume_checkpoint("none", run) is None  # a folder of another run is refused by RunDir, earlier
    with pytest.raises(UserError, match="is a run directory, not a checkpoint"):
        find_resume_checkpoint(str(run), tmp_path / "elsewhere")
    with pytest.raises(UserError, match="does not exist"):
        find_resume_checkpoint(str(tmp_path / "nope"), run)
    (ckpt(run, 8) / "COMPLETE").unlink()
    with accelerate_state():  # the skip warning goes through accelerate's logger
        assert find_resume_checkpoint("auto", run) == ckpt(run, 6)
    with pytest.raises(UserError, match="incomplete"):
        find_resume_checkpoint(str(ckpt(run, 8)), run)


def test_trainer_state_round_trips_through_weights_only_load(tmp_path: Path) -> None:
    state = TrainState(step=5, tokens_seen=320, data_position=20, last_val_loss=1.5, config={"seed": 7, "x": "y"})
    torch.save(state.state_dict(), tmp_path / "s.pkl")
    back = TrainState()
    back.load_state_dict(torch.load(tmp_path / "s.pkl", weights_only=True))
    assert (back.step, back.tokens_seen, back.data_position, back.last_val_loss) == (5, 320, 20, 1.5)
    assert back.config == state.config
    torch.save(TrainState().state_dict(), tmp_path / "fresh.pkl")  # a run not yet evaluated: NaN, not an error
    back.load_state_dict(torch.load(tmp_path / "fresh.pkl", weights_only=True))
    assert math.isnan(back.last_val_loss) and back.step == 0


# ------------------------------------------------------------------------------------------ init_from


@pytest.mark.slow
def test_init_from_starts_from_the_transformers_weights(runs: dict, data: Path) -> None:
    """The step-1 loss is the loss of the step-0 weights on the first global batch; compute it with transformers."""
    import torch.nn.functional as F

    init = result(runs, "init_from")
    assert init["ok"].returncode == 0, init["ok"].stderr[-4000:]
    x, y = first_batch(data)
    with torch.no_grad():
        logits = init["hf_model"](x).logits
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    assert expected > math.log(VOCAB) + 1.0  # far from any fresh init: loading nothing could not pass
    assert rows(init["ok_run"])[0]["loss"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_nanochat_init_from_works_and_across_blocks_init_and_resume_are_refused(
    runs: dict, ref: dict[int, Path], data: Path, tmp_path: Path
) -> None:
    """--init_from a nanochat run: step 1's loss is the loss of that run's final weights on the first global batch.
    A GPT-2 run's weights under --arch nanochat, a nanochat run's under gpt2, and a resume across blocks are each
    one line (exit 2)."""
    import torch.nn.functional as F

    nanochat = result(runs, "nanochat_ref")
    short = ["--max_steps", "1", "--save_every", "0", "--eval_every", "0"]
    train(1, data, tmp_path / "ok", *NANOCHAT, "--init_from", str(nanochat), *short)
    x, y = first_batch(data)
    with torch.no_grad():
        logits, _ = load_model(nanochat)[0](x)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    assert expected < math.log(VOCAB) - 0.5  # trained weights, far from a fresh init's ln 256
    assert rows(tmp_path / "ok")[0]["loss"] == pytest.approx(expected, abs=1e-4)
    cases = {
        "gpt2 weights": (
            ["--arch", "nanochat", "--init_from", str(ref[1])],
            "has arch=gpt2 but the config says nanochat",
        ),
        "nanochat weights": (["--init_from", str(nanochat)], "has arch=nanochat but the config says gpt2"),
        "resume": (["--arch", "nanochat", "--resume", str(ckpt(ref[1], 8))], "arch was gpt2 there but is nanochat now"),
    }
    for name, (flags, message) in cases.items():
        proc = train(1, data, tmp_path / name.replace(" ", "_"), *flags, *short, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], (name, proc.stderr[-3000:])


def first_batch(data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4 windows of step 1 (64 tokens at seq_len 16, seed 7), as inputs and targets."""
    from accel_gpt.data.loader import TokenWindows, WindowSampler

    windows = TokenWindows(data, "train", 16)
    ids = WindowSampler(len(windows), seed=7).permutation(0)[:4].tolist()
    return torch.stack([windows[i][0] for i in ids]), torch.stack([windows[i][1] for i in ids])


def test_a_checkpoint_from_before_arch_existed_is_gpt2s() -> None:
    """Checkpoints saved before the nanochat block record no `arch`: they hold GPT-2's block, with its tanh GELU.
    Those saved before `gelu` existed hold that GELU under gpt2, and none under nanochat."""
    newer = ("arch", "n_kv_head", "rope_theta", "logit_softcap", "gelu")
    saved = {field: 64 for field in RESUME_FIELDS if field not in newer}
    now = {**saved, "arch": "gpt2", "n_kv_head": None, "rope_theta": None, "logit_softcap": None, "gelu": "tanh"}
    check_resume_config(saved, now, Path("ck"))
    with pytest.raises(UserError, match="arch was gpt2 there but is nanochat now"):
        check_resume_config(saved, {**now, "arch": "nanochat", "gelu": None}, Path("ck"))
    with pytest.raises(UserError, match="gelu was tanh there but is exact now"):
        check_resume_config(saved, {**now, "gelu": "exact"}, Path("ck"))
    nanochat = {**now, "arch": "nanochat", "rope_theta": 1e4, "logit_softcap": 15.0, "gelu": None}
    check_resume_config({k: v for k, v in nanochat.items() if k != "gelu"}, nanochat, Path("ck"))


@pytest.mark.slow
def test_init_from_shape_mismatch_is_a_clear_error(runs: dict) -> None:
    proc = result(runs, "init_from")["mismatch"]
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "n_embd=32 but the config says 64" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
