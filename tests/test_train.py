"""Trainer core: world-size invariance, exact gradients, per-rank data, HellaSwag in the loop, loss falls.

Distributed runs are real `accelerate launch` processes on CPU (gloo); each asserts it formed a group
of the expected size. Runs are shared between tests through session-scoped fixtures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HELLASWAG, accelerate_cmd, python_cmd, run_cmd, write_token_shards
from safetensors.torch import load_file

from accel_gpt.data.loader import WindowSampler
from accel_gpt.model import GPT, GPTConfig

VOCAB = 256  # token ids folded into a small vocabulary: these tests check arithmetic, not language
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
COMMON = [
    *TINY,
    *("--learning_rate", "1e-3", "--warmup_steps", "2", "--max_steps", "6", "--seed", "7"),
    *("--eval_every", "0", "--save_every", "0", "--log_every", "1", "--sample_tokens", "0", "--log_with", "none"),
]


@pytest.fixture(scope="session")
def small_vocab_data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:40_000]]
    return write_token_shards(
        tmp_path_factory.mktemp("small") / "data", tokens[:36_000], tokens[36_000:], shard_size=9_000, vocab_size=VOCAB
    )


def _train(out: Path, data: Path, processes: int, micro: int, total: int = 64 * 4, *extra: str) -> Path:
    args = ["train", *COMMON, "--data_dir", str(data), "--out_dir", str(out), *extra]
    args += ["--micro_batch_size", str(micro), "--total_batch_size", str(total)]
    proc = run_cmd(accelerate_cmd(processes, *args), timeout=300)
    assert f"{processes} process(es) on cpu" in proc.stderr, "the launch did not form one group of that size"
    return out


@pytest.fixture(scope="session")
def invariance_runs(tmp_path_factory: pytest.TempPathFactory, small_vocab_data: Path) -> dict[str, Path]:
    """Global batch of 16 sequences: (W=1, A=16) vs (W=2, A=8) with micro 1; (W=1, A=8) vs (W=2, A=4) with micro 2."""
    root = tmp_path_factory.mktemp("invariance")
    return {
        "w1_a16": _train(root / "w1_a16", small_vocab_data, 1, micro=1),
        "w2_a8": _train(root / "w2_a8", small_vocab_data, 2, micro=1),
        "w1_a8": _train(root / "w1_a8", small_vocab_data, 1, micro=2),
        "w2_a4": _train(root / "w2_a4", small_vocab_data, 2, micro=2),
    }


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("pair", [("w1_a16", "w2_a8"), ("w1_a8", "w2_a4"), ("w1_a16", "w1_a8")])
def test_world_size_invariance(invariance_runs: dict[str, Path], pair: tuple[str, str]) -> None:
    a, b = (invariance_runs[name] for name in pair)
    rows_a, rows_b = _rows(a), _rows(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == list(range(1, 7))
    assert [r["lr"] for r in rows_a] == [r["lr"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) < 1e-5, (ra, rb)
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-4 * ra["grad_norm"], (ra, rb)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert diff < 1e-5, f"final weights differ by {diff}"


# The nanochat block with grouped-query attention (2 query heads share 1 key/value head), trained with AdamW. Its
# embedding and head take learning_rate here: Adam's update is scale-free, so at their default rates (0.3, 0.008)
# the same fp32 round-off between the sums of W=1 and W=2 moves a weight 300x as far (5.5e-5 measured).
NANOCHAT = ("--arch", "nanochat", "--n_kv_head", "1", "--embedding_lr", "1e-3", "--head_lr", "1e-3")


@pytest.fixture(scope="session")
def nanochat_runs(tmp_path_factory: pytest.TempPathFactory, small_vocab_data: Path) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("nanochat")
    return {w: _train(root / f"w{w}", small_vocab_data, w, 2, 64 * 4, *NANOCHAT) for w in (1, 2)}


@pytest.mark.slow
def test_nanochat_world_size_invariance(nanochat_runs: dict[int, Path]) -> None:
    """The nanochat block under AdamW in fp32: W=2 with 4 micro-steps each takes W=1's steps with 8, to round-off."""
    rows_1, rows_2 = _rows(nanochat_runs[1]), _rows(nanochat_runs[2])
    assert [r["step"] for r in rows_1] == [r["step"] for r in rows_2] == list(range(1, 7))
    assert [r["lr"] for r in rows_1] == [r["lr"] for r in rows_2]
    for r1, r2 in zip(rows_1, rows_2, strict=True):
        assert abs(r1["loss"] - r2["loss"]) < 1e-5, (r1, r2)
        assert abs(r1["grad_norm"] - r2["grad_norm"]) <= 1e-4 * r1["grad_norm"], (r1, r2)
    w1, w2 = (load_file(str(nanochat_runs[w] / "model.safetensors")) for w in (1, 2))
    assert w1.keys() == w2.keys() and "lm_head.weight" in w1 and "transformer.wpe.weight" not in w1
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5


