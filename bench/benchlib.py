"""What the benchmarks share: benchmark data, child-process runs, alternation, statistics and tables.

Every measured run is a fresh child process, so both sides of a comparison start from the same state
(allocator, thread pool, compile caches in memory) under exactly the same environment, and the sides
alternate (A B, B A, ...) so that the machine's drift falls on both alike.

    python bench/benchlib.py [--text FILE] [--tokenizer gpt2|char]   # write the benchmark shards, print their folder
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUNS = REPO / "runs" / "bench"  # /runs/ is git-ignored
TEXT = REPO / "tests" / "data" / "tinyshakespeare.txt"  # 250 KB; --text FILE for a larger corpus


# ------------------------------------------------------------------------------------------------ data


def bench_data(text: Path = TEXT, tokenizer: str = "gpt2") -> Path:
    """`text` as token shards (train: first 90%, val: last 10%), written once under runs/bench/data/.

    GPT-2 tokens come from tiktoken alone (EOT before every blank-line-separated paragraph, as `prepare`
    writes them), so this works where `datasets` is missing; `char` gives a vocabulary of a few dozen ids.
    """
    import numpy as np

    from accel_gpt.data.shards import ShardWriter, tokenizer_fields, write_manifest
    from accel_gpt.tokenizer import Tokenizer, char_vocabulary

    text = Path(text)
    data_dir = RUNS / "data" / f"{text.stem}-{text.stat().st_size}-{tokenizer}"
    manifest = data_dir / "manifest.json"
    if manifest.is_file() and "bytes" in json.loads(manifest.read_text()):  # written before byte counts: again
        return data_dir
    content = text.read_text(encoding="utf-8")
    if tokenizer == "char":
        tok = Tokenizer("char", char_vocabulary([content]))
        tokens = tok.encode_array(content)
    else:
        import tiktoken

        tok = Tokenizer("gpt2")
        docs = [p for p in content.split("\n\n") if p]
        ids = tiktoken.get_encoding("gpt2").encode_ordinary_batch(docs)
        tokens = np.concatenate([np.asarray([tok.eot_token, *doc], dtype=tok.dtype) for doc in ids])
    data_dir.mkdir(parents=True, exist_ok=True)
    cut = len(tokens) * 9 // 10
    splits = {}
    for split, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
        writer = ShardWriter(data_dir, split, 0, tok.dtype, tok.token_bytes())  # byte counts: val_bpb in the runs
        writer.write(part)
        splits[split] = [writer.close()]
    nbytes = {split: entries[0]["bytes"] for split, entries in splits.items()}
    write_manifest(data_dir, {**tokenizer_fields(tok), "splits": splits, "bytes": nbytes})
    return data_dir


# ------------------------------------------------------------------------------------------------ runs


def child_env(threads: int | None = None) -> dict[str, str]:
    """The environment every child runs under: offline, unbuffered, this checkout first on PYTHONPATH, the same
    threads, and (unless the caller set one) a compile cache emptied once per benchmark invocation, so that
    its first compiling run shows the cold compile time and later ones the warm one."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        env.update(
            TORCHINDUCTOR_CACHE_DIR=str(compile_cache() / "inductor"), TRITON_CACHE_DIR=str(compile_cache() / "triton")
        )
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


@functools.cache
def compile_cache() -> Path:
    """Emptied once per benchmark invocation."""
    path = RUNS / "compile-cache"
    shutil.rmtree(path, ignore_errors=True)
    return path


@dataclass
class Child:
    """One finished child process: exit code, wall seconds, peak memory in bytes (None if unknown), its log."""

    returncode: int
    seconds: float
    peak_mem: int | None
    log: str


