"""Shared test setup: offline tokenizer/hub settings and helpers for launching real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"  # a slice of tiny Shakespeare and 50 HellaSwag rows (see its README)
SHAKESPEARE = DATA / "tinyshakespeare.txt"
HELLASWAG = DATA / "hellaswag_val.jsonl"

# Only tiktoken's GPT-2 BPE files come from outside: TIKTOKEN_CACHE_DIR, as for any user offline. A relative one
# (`../some/tiktoken_cache`) names a folder from where pytest starts, and the quick start runs the manual's commands in
# folders of their own: it is made absolute here, for them.
if os.environ.get("TIKTOKEN_CACHE_DIR"):
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.abspath(os.environ["TIKTOKEN_CACHE_DIR"])
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for launched processes: one thread each, CPU gloo group, offline."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1")
    env.update(extra)
    return env


def run_cmd(args: list[str], timeout: float = 300, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run a command from the repo root; on failure show its stderr in the assertion message."""
    proc = subprocess.run(args, cwd=REPO, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(args)}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, "run.py", *args]


def accelerate_cmd(num_processes: int, *args: str) -> list[str]:
    """`accelerate launch` of run.py with W CPU processes forming one gloo group."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no"]
    if num_processes > 1:
        launch += ["--multi_gpu", "--num_processes", str(num_processes)]
    else:
        launch += ["--num_processes", "1"]
    return [*launch, "--main_process_port", str(_free_port()), "run.py", *args]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    return SHAKESPEARE


def write_token_shards(
    data_dir: Path,
    train: list[int],
    val: list[int] | None = None,
    shard_size: int | None = None,
    vocab_size: int = 50257,
) -> Path:
    """Shards + manifest in the `prepare` format, straight from token lists: GPT-2 ids, or with another
    `vocab_size` ids declared as a char vocabulary of that many characters, chr(0) .. chr(vocab_size - 1) (a
    manifest's vocab_size must be its tokenizer's; which characters they are does not matter to tests of
    arithmetic, except through the byte counts: ids below 128 are 1 byte of UTF-8, ids from 128 to 2047 are 2)."""
    import numpy as np

    from accel_gpt.data.shards import ShardWriter, tokenizer_fields, write_manifest
    from accel_gpt.tokenizer import GPT2_VOCAB, Tokenizer, dtype_for_vocab

    data_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    tok = Tokenizer("gpt2") if vocab_size == GPT2_VOCAB else Tokenizer("char", "".join(map(chr, range(vocab_size))))
    top = max((int(np.max(tokens)) for tokens in (train, val) if tokens is not None and len(tokens)), default=0)
    table = np.pad(tok.token_bytes(), (0, max(0, top + 1 - vocab_size)))  # ids beyond the vocabulary: no text
    splits = {}
    for split, tokens in (("train", train), ("val", val)):
        if tokens is None:
            continue
        arr = np.asarray(tokens, dtype=dtype)
        size = shard_size or len(arr)
        splits[split] = []
        for i, start in enumerate(range(0, len(arr), size)):
            writer = ShardWriter(data_dir, split, i, dtype, table)
            writer.write(arr[start : start + size])
            splits[split].append(writer.close())
    counts = {split: sum(e["bytes"] for e in entries) for split, entries in splits.items()}
    write_manifest(data_dir, {**tokenizer_fields(tok), "splits": splits, "bytes": counts})
    return data_dir


def strip_byte_counts(data_dir: Path) -> Path:
    """Rewrite the manifest of `data_dir` as `prepare` wrote it before it counted bytes (no `bytes`, per split or
    per shard)."""
    import json

    path = data_dir / "manifest.json"
    manifest = {k: v for k, v in json.loads(path.read_text()).items() if k != "bytes"}
    splits = manifest["splits"].items()
    manifest["splits"] = {s: [{k: v for k, v in e.items() if k != "bytes"} for e in entries] for s, entries in splits}
    path.write_text(json.dumps(manifest))
    return data_dir


@pytest.fixture(scope="session")
def shakespeare_tokens(shakespeare_path: Path) -> list[int]:
    import tiktoken

    return tiktoken.get_encoding("gpt2").encode_ordinary(shakespeare_path.read_text())


@pytest.fixture(scope="session")
def shakespeare_shards(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    """Tiny Shakespeare as GPT-2 token shards: the last 10% of tokens are the validation split."""
    cut = len(shakespeare_tokens) * 9 // 10
    return write_token_shards(
        tmp_path_factory.mktemp("shakespeare") / "data", shakespeare_tokens[:cut], shakespeare_tokens[cut:]
    )


# The settings of `tiny_run`: evaluations at steps 2 and 4 on 3 batches of 2 windows (not eval's defaults, so that
# an eval that ignored the run's settings would report another val_loss), HellaSwag on 8 examples at step 4.
TINY_RUN_FLAGS = [
    "--config", "tiny-cpu", "--max_steps", "4", "--micro_batch_size", "2", "--eval_every", "2", "--eval_windows", "6",
    "--hellaswag_every", "4", "--hellaswag", str(HELLASWAG), "--hellaswag_limit", "8", "--save_every", "2",
    "--sample_tokens", "0", "--log_with", "none",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 4-step tiny-cpu run (`TINY_RUN_FLAGS`) on a prepared slice of tiny Shakespeare, with checkpoints at
    steps 2 and 4 and its final weights: what a run directory holds for `export` and `eval` to read. What the run
    printed (its log and summary line) is kept beside it, in `train_output.txt`."""
    from accel_gpt.config import PrepareConfig
    from accel_gpt.data.prepare import prepare

    root = tmp_path_factory.mktemp("tiny_run")
    text = root / "shakespeare.txt"
    text.write_text(SHAKESPEARE.read_text()[:60_000])
    data = root / "data"
    prepare(PrepareConfig(dataset=str(text), out_dir=str(data), val_tokens=3000))
    run = root / "run"
    proc = run_cmd(python_cmd("train", *TINY_RUN_FLAGS, "--data_dir", str(data), "--out_dir", str(run)), timeout=600)
    (root / "train_output.txt").write_text(proc.stderr)
    return run


