"""Shared pieces of the benchmarks: benchmark data, child-process runs of both sides, statistics, tables.

Every measured run is a fresh child process (`worker.py`), for two reasons: both sides then start from the
same state (allocator, thread pool, compile caches in memory), and the parent can give both exactly the
same environment (threads, glibc malloc settings). The two sides alternate (A B, B A, ...) so that the
machine's drift (FACTS.md: ~16% between calls) falls on both alike.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "worker.py"
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
TIKTOKEN_CACHE = REPO.parent / "shared" / "tiktoken_cache"
BENCH_DIR = REPO / "runs" / "bench"  # /runs/ is git-ignored

# Flags that turn off everything but training steps: the benchmark times the step, not eval or saving.
STEP_ONLY_FLAGS = ["--eval_every", "0", "--save_every", "0", "--hellaswag_every", "0", "--log_with", "none"]

# A near-empty model (1 layer, width 16, vocab 128; 2 micro-steps of 1 x 16 tokens): its step costs ~nothing,
# so what a step takes is the loop's own per-step cost. Used with synthetic_data(128).
OVERHEAD_FLAGS = (
    "--n_layer 1 --n_head 1 --n_embd 16 --seq_len 16 --vocab_size 128 --micro_batch_size 1 --total_batch_size 32"
)

# The glibc settings accel_gpt applies to itself on CPU (distributed.keep_freed_memory), as environment variables.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


# ------------------------------------------------------------------------------------------------ data


def ensure_data(data_dir: str | None) -> tuple[Path, str]:
    """A prepared data dir for the benchmark and a word on where it came from.

    Throughput does not depend on which tokens are read, so without tiny Shakespeare or the tiktoken
    files (a GPU machine may have neither) random GPT-2 token ids stand in, and the output says so.
    """
    if data_dir:
        return Path(data_dir), f"given ({data_dir})"
    shakespeare = BENCH_DIR / "data-shakespeare"
    if (shakespeare / "manifest.json").is_file():
        return shakespeare, "tiny Shakespeare, GPT-2 tokens"
    if SHAKESPEARE.is_file() and TIKTOKEN_CACHE.is_dir():  # offline: tiktoken would try to download
        try:
            return write_shards(shakespeare, shakespeare_tokens()), "tiny Shakespeare, GPT-2 tokens"
        except Exception as e:  # no BPE files offline: fall through to synthetic tokens
            print(f"note: cannot tokenize {SHAKESPEARE} ({type(e).__name__}: {e}); using random tokens", flush=True)
    return synthetic_data(50257), "synthetic: 2M uniform random GPT-2 token ids"


def synthetic_data(vocab_size: int, tokens: int = 2_000_000) -> Path:
    """Uniform random token ids below `vocab_size`, written once."""
    data_dir = BENCH_DIR / f"data-synthetic-v{vocab_size}"
    if not (data_dir / "manifest.json").is_file():
        import numpy as np

        write_shards(data_dir, np.random.default_rng(0).integers(0, vocab_size, size=tokens), vocab_size)
    return data_dir


def shakespeare_tokens() -> list[int]:
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    import tiktoken

    return tiktoken.get_encoding("gpt2").encode_ordinary(SHAKESPEARE.read_text())


def write_shards(data_dir: Path, tokens: list[int], vocab_size: int = 50257) -> Path:
    """One train and one val shard (last 10%) in the `prepare` format, via accel_gpt's own writers."""
    import numpy as np

    from accel_gpt.data.shards import write_manifest, write_shard

    data_dir.mkdir(parents=True, exist_ok=True)
    arr = np.asarray(tokens, dtype=np.uint16)
    cut = len(arr) * 9 // 10
    splits = {
        "train": [write_shard(data_dir, "train", 0, arr[:cut])],
        "val": [write_shard(data_dir, "val", 0, arr[cut:])],
    }
    manifest = {"tokenizer": "gpt2", "eot_token": 50256, "vocab_size": vocab_size, "dtype": "uint16", "splits": splits}
    write_manifest(data_dir, manifest)
    return data_dir


# ------------------------------------------------------------------------------------------ allocator


