"""`run.py prepare` against a single-process tiktoken baseline (throughput), and its peak memory with --streaming
as the input grows.

    python bench/prepare_throughput.py                      # ~50 MB, 5 alternating rounds, then the memory check
    python bench/prepare_throughput.py --mb 1 --rounds 1 --memory_factor 2    # quick look
    python bench/prepare_throughput.py --text FILE          # repeat another text to --mb megabytes

The input is --text (default: tests/data's tiny Shakespeare slice) repeated to about --mb megabytes. Both sides
are whole processes timed from the outside, input file to token file:
- baseline: read the file, split it into paragraphs exactly as the datasets text builder does (`split("\\n\\n")`,
  empty ones dropped), `encode_ordinary_batch(docs, num_threads=1)`, EOT before each, write uint16. A second
  baseline uses tiktoken's default 8 threads, which on 2 cores is the best a one-line tiktoken script gets.
- prepare: `python run.py prepare --dataset FILE --num_proc 2`, each run with a fresh datasets cache, so its time
  includes building the Arrow cache of the input; and the same with `--streaming`, which builds no cache and reads
  the file while the workers encode.
The two write the same tokens (checked), so the comparison is like for like. Runs alternate because a command's
speed drifts between calls on a shared machine; the medians and the per-round ratios are reported.
Peak memory for the --streaming check is the largest sum of PSS over the process tree (main + workers), sampled
every 50 ms: PSS, not RSS, because RSS counts pages shared between processes (a spawned worker starts as a fork of
the main process) once per process.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import psutil

from accel_gpt.data.shards import open_split, read_manifest
from bench.benchlib import REPO, TEXT, header

BASELINE = textwrap.dedent(
    """
    import sys, numpy as np, tiktoken
    enc = tiktoken.get_encoding("gpt2")
    text = open(sys.argv[1], encoding="utf-8").read()
    docs = [p for p in text.split("\\n\\n") if p]
    out = []
    for ids in enc.encode_ordinary_batch(docs, num_threads=int(sys.argv[3])):
        out.append(50256)
        out.extend(ids)
    np.array(out, dtype=np.uint16).tofile(sys.argv[2])
    """
)


def make_input(source: Path, path: Path, mb: float) -> int:
    """`source` repeated to about `mb` megabytes; returns the size in bytes."""
    text = source.read_text(encoding="utf-8")
    repeats = max(1, round(mb * 1e6 / len(text.encode())))
    with open(path, "w") as f:
        for _ in range(repeats):
            f.write(text)
    return path.stat().st_size


def run_measured(cmd: list[str], env: dict[str, str], pss: bool = False) -> dict[str, float]:
    """Wall time, CPU time of the whole tree (rusage of the waited children) and its peak memory.

    With `pss` the peak is the sum of PSS over the tree every 50 ms (reading smaps costs CPU, so only the memory
    check uses it); otherwise the sum of RSS every 200 ms, for information.
    """
    before = os.times()
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=log, text=True)
        root = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_full_info().pss if pss else p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.05 if pss else 0.2)
        wall = time.perf_counter() - start
        log.seek(0)
        out.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{log.read()[-3000:]}")
        last = (out.read().strip().splitlines() or [""])[-1]
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall": wall, "cpu": cpu, "peak_mb": peak / 2**20, "stdout": last}


def prepare_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "run.py", "prepare", "--dataset", str(src), "--out_dir", str(out), *extra]


def shard_tokens(out: Path) -> np.ndarray:
    """The train split `prepare` wrote (all of the input: no validation tokens were asked for)."""
    return np.concatenate(open_split(out, read_manifest(out), "train"))


def throughput(work: Path, src: Path, rounds: int, env: dict[str, str]) -> None:
    baseline_py = work / "baseline.py"
    baseline_py.write_text(BASELINE)
    results: dict[str, list[dict]] = {"baseline_t1": [], "baseline_t8": [], "prepare_np2": [], "prepare_np2_stream": []}
    tokens = 0
    for r in range(rounds):
        for name in results:
            shutil.rmtree(work / "out", ignore_errors=True)
            shutil.rmtree(work / "hf_cache", ignore_errors=True)
            if name.startswith("baseline"):
                threads = name[-1]
                cmd = [sys.executable, str(baseline_py), str(src), str(work / "baseline.bin"), threads]
            else:
                cmd = prepare_cmd(src, work / "out", "--num_proc", "2", *(["--streaming"] * name.endswith("stream")))
            res = run_measured(cmd, env)
            results[name].append(res)
            if name.startswith("prepare"):
                got = shard_tokens(work / "out")
                assert np.array_equal(got, np.fromfile(work / "baseline.bin", dtype=np.uint16)), "different tokens"
                tokens = got.size
            print(f"round {r} {name:18s} wall {res['wall']:6.2f}s cpu {res['cpu']:6.2f}s peak {res['peak_mb']:6.0f} MB")
    print(f"\n{tokens:,} tokens (identical on both sides); load average {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(x["wall"] for x in v) for k, v in results.items()}
    for name, runs in results.items():
        cpu = statistics.median(x["cpu"] for x in runs)
        print(
            f"{name:18s} median wall {med[name]:6.2f}s  {tokens / med[name] / 1e6:5.2f}M tok/s  "
            f"cpu {cpu:6.2f}s  peak {max(x['peak_mb'] for x in runs):5.0f} MB"
        )
    for side, base in [(p, b) for p in ("prepare_np2", "prepare_np2_stream") for b in ("baseline_t1", "baseline_t8")]:
        paired = [b["wall"] / p["wall"] for b, p in zip(results[base], results[side], strict=True)]
        cpu = statistics.median(x["cpu"] for x in results[base]) / statistics.median(x["cpu"] for x in results[side])
        print(
            f"speed-up {side} vs {base}: {med[base] / med[side]:.2f}x (medians); "
            f"per round {', '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f}x); "
            f"CPU time baseline / prepare {cpu:.2f}"
        )


def memory(work: Path, src: Path, factor: int, env: dict[str, str]) -> None:
    """Peak RSS of `prepare --streaming --num_proc 2` on the input and on `factor` times the input."""
    big = work / f"input_x{factor}.txt"
    with open(big, "w") as f:
        text = src.read_text()
        for _ in range(factor):
            f.write(text)
    peaks = {}
    for name, path in (("1x", src), (f"{factor}x", big), ("1x again", src)):
        shutil.rmtree(work / "out", ignore_errors=True)
        res = run_measured(prepare_cmd(path, work / "out", "--streaming", "--num_proc", "2"), env, pss=True)
        peaks[name] = res["peak_mb"]
        print(
            f"--streaming {name:9s} {path.stat().st_size / 1e6:6.1f} MB in: peak {res['peak_mb']:5.0f} MB, "
            f"wall {res['wall']:.1f}s | {res['stdout']}"
        )
    base = min(peaks["1x"], peaks["1x again"])
    print(f"peak memory {factor}x / 1x input: {peaks[f'{factor}x'] / base:.3f} (target <= 1.20)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", type=Path, default=TEXT, help="text to repeat (default: tests/data/tinyshakespeare.txt)")
    p.add_argument("--mb", type=float, default=50, help="input size in MB (default 50)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the throughput comparison")
    p.add_argument("--memory_factor", type=int, default=4, help="input growth for the memory check (0: skip)")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="prepare_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_DATASETS_CACHE=str(work / "hf_cache"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    src = work / "input.txt"
    size = make_input(args.text, src, args.mb)
    print(header("prepare_throughput"))
    print(f"input {size / 1e6:.1f} MB ({args.text} repeated, in {src})", flush=True)
    if args.rounds:
        throughput(work, src, args.rounds, env)
    if args.memory_factor:
        memory(work, src, args.memory_factor, env)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
