"""The `shakespeare-char` presets end to end: the character-level Shakespeare GPT of the DDP tutorials, prepared
with the char tokenizer, trained by 2 CPU processes in one gloo group, then sampled.

The test's text is the tiny Shakespeare slice in tests/data (the preset downloads the whole file), and the model is
shrunk by flags so that the run takes seconds: what is checked is the path, the preset's own settings and that
the model learns characters, not nanoGPT's final loss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import SHAKESPEARE, accelerate_cmd, python_cmd, run_cmd

from accel_gpt.data import shards

# Smaller than the preset (6 x 384, 256 characters, 5,000 steps of 16,384): 2 x 64, 64 characters, 40 steps of
# 2,048 = 2 processes x 2 micro-steps x 8 sequences x 64.
SMALL = [
    "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--seq_len", "64", "--total_batch_size", "2048",
    "--max_steps", "40", "--warmup_steps", "5", "--learning_rate", "3e-3", "--eval_every", "20", "--eval_steps", "4",
    "--sample_tokens", "32", "--save_every", "0", "--log_with", "none",
]  # fmt: skip


@pytest.mark.slow
def test_prepare_train_on_two_processes_and_sample(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    run_cmd(python_cmd("prepare", "--preset", "shakespeare-char", "--dataset", str(SHAKESPEARE), "--out_dir",
                       str(data), "--val_tokens", "20000"))  # fmt: skip
    manifest = shards.read_manifest(data)
    chars = manifest["chars"]
    assert manifest["tokenizer"] == "char" and chars == "".join(sorted(set(SHAKESPEARE.read_text())))
    assert manifest["tokens"] == {"train": len(SHAKESPEARE.read_text()) - 20_000, "val": 20_000}

    train = run_cmd(accelerate_cmd(2, "train", "--config", "shakespeare-char", "--data_dir", str(data), "--out_dir",
                                   str(run), *SMALL), timeout=600)  # fmt: skip
    assert "2 process(es) on cpu" in train.stderr, train.stderr[-3000:]
    assert "2 micro-steps x 8 sequences x 64 tokens" in train.stderr
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["config"], config["vocab_size"], config["beta2"], config["micro_batch_size"]) == (
        "shakespeare-char",
        65,
        0.99,
        8,
    )  # the preset's own settings, under the flags that shrink the model
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[0]["loss"] > 4.0 and rows[-1]["loss"] < 3.0  # from about ln(65) to below the character frequencies
    assert rows[-1]["val_loss"] < 3.0
    # one character a token: bits per byte is bits per character here (the slice is ASCII: one byte each)
    assert manifest["bytes"] == {"train": len(SHAKESPEARE.read_bytes()) - 20_000, "val": 20_000}
    assert rows[-1]["val_bpb"] == pytest.approx(rows[-1]["val_loss"] / math.log(2), rel=1e-12)

    sample = run_cmd(python_cmd("sample", "--checkpoint", str(run), "--prompt", "ROMEO:", "--max_new_tokens", "60",
                                "--seed", "1", "--device", "cpu"))  # fmt: skip
    text = sample.stdout.removesuffix("\n")
    # one character per token (an id of the vocabulary's unused rows, if ever drawn, is no character)
    assert text.startswith("ROMEO:") and len("ROMEO:") + 50 <= len(text) <= len("ROMEO:") + 60
    assert set(text) <= set(chars)
    assert sample.stderr.strip().splitlines()[-1:] == [
        "warning: the samples outgrew the model's 64-token context (prompt 6 tokens + 60 new): past it, each new "
        "token was predicted from the 64 tokens before it"
    ]