def default_malloc(cuda: bool) -> str:
    """Both sides must run under the same allocator settings. On CPU accel_gpt calls mallopt itself at start-up
    (distributed.keep_freed_memory: no mmap, large trim threshold), so the plain side gets the same call;
    on GPU the trainer leaves glibc alone and so do both sides."""
    return "default" if cuda else "mallopt"


def child_env(threads: int | None, malloc: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment both sides run under: same threads, same allocator settings, offline.

    `malloc`: "default" (glibc as it comes; accel_gpt still calls mallopt itself on CPU), "env" (MALLOC_ENV for
    the whole process) or "mallopt" (the worker first calls accel_gpt's keep_freed_memory; see side_specs).
    """
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "GLIBC_TUNABLES"}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["ACCELERATE_MIXED_PRECISION"] = "no"  # CPU: fp32 like the plain side; on GPU the launch config overrides
    env.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    # One fresh compile cache per benchmark invocation: its first compiling run shows the cold compile time,
    # later runs the warm one (the cache a user's second run hits).
    env["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache() / "inductor")
    env["TRITON_CACHE_DIR"] = str(compile_cache() / "triton")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if malloc == "env":
        env.update(MALLOC_ENV)
    env.update(extra or {})
    return env


@functools.cache
def compile_cache() -> Path:
    path = BENCH_DIR / "compile-cache"
    shutil.rmtree(path, ignore_errors=True)
    return path


# ------------------------------------------------------------------------------------------------ runs


class ChildFailed(RuntimeError):
    """A child run exited non-zero; `log` is everything it printed (OOM detection reads it)."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n{log[-3000:]}")
        self.log = log


@dataclass
class Spec:
    """One measured child run: which side, which train flags, under which launch and environment."""

    side: str  # "accel_gpt" (run.py train) or "plain" (bench/plain_loop.py)
    label: str
    train_args: list[str]  # --config ... --field value ...: the same for both sides
    warmup: int
    steps: int
    env: dict[str, str]
    cuda: bool = False
    num_processes: int = 1
    worker_flags: list[str] = field(default_factory=list)  # --mallopt, --patch ...


@dataclass
class Result:
    """What one child run measured. Step times are per optimizer step, warm-up excluded."""

    spec: Spec
    step_seconds: list[float]
    warmup_seconds: list[float]
    cpu_seconds: list[float]  # process CPU seconds of the same measured steps
    tokens_per_step: int
    report: dict[str, Any]  # the worker's report: peak memory, device, threads, flops per token, ...
    wall_seconds: float

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens_per_step / statistics.median(self.step_seconds)

    @property
    def tokens_per_cpu_sec(self) -> float:
        """Tokens per second of this process's CPU time: on a loaded machine far steadier than wall time."""
        return self.tokens_per_step / statistics.median(self.cpu_seconds)

    @property
    def compile_seconds(self) -> float:
        """Warm-up time beyond that of ordinary steps: compilation, first-touch allocations."""
        return sum(self.warmup_seconds) - len(self.warmup_seconds) * statistics.median(self.step_seconds)


def side_specs(
    train_args: list[str], *, cuda: bool, warmup: int, steps: int, env: dict[str, str], malloc: str, suffix: str = ""
) -> list[Spec]:
    """accel_gpt (run.py train) and the plain loop on the same flags: bf16 on GPU (the launch config for
    accel_gpt, autocast for plain), fp32 on CPU."""
    flags = ["--mallopt"] if malloc == "mallopt" else []
    return [
        Spec("accel_gpt", f"accel_gpt{suffix}", train_args, warmup, steps, env, cuda=cuda, worker_flags=flags),
        Spec(
            "plain", f"plain{suffix}", train_args, warmup, steps, env, cuda=cuda, worker_flags=flags + ["--bf16"] * cuda
        ),
    ]


def run_spec(spec: Spec, out_dir: Path) -> Result:
    """Run one training side in a child process and read its per-step times."""
    train_args = [*spec.train_args, "--max_steps", str(spec.warmup + spec.steps), *STEP_ONLY_FLAGS]
    report, wall = run_child(spec, train_args, out_dir)
    seconds = step_seconds(report, out_dir / "run")
    cpu = report["step_cpu_seconds"]
    if len(cpu) != len(seconds):
        raise RuntimeError(f"{spec.label}: {len(cpu)} CPU times for {len(seconds)} steps")
    (out_dir / "run" / "model.safetensors").unlink(missing_ok=True)  # 0.5 GB for 124M: not needed
    w = spec.warmup
    return Result(spec, seconds[w:], seconds[:w], cpu[w:], report["tokens_per_step"], report, wall)


def run_child(spec: Spec, train_args: list[str], out_dir: Path) -> tuple[dict[str, Any], float]:
    """`worker.py SIDE` in a fresh process (under `accelerate launch` for accel_gpt on GPU); its report."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    report_path = out_dir / "report.json"
    train_args = [*train_args, "--out_dir", str(out_dir / "run")]
    worker = [str(WORKER), spec.side, "--report", str(report_path), *spec.worker_flags, "--", *train_args]
    cmd = [sys.executable, *worker]
    if spec.side == "accel_gpt" and spec.cuda:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_flags(spec.num_processes), *worker]
    t0 = time.perf_counter()
    with open(out_dir / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=spec.env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise ChildFailed(
            f"{spec.label} failed ({proc.returncode}): {' '.join(cmd)}", (out_dir / "log.txt").read_text()
        )
    return json.loads(report_path.read_text()), wall


def launch_flags(num_processes: int) -> list[str]:
    """`accelerate launch` with the repo's own launch configs (bf16; DDP for several GPUs)."""
    config = "single_gpu.yaml" if num_processes == 1 else "multi_gpu.yaml"
    flags = ["--config_file", str(REPO / "accelerate_configs" / config), "--num_processes", str(num_processes)]
    return [*flags, "--main_process_port", str(free_port())]


def step_seconds(report: dict[str, Any], run_dir: Path) -> list[float]:
    """Seconds per optimizer step: the plain worker times them itself; for accel_gpt they come from the
    metrics.jsonl rows it writes (tokens_per_sec is averaged over each log window)."""
    if "step_seconds" in report:
        return report["step_seconds"]
    from accel_gpt.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "tokens_per_sec" in r]
    return [report["tokens_per_step"] / r["tokens_per_sec"] for r in sorted(rows, key=lambda r: r["step"])]