@pytest.fixture(scope="session")
def muon_runs(tmp_path_factory: pytest.TempPathFactory, small_vocab_data: Path) -> dict[tuple[int, str], Path]:
    root = tmp_path_factory.mktemp("muon")
    return {
        (w, dtype): _train(root / f"w{w}_{dtype}", small_vocab_data, w, 2, 64 * 4, *MUON_FLAGS, dtype)
        for dtype in ("float32", "bfloat16")
        for w in (1, 2)
    }


MUON_FLAGS = ("--optimizer", "muon", "--muon_ns_dtype")


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "loss_tol", "weight_tol"), [("float32", 1e-5, 1e-4), ("bfloat16", 1e-4, 2e-2)])
def test_muon_world_size_invariance(muon_runs: dict, dtype: str, loss_tol: float, weight_tol: float) -> None:
    """W=1 with 8 micro-steps and W=2 with 4 each. Newton-Schulz in fp32 (what `auto` picks without bf16 matrix
    units): the same steps to round-off, which the orthogonalization amplifies on the weights (measured: losses 5e-7
    apart, weights 2.3e-5). In bf16 the round-off of another gradient reduction order flips roundings: losses 2e-5
    apart, weights 1.9e-3."""
    rows_1, rows_2 = _rows(muon_runs[1, dtype]), _rows(muon_runs[2, dtype])
    assert [r["step"] for r in rows_1] == [r["step"] for r in rows_2] == list(range(1, 7))
    assert [r["lr"] for r in rows_1] == [r["lr"] for r in rows_2]
    for r1, r2 in zip(rows_1, rows_2, strict=True):
        assert abs(r1["loss"] - r2["loss"]) < loss_tol, (r1, r2)
    w1, w2 = (load_file(str(muon_runs[w, dtype] / "model.safetensors")) for w in (1, 2))
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < weight_tol
    other = load_file(str(muon_runs[1, "float32" if dtype == "bfloat16" else "bfloat16"] / "model.safetensors"))
    assert max((w1[k] - other[k]).abs().max().item() for k in w1) > 0, "the dtype setting took no effect"


