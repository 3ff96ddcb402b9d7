"""Shared test setup: offline tokenizer/hub settings and helpers for launching real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

# tiktoken fetches the GPT-2 BPE files on first use; the real files are cached beside the repo.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))
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
    return SHARED / "data" / "tinyshakespeare.txt"
