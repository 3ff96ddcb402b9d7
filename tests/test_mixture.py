"""Dataset mixtures: several prepared folders in `data_dir`, drawn from in proportion to `data_weights`.

The sampler is checked as arithmetic (proportions over thousands of steps, each source's own epochs, positions
computed directly); the trainer with real processes on two small sources whose tokens come from different ranges
(`web` 0-127, `code` 128-255): W=1 and W=2 take the same steps, a killed and resumed run ends bit-identical, the
first step reads exactly the stream's windows, and each source's validation loss and bits per byte (a web token is
one byte of UTF-8, a code token two) are in metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, accelerate_cmd, python_cmd, run_cmd, subprocess_env, write_token_shards
from safetensors.torch import load_file

from accel_gpt.config import TrainConfig
from accel_gpt.data.loader import MixedWindows, WindowSampler, source_names, train_windows
from accel_gpt.errors import ConfigError, DataError
from accel_gpt.model import GPT, GPTConfig

# ------------------------------------------------------------------------------------------ the sampler


def sources_of(sampler: WindowSampler, windows: np.ndarray) -> np.ndarray:
    return np.searchsorted(sampler.offsets, windows, side="right") - 1


def test_each_step_takes_the_weights_share_of_every_source() -> None:
    """3,000 steps of 64 windows from sources of 1,000, 700 and 37 windows weighted 0.5/0.3/0.2: the totals are
    the weights to within 0.1% and every single step within 2 windows of 32, 19.2 and 12.8."""
    weights, per_step, steps = [0.5, 0.3, 0.2], 64, 3_000
    sampler = WindowSampler([1_000, 700, 37], seed=7, weights=weights, windows_per_step=per_step)
    source = sources_of(sampler, sampler.indices(0, steps * per_step)).reshape(steps, per_step)
    counts = np.stack([(source == k).sum(1) for k in range(3)], axis=1)  # (steps, sources)
    assert np.abs(counts.sum(0) / (steps * per_step) - weights).max() < 1e-3
    assert np.abs(counts - per_step * np.array(weights)).max() <= 2
    patterns = {tuple(row) for row in source[:50]}
    assert len(patterns) == 50, "where a source's windows sit inside a batch is shuffled anew every step"


def test_each_source_goes_through_its_own_epochs() -> None:
    """Source k's windows, step after step, are its epoch 0 permutation, then epoch 1's, ... (in a shuffled order
    inside each step): every window once per epoch of that source, however small it is next to the others."""
    per_step, steps = 16, 200
    sampler = WindowSampler([500, 37], seed=3, weights=[3, 1], windows_per_step=per_step)
    stream = sampler.indices(0, per_step * steps).reshape(steps, per_step)
    for k, n in enumerate(sampler.sizes):
        epochs = np.concatenate([sampler.permutation(e, source=k).numpy() for e in range(per_step * steps // n + 1)])
        taken = 0
        for batch in stream:
            mine = batch[sources_of(sampler, batch) == k] - sampler.offsets[k]
            assert sorted(mine.tolist()) == sorted(epochs[taken : taken + len(mine)].tolist()), k
            taken += len(mine)
    assert taken > 37 * 20, "the small source went through more than 20 epochs"


def test_mixed_stream_entered_anywhere_equals_index_computed_directly() -> None:
    sampler = WindowSampler([10**9, 3 * 10**8, 12_345], seed=11, weights=[0.6, 0.3, 0.1], windows_per_step=512)
    start = 512 * 10**8 + 100  # step 100 million
    chunk = sampler.indices(start, 5_000)
    resumed = WindowSampler(sampler.sizes, 11, start=start, weights=[0.6, 0.3, 0.1], windows_per_step=512)
    assert next(iter(resumed)) == chunk[0]
    assert [sampler.index(start + i) for i in range(0, 5_000, 499)] == chunk[::499].tolist()
    source = sources_of(sampler, chunk)
    for k in range(3):
        mine = chunk[source == k]
        assert len(set(mine.tolist())) == len(mine) or sampler.sizes[k] < len(mine)


def test_one_source_is_the_plain_stream() -> None:
    """A single folder is stream position j -> epoch j // n, offset j % n: no batch shuffle, whatever the step."""
    plain, with_step = WindowSampler(50, 5), WindowSampler([50], 5, weights=[1.0], windows_per_step=16)
    expected = plain.permutation(0).tolist() + plain.permutation(1).tolist()
    assert plain.indices(0, 100).tolist() == with_step.indices(0, 100).tolist() == expected


# ------------------------------------------------------------------------------------------ configuration


