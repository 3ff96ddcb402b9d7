"""Training start-up against dataset size: checking the shards and entering the window stream, before and after
the verified cache and the computed permutation.

    python bench/startup.py                          # 0.1, 1 and 4 GB of shards in a temporary folder under /tmp
    python bench/startup.py --gb 0.1 1 --repeats 1   # quick look

For each size, shards of random uint16 tokens are written in the prepare format (`ShardWriter`: the sha256 is
computed while writing, as `prepare` does) in shards of --shard_mb, then each way of starting runs in a fresh
child process, timed from after its imports to the first window of a resumed stream (position: half-way through
epoch 3). The files were just written, so they are in the page cache: hashing reads RAM, its best case (a cold
disk or a network file system is slower, which only widens the gap).

- `before`: what every start did until now: sha256 of every training shard, the sampler's epoch as a Python list
  (`torch.randperm(n).tolist()`), its window at the resume position.
- `first`: `--verify_data auto` with no cache yet: sizes, every shard hashed and recorded in `.verified.json`
  (once per dataset and per change), then the computed permutation's window at the resume position.
- `after`: `--verify_data auto` with the cache: sizes and one stat per shard, then the window, computed.
- `full`: `--verify_data full`: every shard hashed again, the cache refreshed.

Reported per way (medians of --repeats): seconds checking the shards (manifest, sizes, hashes, memory maps), then
seconds entering the stream (the resumed position's first window, read), and the memory the stream holds: the
resident set (/proc/self/statm) after entering it minus before, i.e. the epoch list where there is one.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from accel_gpt.data.shards import ShardWriter, tokenizer_fields, write_manifest
from accel_gpt.tokenizer import Tokenizer
from bench.benchlib import REPO, header, load_average, table

WAYS = ("before", "first", "after", "full")

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np, torch
    from accel_gpt.data import shards
    from accel_gpt.data.loader import TokenWindows, WindowSampler, train_windows

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    data_dir, way, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    WindowSampler(1000, 0).index(5), torch.randperm(10).tolist()  # first-use costs (lazy imports), not the data's
    t0 = time.perf_counter()
    if way == "before":
        manifest = shards.read_manifest(data_dir)
        shards.verify_split(data_dir, manifest, "train")
        windows = TokenWindows(data_dir, "train", seq_len, manifest)
    else:
        if way == "first":
            shards.verified_path(data_dir).unlink(missing_ok=True)
        windows = train_windows(data_dir, seq_len, verify="full" if way == "full" else "auto")
    t1, rss1 = time.perf_counter(), rss()
    n = len(windows)
    position = 3 * n + n // 2  # half-way through epoch 3
    if way == "before":
        gen = torch.Generator().manual_seed(1337 * 100_003 + 3)
        order = torch.randperm(n, generator=gen).tolist()
        first = order[n // 2]
    else:
        first = next(iter(WindowSampler(windows.sizes, 1337, start=position)))
    x, y = windows[first]
    t2, rss2 = time.perf_counter(), rss()
    print(json.dumps({"verify": t1 - t0, "stream": t2 - t1, "held": rss2 - rss1, "windows": n}))
    """
)


def write_shards(data_dir: Path, gb: float, shard_mb: int) -> int:
    """Random GPT-2 token ids (uint16) in shards of `shard_mb`, with their manifest; returns the token count."""
    data_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tokens_left, per_shard = int(gb * 1e9) // 2, shard_mb * 1_000_000 // 2
    entries, index = [], 0
    while tokens_left > 0:
        writer = ShardWriter(data_dir, "train", index, np.uint16)
        size = min(per_shard, tokens_left)
        for start in range(0, size, 1 << 25):  # 64 MB at a time
            writer.write(rng.integers(0, 50_257, min(1 << 25, size - start), dtype=np.uint16))
        entries.append(writer.close())
        tokens_left -= size
        index += 1
    write_manifest(data_dir, {**tokenizer_fields(Tokenizer("gpt2")), "splits": {"train": entries}})
    return sum(e["tokens"] for e in entries)


def measure(data_dir: Path, way: str, seq_len: int) -> dict:
    cmd = [sys.executable, "-c", CHILD, str(data_dir), way, str(seq_len)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, nargs="+", default=[0.1, 1.0, 4.0], help="dataset sizes in GB")
    parser.add_argument("--shard_mb", type=int, default=200, help="shard size in MB (prepare's default: 200)")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way; the median is reported")
    parser.add_argument("--tmp", default="/tmp", help="where the shards are written (and deleted after)")
    args = parser.parse_args()
    print(header("startup"))
    rows = []
    for gb in args.gb:
        with tempfile.TemporaryDirectory(dir=args.tmp, prefix="accel_gpt-startup-") as tmp:
            data_dir = Path(tmp) / "data"
            started = time.perf_counter()
            tokens = write_shards(data_dir, gb, args.shard_mb)
            print(f"{gb} GB: {tokens:,} tokens written in {time.perf_counter() - started:.1f} s", flush=True)
            results = {way: [measure(data_dir, way, args.seq_len) for _ in range(args.repeats)] for way in WAYS}
        windows = results["after"][0]["windows"]
        row = [f"{gb:g} GB", f"{windows:,}"]
        for way in WAYS:
            verify = statistics.median(r["verify"] for r in results[way])
            stream = statistics.median(r["stream"] for r in results[way])
            held = statistics.median(r["held"] for r in results[way])
            row.append(f"{verify:.3f} + {stream:.3f} s, {held / 2**20:.1f} MB")
        rows.append(row)
        print(row, flush=True)
    print(f"load average after: {load_average()}")
    print(table(["data", "windows", *[f"{way}: checks + stream, stream memory" for way in WAYS]], rows))


if __name__ == "__main__":
    main()