def front_matter(card: str) -> tuple[dict, str]:
    """The card's YAML metadata block and the Markdown after it."""
    assert card.startswith("---\n"), card[:200]
    meta, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(meta), body


def table(body: str) -> dict[str, str]:
    """The training table's rows: name -> value."""
    rows = [line.strip("|").split("|") for line in body.splitlines() if line.startswith("| ") and "---" not in line]
    return {name.strip(): value.strip() for name, value in rows if name.strip()}


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A datasets cache of the tests' own: the Arrow caches of their tiny files never touch the user's. Session-wide,
    so that module fixtures which prepare data use it too."""
    import datasets

    cache = tmp_path_factory.getbasetemp() / "hf_datasets_cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        patch.setenv("HF_DATASETS_CACHE", str(cache))
        yield cache


class ShardCommitted(Exception):
    """Raised right after a prepare commits its first shard: a kill at that point."""


def prepare_stopped_after_first_shard(cfg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `prepare(cfg)` until its first shard is committed and stop it there, state saved, as a kill would."""
    from accel_gpt.data import pipeline
    from accel_gpt.data.prepare import prepare

    commit = pipeline.StreamWriter._commit

    def crashing_commit(self: Any, resume: Any) -> None:
        commit(self, resume)
        raise ShardCommitted

    monkeypatch.setattr(pipeline.StreamWriter, "_commit", crashing_commit)
    with pytest.raises(ShardCommitted):
        prepare(cfg)
    monkeypatch.undo()


def is_utf8(data: bytes) -> bool:
    """Whether `data` decodes as UTF-8 alone (a token holding part of a character does not)."""
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