@pytest.mark.slow
def test_lr_schedule_is_warmup_then_cosine(invariance_runs: dict[str, Path]) -> None:
    lrs = [r["lr"] for r in _rows(invariance_runs["w2_a4"])]
    # warmup_steps=2: 1/2, 2/2 of 1e-3, then cosine from 1e-3 to 1e-4 (min_lr_ratio 0.1) over 4 steps
    cosine = [1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx([5e-4, 1e-3, *cosine], rel=1e-9)


@pytest.mark.slow
def test_compiled_ddp_training_matches_eager(
    invariance_runs: dict[str, Path], small_vocab_data: Path, tmp_path: Path
) -> None:
    """`compile: true` (the gpt2-124m preset's setting) on a DDP-wrapped model takes the same steps as eager to
    float round-off; evaluation and sampling run on the compiled model, and the weights keep their names."""
    out = tmp_path / "compiled"
    args = ["train", *COMMON, "--data_dir", str(small_vocab_data), "--out_dir", str(out), "--compile", "true"]
    args += ["--micro_batch_size", "2", "--total_batch_size", "256", "--eval_every", "3", "--eval_steps", "1"]
    inductor = tmp_path / "inductor"  # a fresh cache: what it holds afterwards shows that inductor compiled
    proc = run_cmd(accelerate_cmd(2, *args, "--sample_tokens", "4"), timeout=600, TORCHINDUCTOR_CACHE_DIR=str(inductor))
    assert "2 process(es) on cpu" in proc.stderr and "sample at step 3" in proc.stderr
    assert any(inductor.rglob("*.py")), "no kernels were generated: the model did not compile"
    eager, compiled = _rows(invariance_runs["w2_a4"]), _rows(out)
    assert [r["step"] for r in compiled] == list(range(1, 7)) and "val_loss" in compiled[2]
    for re_, rc in zip(eager, compiled, strict=True):
        assert abs(re_["loss"] - rc["loss"]) < 1e-4, (re_, rc)
    we, wc = load_file(str(invariance_runs["w2_a4"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert we.keys() == wc.keys()
    assert max((we[k] - wc[k]).abs().max().item() for k in we) < 1e-4


@pytest.mark.slow
def test_chunked_loss_ddp_training_matches_the_full_logits_path(
    invariance_runs: dict[str, Path], small_vocab_data: Path, tmp_path: Path
) -> None:
    """`--loss_chunk` (the LM head + loss a few rows at a time, gradients computed in forward) under DDP takes the
    same steps as the plain path: its gradients reach the tied embedding and are synced like any other."""
    out = tmp_path / "chunked"
    args = ["train", *COMMON, "--data_dir", str(small_vocab_data), "--out_dir", str(out), "--loss_chunk", "5"]
    args += ["--micro_batch_size", "2", "--total_batch_size", "256"]
    proc = run_cmd(accelerate_cmd(2, *args), timeout=300)
    assert "2 process(es) on cpu" in proc.stderr
    plain, chunked = _rows(invariance_runs["w2_a4"]), _rows(out)
    for rp, rc in zip(plain, chunked, strict=True):
        assert abs(rp["loss"] - rc["loss"]) < 1e-5, (rp, rc)
        assert abs(rp["grad_norm"] - rc["grad_norm"]) <= 1e-4 * rp["grad_norm"], (rp, rc)
    wp, wc = load_file(str(invariance_runs["w2_a4"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert max((wp[k] - wc[k]).abs().max().item() for k in wp) < 1e-5


@pytest.fixture(scope="session")
def grad_run(tmp_path_factory: pytest.TempPathFactory, small_vocab_data: Path) -> Path:
    out = tmp_path_factory.mktemp("grad")
    flags = [*COMMON, "--data_dir", str(small_vocab_data), "--micro_batch_size", "2", "--total_batch_size", "128"]
    launch = accelerate_cmd(2, "x")[:-2]  # the launcher prefix, without "run.py x"
    run_cmd([*launch, "tests/workers/grad_and_windows.py", str(out), "3", *flags], timeout=300)
    return out


@pytest.mark.slow
def test_each_rank_reads_only_its_windows(grad_run: Path, small_vocab_data: Path) -> None:
    """Rank r reads only micro-batches r, r+2, r+4, ... of the seeded stream (plus the one batch the
    loader fetches ahead); together the ranks read every window of the 3 global batches consumed."""
    infos = [json.loads((grad_run / f"windows_{r}.json").read_text()) for r in range(2)]
    assert all(info["num_processes"] == 2 for info in infos)
    assert all(info["accum"] == 2 for info in infos)  # 128 tokens / (2 seq * 16 tokens * 2 ranks)
    stream = WindowSampler(4 * ((9_000 - 1) // 16), seed=7).permutation(0).tolist()
    micro_batches = [stream[j * 2 : (j + 1) * 2] for j in range(64)]
    read = [{w for step in info["windows"] for w in step} for info in infos]
    assert not read[0] & read[1], "two ranks read the same window"
    for rank in range(2):
        own = {w for j, batch in enumerate(micro_batches) if j % 2 == rank for w in batch}
        assert read[rank] <= own, f"rank {rank} read windows of the other rank's batches"
    consumed = set(stream[: 3 * 8])  # 3 steps x 8 sequences
    assert consumed <= read[0] | read[1]


@pytest.mark.slow
def test_accumulated_gradient_equals_full_batch_gradient(grad_run: Path, small_vocab_data: Path) -> None:
    """Adam hides a wrongly scaled gradient, so compare the synced gradient itself with one plain
    loss.backward() over the whole global batch of 8 sequences."""
    from accelerate.utils import set_seed

    from accel_gpt.data.loader import TokenWindows

    set_seed(7)  # what build() does before creating the model
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=VOCAB))
    windows = TokenWindows(small_vocab_data, "train", 16)
    ids = WindowSampler(len(windows), seed=7).permutation(0)[:8].tolist()  # step 0's global batch
    x = torch.stack([windows[i][0] for i in ids])
    y = torch.stack([windows[i][1] for i in ids])
    _, loss = model(x, y)
    loss.backward()
    synced = torch.load(grad_run / "grads.pt")
    for name, p in model.named_parameters():
        assert torch.allclose(synced[name], p.grad, atol=1e-6, rtol=0), name


# ------------------------------------------------------------------------------------------ HellaSwag in the loop

HELLASWAG_LIMIT = 10
HELLASWAG_STEPS = [3, 5]  # every 3 steps, and the last step (5)


@pytest.fixture(scope="module")
def hellaswag_run(tmp_path_factory: pytest.TempPathFactory, shakespeare_shards: Path) -> dict:
    """W=2 trains 5 steps of a tiny model with GPT-2's vocabulary (HellaSwag is scored with GPT-2's tokens),
    scoring the first 10 HellaSwag rows every 3 steps and at the end, and saving at the same steps; then
    `run.py eval` scores each of those checkpoints with the same rows and batch size."""
    root = tmp_path_factory.mktemp("hellaswag")
    out = root / "run"
    args = ["train", "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "64", "--vocab_size", "50304"]
    args += ["--micro_batch_size", "2", "--total_batch_size", "256", "--max_steps", "5", "--seed", "7"]
    args += ["--learning_rate", "3e-3", "--warmup_steps", "1", "--eval_every", "0", "--sample_tokens", "0"]
    args += ["--save_every", "3", "--keep_checkpoints", "0", "--log_every", "2", "--log_with", "none"]
    args += ["--hellaswag", str(HELLASWAG), "--hellaswag_every", "3", "--hellaswag_limit", str(HELLASWAG_LIMIT)]
    args += ["--data_dir", str(shakespeare_shards), "--out_dir", str(out)]
    proc = run_cmd(accelerate_cmd(2, *args), timeout=600)
    assert "2 process(es) on cpu" in proc.stderr, "the launch did not form one group of that size"
    evals = {}
    for step in HELLASWAG_STEPS:
        ckpt = out / "checkpoints" / f"step_{step:08d}"
        cmd = python_cmd("eval", "--checkpoint", str(ckpt), "--hellaswag", str(HELLASWAG))
        eval_proc = run_cmd([*cmd, "--limit", str(HELLASWAG_LIMIT), "--batch_size", "2"], timeout=300)
        evals[step] = json.loads(eval_proc.stdout.strip().splitlines()[-1])
    return {"run": out, "stderr": proc.stderr, "evals": evals}


@pytest.mark.slow
def test_hellaswag_in_training_matches_run_eval_on_the_checkpoint(hellaswag_run: dict) -> None:
    """The in-loop HellaSwag (DDP model, 2 ranks each scoring its share) gives the very accuracies that
    `run.py eval` gives on the checkpoint saved at that step, on the rows of the due steps only."""
    rows = _rows(hellaswag_run["run"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "hellaswag_acc_norm" in r] == HELLASWAG_STEPS
    assert [r["step"] for r in rows if "hellaswag_acc" in r] == HELLASWAG_STEPS
    for r in rows:
        if r["step"] not in HELLASWAG_STEPS:
            continue
        evaluated = hellaswag_run["evals"][r["step"]]
        assert evaluated["total"] == HELLASWAG_LIMIT
        assert (r["hellaswag_acc_norm"], r["hellaswag_acc"]) == (evaluated["acc_norm"], evaluated["acc"]), r
        acc, stderr = r["hellaswag_acc_norm"], r["hellaswag_acc_norm_stderr"]
        logged = f"HellaSwag at step {r['step']}: acc_norm {acc:.4f} ± {stderr:.4f} on {HELLASWAG_LIMIT}"
        assert logged in hellaswag_run["stderr"]


# ------------------------------------------------------------------------------------------ learning


@pytest.mark.slow
def test_loss_falls_on_shakespeare(tmp_path: Path, shakespeare_shards: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--config", "tiny-cpu", "--data_dir", str(shakespeare_shards), "--out_dir", str(out)]
    args += ["--max_steps", "100", "--eval_every", "100", "--save_every", "0", "--log_with", "none"]
    run_cmd(python_cmd(*args), timeout=600)
    rows = _rows(out)
    assert len(rows) == 100
    first = np.mean([r["loss"] for r in rows[:5]])
    last = np.mean([r["loss"] for r in rows[-5:]])
    assert first > 10.0  # ln(50304) = 10.8 at init
    assert last < first - 3.0, (first, last)
    assert rows[-1]["val_loss"] < first - 3.0
    for name in ("config.yaml", "metrics.jsonl", "model.safetensors", "model_config.json"):
        assert (out / name).is_file(), name


def test_no_mfu_without_a_known_peak() -> None:
    """A CPU has no honest peak FLOP/s to divide by: no MFU (null in metrics.jsonl, "-" in the benchmark's table)."""
    from accel_gpt.tracking import device_peak_flops
    from bench.train_throughput import mfu

    assert device_peak_flops(torch.device("cpu")) is None
    assert mfu(5e9, None) == "-" and mfu(5e9, 1e10) == "50.0%"