def cfg(**overrides: object) -> TrainConfig:
    return TrainConfig(**({"data_dir": "a,b"} | overrides))


def test_weights_are_normalised_and_default_to_equal() -> None:
    assert cfg().source_weights() == [0.5, 0.5]
    assert cfg(data_weights="3, 1").source_weights() == [0.75, 0.25]
    assert cfg(data_dir="a", data_weights="").source_weights() == [1.0]
    assert cfg(data_dir=" a , b ,c").data_dirs == ["a", "b", "c"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data_weights": "1,2,3"}, "data_weights has 3 weight(s) but data_dir names 2 folder(s)"),
        ({"data_weights": "1,0"}, "must all be > 0"),
        ({"data_weights": "1,x"}, "must be comma-separated numbers"),
        ({"data_weights": "1,nan"}, "must all be > 0"),
        ({"data_dir": "a,a"}, "names a folder twice"),
    ],
)
def test_bad_mixture_settings_are_one_clear_error(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg(**overrides)


def test_sources_must_share_the_tokenizer(tmp_path: Path) -> None:
    gpt2 = write_token_shards(tmp_path / "gpt2", list(range(1000)))
    small = write_token_shards(tmp_path / "small", list(range(256)) * 4, vocab_size=256)
    with pytest.raises(DataError, match="must share one tokenizer: .*gpt2 has gpt2 \\(50257 tokens\\) but .*small"):
        train_windows(f"{gpt2},{small}", 16)


def test_source_names_are_folder_names_made_unique(tmp_path: Path) -> None:
    assert source_names([tmp_path / "web", tmp_path / "code"]) == ["web", "code"]
    assert source_names([tmp_path / "a" / "data", tmp_path / "b" / "data"]) == ["a/data", "b/data"]


def test_plot_shows_each_sources_val_loss(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from accel_gpt.plot import load_runs, make_figure

    run = tmp_path / "mix"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3} for s in range(1, 9)]
    for row in rows[3::4]:
        row |= {"val_loss": 4.0, "val_loss/web": 3.5, "val_loss/code": 5.5}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (ax,) = [ax for ax in make_figure(load_runs([run])).axes if ax.get_title() == "loss"]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert {"mix train", "mix val", "mix val web", "mix val code"} <= set(lines)
    assert list(lines["mix val code"].get_xdata()) == [4, 8] and lines["mix val code"].get_ydata()[0] == 5.5
    assert lines["mix val web"].get_marker() != lines["mix val code"].get_marker()


# ------------------------------------------------------------------------------------------ real runs

VOCAB = 256
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
WEIGHTS = (3, 1)


def mixture_flags(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        *("--data_dir", f"{data['web']},{data['code']}", "--data_weights", ",".join(map(str, WEIGHTS))),
        *("--learning_rate", "1e-3", "--warmup_steps", "2", "--max_steps", "8", "--seed", "7"),
        *("--micro_batch_size", "2", "--total_batch_size", "256", "--eval_every", "4", "--eval_steps", "2"),
        *("--save_every", "2", "--keep_checkpoints", "0", "--log_every", "1", "--sample_tokens", "0"),
        *("--log_with", "none", "--out_dir", str(out), *extra),
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two sources whose tokens tell them apart: web in 0..127, code in 128..255 (the code source smaller)."""
    root, rng = tmp_path_factory.mktemp("mixture"), np.random.default_rng(0)
    web, code = rng.integers(0, 128, 12_000), rng.integers(128, 256, 5_000)
    return {
        "web": write_token_shards(root / "web", web[:10_000].tolist(), web[10_000:].tolist(), 4_000, VOCAB),
        "code": write_token_shards(root / "code", code[:4_000].tolist(), code[4_000:].tolist(), vocab_size=VOCAB),
    }


def _train(processes: int, data: dict[str, Path], out: Path, *extra: str) -> subprocess.CompletedProcess:
    flags = mixture_flags(data, out, *extra)
    cmd = python_cmd("train", *flags) if processes == 1 else accelerate_cmd(processes, "train", *flags)
    proc = run_cmd(cmd, timeout=600)
    assert f"{processes} process(es) on cpu" in proc.stderr
    return proc


def _killed_then_resumed(data: dict[str, Path], out: Path) -> None:
    """SIGKILL during step 6 (newest checkpoint: step 4), then `--resume auto` to the end."""
    ctl = out.parent / f"{out.name}-ctl"
    ctl.mkdir(parents=True)
    cmd = [sys.executable, "tests/workers/interrupted_train.py", str(ctl), "--pause_at", "6", "--"]
    log = ctl / "output.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([*cmd, *mixture_flags(data, out)], cwd=REPO, env=subprocess_env(), stdout=f, stderr=f)
        try:
            deadline = time.monotonic() + 300
            while not (ctl / "paused").exists():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    _train(1, data, out, "--resume", "auto")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture_runs")
    _train(1, data, root / "w1")
    _train(2, data, root / "w2")
    _killed_then_resumed(data, root / "resumed")
    return {"w1": root / "w1", "w2": root / "w2", "resumed": root / "resumed"}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


@pytest.mark.slow
def test_mixture_trains_the_same_on_one_and_two_processes(runs: dict[str, Path]) -> None:
    a, b = _rows(runs["w1"]), _rows(runs["w2"])
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) < 1e-5, (ra, rb)
    wa, wb = _weights(runs["w1"]), _weights(runs["w2"])
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@pytest.mark.slow
def test_mixture_killed_and_resumed_is_bit_identical(runs: dict[str, Path]) -> None:
    wa, wb = _weights(runs["w1"]), _weights(runs["resumed"])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _steady(_rows(runs["resumed"])) == _steady(_rows(runs["w1"]))


def _steady(rows: list[dict]) -> list[dict]:
    """Rows without the fields that depend on wall-clock time."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_sec", "mfu", "flops_per_sec")} for r in rows]