def alternate(specs: list[Spec], pairs: int, tag: str) -> list[Result]:
    """Run the specs in turn `pairs` times, reversing the order every other round (A B, B A, ...)."""
    results = []
    for i in range(pairs):
        order = specs if i % 2 == 0 else specs[::-1]
        for spec in order:
            result = run_spec(spec, BENCH_DIR / tag / f"{spec.label}-{i}")
            rates = f"{fmt_rate(result.tokens_per_sec)} tok/s, {fmt_rate(result.tokens_per_cpu_sec)} tok/CPU-s"
            print(f"  round {i + 1}/{pairs} {spec.label:<28} {rates}", flush=True)
            results.append(result)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------- statistics


def of(results: list[Result], label: str) -> list[Result]:
    return [r for r in results if r.spec.label == label]


def pooled_rate(results: list[Result], cpu: bool = False) -> float:
    """Tokens/s (of wall time, or of CPU time) from the median over all measured steps of these runs."""
    tokens = results[0].tokens_per_step
    return tokens / statistics.median(s for r in results for s in (r.cpu_seconds if cpu else r.step_seconds))


def pair_ratios(results: list[Result], a: str, b: str, cpu: bool = False) -> list[float]:
    """Per-round ratio a/b of tokens/s (wall or CPU time): each round ran both sides back to back."""
    pairs = zip(of(results, a), of(results, b), strict=True)
    if cpu:
        return [x.tokens_per_cpu_sec / y.tokens_per_cpu_sec for x, y in pairs]
    return [x.tokens_per_sec / y.tokens_per_sec for x, y in pairs]


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}"


def fmt_bytes(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, ["-" * w for w in widths], *rows]
    ]
    return "\n".join(lines)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"