def run_child(
    cmd: Sequence[str], env: dict[str, str], log_path: Path, gpu: bool, stop_after: tuple[Path, int] | None = None
) -> Child:
    """Run `cmd` with its output in `log_path`. Peak memory: on GPU the most device memory in use (nvidia-smi,
    every 200 ms: CUDA context and allocator cache included); on CPU the child tree's max RSS (wait4).
    `stop_after` (a run's metrics.jsonl, n): SIGTERM the run once it has logged n steps, so that a run set up for
    its full length (which decides what `auto` picks) is measured for only a few steps; it saves and exits 0."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    poller = GpuMemoryPoller() if gpu else None
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        ended = threading.Event()  # set once the child is reaped: the watcher never reaps it nor signals after
        if stop_after:
            threading.Thread(target=_stop_after, args=(proc.pid, ended, *stop_after), daemon=True).start()
        _, status, usage = os.wait4(proc.pid, 0)
        ended.set()
    seconds = time.perf_counter() - start
    peak = poller.stop() if poller else usage.ru_maxrss * 1024
    return Child(os.waitstatus_to_exitcode(status), seconds, peak, log_path.read_text(errors="replace"))


def _stop_after(pid: int, ended: threading.Event, metrics: Path, steps: int) -> None:
    """SIGTERM `pid` once `metrics` holds `steps` complete step lines (each with its window's tokens_per_sec)."""
    while not ended.wait(0.2):
        try:
            lines = metrics.read_text().splitlines(keepends=True)
        except OSError:
            lines = []
        if sum(line.endswith("\n") and '"tokens_per_sec"' in line for line in lines) >= steps:
            os.kill(pid, signal.SIGTERM)  # unreaped until `ended`: at worst a zombie, never another process
            return


class GpuMemoryPoller:
    """The highest `memory.used` any GPU reports while it runs (one `nvidia-smi -lms` process)."""

    def __init__(self, period_ms: int = 200) -> None:
        self.peak: int | None = None
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"]
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.peak = max(self.peak or 0, int(line) * 2**20)  # MiB

    def stop(self) -> int | None:
        if self.proc:
            self.proc.terminate()
            self.thread.join(timeout=5)
        return self.peak


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi (asking torch would put a CUDA context in the parent)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def peak_bf16_flops(name: str) -> float | None:
    """The dense bf16 peak of a GPU by name, from the table the trainer's MFU uses."""
    from accel_gpt.tracking import PEAK_BF16_FLOPS

    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def alternate(labels: Sequence[str], pairs: int) -> Iterator[tuple[int, str]]:
    """(round, label) for `pairs` rounds, the order reversed every other round: A B, B A, A B, ..."""
    for i in range(pairs):
        for label in labels if i % 2 == 0 else labels[::-1]:
            yield i, label


def read_steps(metrics: Path, tokens_per_step: int) -> tuple[list[float], list[float]]:
    """Seconds and loss of each optimizer step in a metrics.jsonl (`tokens_per_sec` is its log window's)."""
    from accel_gpt.metrics import read_metrics

    rows = sorted((r for r in read_metrics(metrics) if r.get("tokens_per_sec")), key=lambda r: r["step"])
    return [tokens_per_step / r["tokens_per_sec"] for r in rows], [r["loss"] for r in rows]


# ------------------------------------------------------------------------------------------- printing


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}"


def fmt_bytes(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def fmt_flops(flops: float) -> str:
    return f"{flops / 1e12:,.1f} T" if flops >= 1e12 else f"{flops / 1e9:,.2f} G"


def table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, ["-" * w for w in widths], *rows]
    ]
    return "\n".join(lines)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def header(name: str) -> str:
    """What was measured: the accel_gpt this process imported (its path proves which checkout), torch, and the CPU's
    class (figures differ by class: docs/speed.md)."""
    import torch

    import accel_gpt

    return (
        f"{name}: accel_gpt from {Path(accel_gpt.__file__).parent}, torch {torch.__version__}; {load_average()}\n"
        f"CPU: {cpu_class()}"
    )


def cpu_class() -> str:
    """The CPU's class as accel_gpt decides by it, with the facts behind it: torch's vector level, the bf16 and AMX
    flags, and a oneDNN cap from the environment."""
    import torch

    from accel_gpt.precision import cpu_capability

    flags = {name: getattr(torch.cpu, f"_is_{name}_supported", lambda: False)() for name in ("avx512_bf16", "amx_tile")}
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    said = ", ".join(f"{name} {'yes' if has else 'no'}" for name, has in flags.items())
    capped = f", ONEDNN_MAX_CPU_ISA={cap}" if cap else ""
    return f"{cpu_capability().units} (get_cpu_capability {torch.backends.cpu.get_cpu_capability()}, {said}{capped})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=TEXT, help="plain text (default: tests/data/tinyshakespeare.txt)")
    parser.add_argument("--tokenizer", choices=["gpt2", "char"], default="gpt2")
    args = parser.parse_args()
    print(bench_data(args.text, args.tokenizer))