@pytest.mark.slow
def test_first_step_reads_the_mixture_streams_first_global_batch(runs: dict[str, Path], data: dict[str, Path]) -> None:
    """Row 1's loss is the initial model's loss on the stream's first 16 windows: 12 from web and 4 from code."""
    from accelerate.utils import set_seed

    windows = train_windows([data["web"], data["code"]], 16)
    assert isinstance(windows, MixedWindows)
    sampler = WindowSampler(windows.sizes, 7, weights=[0.75, 0.25], windows_per_step=16)
    ids = sampler.indices(0, 16).tolist()
    x = torch.stack([windows[i][0] for i in ids])
    y = torch.stack([windows[i][1] for i in ids])
    assert sorted(int(t.max() >= 128) for t in x) == [0] * 12 + [1] * 4, "3:1 of web (ids < 128) and code"
    set_seed(7)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=VOCAB))
    with torch.no_grad():
        _, loss = model(x, y)
    assert _rows(runs["w1"])[0]["loss"] == pytest.approx(loss.item(), abs=1e-5)


@pytest.mark.slow
def test_each_source_has_its_val_loss_and_val_loss_is_their_weighted_mean(
    runs: dict[str, Path], data: dict[str, Path]
) -> None:
    rows = {r["step"]: r for r in _rows(runs["w1"])}
    for step in (4, 8):
        row = rows[step]
        web, code = row["val_loss/web"], row["val_loss/code"]
        assert row["val_loss"] == pytest.approx((WEIGHTS[0] * web + WEIGHTS[1] * code) / sum(WEIGHTS), rel=1e-12)
        assert web != code
        assert row["val_bpb/web"] == pytest.approx(web / math.log(2), rel=1e-12)  # chr(0..127): 1 byte a token
        assert row["val_bpb/code"] == pytest.approx(code / math.log(2) / 2, rel=1e-12)  # chr(128..255): 2 bytes
        bytes_per_token = (WEIGHTS[0] * 1 + WEIGHTS[1] * 2) / sum(WEIGHTS)  # of the mixture, drawn 3:1
        assert row["val_bpb"] == pytest.approx(row["val_loss"] / math.log(2) / bytes_per_token, rel=1e-12)
    assert "val_loss/web" not in rows[3] and "val_loss" not in rows[3]
    assert rows[8]["val_loss/code"] == pytest.approx(_rows(runs["w2"])[7]["val_loss/code"], abs=1e-5)
    # `run.py eval` on the final weights, with the same windows (eval_steps x batch size) of one source
    proc = run_cmd(
        python_cmd("eval", "--checkpoint", str(runs["w1"]), "--data_dir", str(data["code"]))
        + ["--eval_steps", "2", "--batch_size", "2"],
        timeout=300,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["val_loss"] == pytest.approx(code, abs=1e-5)
    assert result["val_bpb"] == pytest.approx(rows[8]["val_bpb/code"], abs=1e-5)
    # the mixture's own data_dir is named as several folders, not a folder to prepare
    both = f"{data['web']},{data['code']}"
    proc = run_cmd(python_cmd("eval", "--checkpoint", str(runs["w1"]), "--data_dir", both), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: data_dir '{both}' names 2 folders (a mixture's): this reads one folder at a time; give one of "
        f"{data['web']}, {data['code']}"
    )
