"""Plain `torchrun`, without `accelerate launch`: the group forms, and mixed precision comes from the train setting
(torchrun sets none), which also replaces what a launch set, saying so in one line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import run_cmd, write_token_shards

VOCAB = 256
FLAGS = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--seq_len", "16", "--vocab_size", str(VOCAB)]
FLAGS += ["--micro_batch_size", "2", "--total_batch_size", "64", "--eval_every", "0", "--sample_tokens", "0"]
FLAGS += ["--log_with", "none", "--warmup_steps", "1", "--max_steps", "3", "--save_every", "0"]


@pytest.mark.slow
def test_plain_torchrun_trains_in_the_mixed_precision_the_setting_names(
    tmp_path: Path, shakespeare_tokens: list[int]
) -> None:
    data = write_token_shards(tmp_path / "data", [t % VOCAB for t in shakespeare_tokens[:20_000]], vocab_size=VOCAB)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "run.py", "train"]
    cmd += [*FLAGS, "--data_dir", str(data), "--out_dir", str(out), "--mixed_precision", "bf16"]
    proc = run_cmd(cmd, timeout=240, ACCELERATE_MIXED_PRECISION="no")  # as if a launch had asked for none
    assert "2 process(es) on cpu (data parallel over gloo)" in proc.stderr, proc.stderr[-3000:]
    assert "| mixed precision bf16 (mixed_precision setting), " in proc.stderr
    assert proc.stderr.count("mixed_precision bf16 (train setting) replaces the launch's no") == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert (out / "model.safetensors").is_file()
