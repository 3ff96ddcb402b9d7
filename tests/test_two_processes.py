"""Two of our processes on one folder: a command that reads a folder another one is still writing refuses in one line
(and writes nothing), or reads only what is final; it never builds from half of it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, python_cmd, run_cmd, subprocess_env

from accel_gpt.cli import parse
from accel_gpt.data import shards
from accel_gpt.data.prepare import STATE_FILE
from accel_gpt.train import train

TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--micro_batch_size", "2"]
TINY += ["--total_batch_size", "32", "--log_with", "none", "--sample_tokens", "0", "--eval_windows", "2"]
BPE = ["--tokenizer", "bpe", "--vocab_size", "300", "--val_tokens", "2000"]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "data"
    run_cmd(python_cmd("prepare", "--dataset", str(shakespeare_path), *BPE, "--out_dir", str(out)))
    return out


def stopped_prepare(src: Path, out: Path) -> subprocess.Popen:
    """A real prepare of `src` into `out`, stopped (SIGSTOP) once it has committed a shard: it holds out's lock, its
    tokenizer.json is there and its manifest is not."""
    argv = python_cmd("prepare", "--dataset", str(src), *BPE, "--shard_size", "5000", "--task_chars", "20000")
    proc = subprocess.Popen([*argv, "--out_dir", str(out)], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    for _ in range(12_000):
        assert proc.poll() is None, "prepare ended before it could be stopped"
        try:
            if json.loads((out / STATE_FILE).read_text())["shards"]:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        subprocess.run(["sleep", "0.01"])
    proc.send_signal(signal.SIGSTOP)
    return proc


@pytest.mark.slow
def test_train_and_eval_refuse_a_data_dir_a_prepare_still_writes(
    tmp_path: Path, shakespeare_path: Path, tiny_run: Path
) -> None:
    """The manifest is not there yet: train must not size its embedding from a guess (it once took GPT-2's 50,304
    ids for 300-id data, and every resume kept that size), nor tell the user to prepare again elsewhere."""
    src = tmp_path / "big.txt"
    src.write_text(shakespeare_path.read_text() * 3)
    data, out = tmp_path / "data", tmp_path / "run"
    prepare = stopped_prepare(src, data)
    try:
        assert (data / "tokenizer.json").is_file() and not (data / shards.MANIFEST).exists()
        holder = f"pid {prepare.pid} on {os.uname().nodename}"
        expected = f"error: data_dir '{data}' is being written by a prepare ({holder})"
        for argv in (
            ["train", *TINY, "--data_dir", str(data), "--out_dir", str(out), "--max_steps", "1"],
            ["eval", "--checkpoint", str(tiny_run), "--data_dir", str(data), "--hellaswag", ""],
        ):
            done = run_cmd(python_cmd(*argv), check=False)
            assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(expected), done.stderr
            assert "wait for it to finish" in done.stderr and "prepare it again" not in done.stderr
        assert not out.exists()
    finally:
        prepare.send_signal(signal.SIGCONT)
        prepare.communicate(timeout=300)
    assert prepare.returncode == 0
    run_cmd(python_cmd("train", *TINY, "--data_dir", str(data), "--out_dir", str(out), "--max_steps", "1"))
    assert yaml.safe_load((out / "config.yaml").read_text())["vocab_size"] == 384  # 300 ids, padded to 128s


def test_a_manifest_that_appears_after_the_config_was_read_sizes_the_model(tmp_path: Path, bpe_data: Path) -> None:
    """The config is read while the folder has no manifest (a prepare about to finish); the manifest that train then
    reads is the one the model is sized from."""
    data, out = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    _, cfg = parse(["train", *TINY, "--data_dir", str(data), "--out_dir", str(out), "--max_steps", "1"])
    assert cfg.vocab_size is None  # unknown, not GPT-2's 50,304
    shutil.copytree(bpe_data, data, dirs_exist_ok=True)
    train(cfg)
    assert yaml.safe_load((out / "config.yaml").read_text())["vocab_size"] == 384
    assert json.loads((out / "model_config.json").read_text())["model"]["vocab_size"] == 384
