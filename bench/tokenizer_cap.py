"""What capping the text a BPE learns from (`prepare --tokenizer_chars`) costs in compression, and what it saves in
time and memory, on a gigabyte of text.

    python bench/tokenizer_cap.py --text_dirs /root/.pyenv/versions,/usr/include,/usr/share/doc \\
        --mb 1000 --caps 50,100,200,400,1000 --vocab_size 16384

The corpus is the first --mb megabytes of the text files under --text_dirs (bench/cost_by_size.py's, in an order
shuffled with a fixed seed, so that any first stretch samples the whole as a shuffled dataset's does); the held-out
text is --held_out_mb megabytes from the other end of that order, which no tokenizer learns from (the folders must
hold more than both). Per cap (millions of characters), a fresh
child learns the BPE from the corpus's first cap characters, in the paragraphs `prepare` would give it, with
`accel_gpt.bpe.train` (what `prepare` calls), then encodes the held-out text with it. The table gives the learning
seconds, the child's peak RSS, and the held-out text's bytes per token (more is better) with its loss against the
largest cap's.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchlib import RUNS, child_env, header, load_average, run_child, table
from bench.cost_by_size import text_files, write_text

COLUMNS = ["cap (M chars)", "learned (M chars)", "learning s", "peak RSS", "bytes/token held out", "vs largest cap"]


def paragraphs(path: Path, cap: int) -> Iterator[str]:
    """The file's blank-line-separated paragraphs, read 4 MB at a time, until `cap` characters."""
    seen, rest = 0, ""
    with open(path, encoding="utf-8") as f:
        while seen < cap and (chunk := f.read(1 << 22)):
            parts = (rest + chunk).split("\n\n")
            rest = parts.pop()
            for part in parts:
                part = part[: cap - seen]
                seen += len(part)
                yield part
                if seen >= cap:
                    return
    if seen < cap and rest:
        yield rest[: cap - seen]


def learn(args: argparse.Namespace) -> None:
    """The child: learn from the first `cap` characters, then encode the held-out text; one JSON line."""
    from accel_gpt import bpe

    cap = int(args.cap * 1e6)
    counted = [0]

    def counting() -> Iterator[str]:
        for text in paragraphs(args.corpus, cap):
            counted[0] += len(text)
            yield text

    start = time.perf_counter()
    made = bpe.parse(bpe.train(counting(), args.vocab_size), "the learned tokenizer")
    seconds = time.perf_counter() - start
    held_out = args.held_out.read_text(encoding="utf-8")
    tokens = len(made.encoding.encode_ordinary(held_out))
    result = {"learned": counted[0], "seconds": seconds, "vocab": made.vocab_size}
    print(json.dumps(result | {"bytes_per_token": len(held_out.encode()) / tokens}))


def compare(args: argparse.Namespace) -> None:
    work = RUNS / "tokenizer_cap"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    files = text_files(args.text_dirs)
    random.Random(0).shuffle(files)  # any first stretch is a sample of the whole, as in a shuffled dataset
    corpus, held_out = work / "corpus.txt", work / "held_out.txt"
    write_text(files, args.mb, corpus)  # file by file: this process stays small (a child's peak RSS counts its own)
    write_text(files[::-1], args.held_out_mb, held_out)  # the other end of the shuffled files: never learned from
    rows, results = [], {}
    for cap in sorted(float(c) for c in args.caps.split(",")):
        cmd = [sys.executable, __file__, "--corpus", str(corpus), "--held_out", str(held_out)]
        cmd += ["--cap", str(cap), "--vocab_size", str(args.vocab_size)]
        child = run_child(cmd, child_env(), work / f"cap-{cap:g}.log", gpu=False)
        if child.returncode != 0:
            print(f"cap {cap:g}: failed\n{child.log[-2000:]}")
            continue
        result = json.loads(re.findall(r"^\{.*\}$", child.log, re.M)[-1])
        results[cap] = result | {"peak": child.peak_mem}
        print(f"cap {cap:g}M: {results[cap]}", flush=True)
    best = results[max(results)]["bytes_per_token"]
    for cap, r in results.items():
        loss = 1 - r["bytes_per_token"] / best
        rows.append([f"{cap:g}", f"{r['learned'] / 1e6:,.0f}", f"{r['seconds']:.1f}", f"{r['peak'] / 2**30:.2f} GiB",
                     f"{r['bytes_per_token']:.4f}", f"{-loss:+.2%}"])  # fmt: skip
    print(f"\n{table(COLUMNS, rows)}\nvocab {args.vocab_size}; after: {load_average()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text_dirs", help="comma-separated folders of text files")
    p.add_argument("--mb", type=int, default=1000, help="the corpus's megabytes")
    p.add_argument("--held_out_mb", type=int, default=20)
    p.add_argument("--caps", default="50,100,200,400,1000", help="millions of characters")
    p.add_argument("--vocab_size", type=int, default=16384)
    p.add_argument("--cap", type=float, help=argparse.SUPPRESS)  # the child's: one cap, with these two files
    p.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--held_out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cap is not None:
        learn(args)
        return
    if not args.text_dirs:
        p.error("--text_dirs is required")
    print(header("tokenizer_cap"), flush=True)
    compare(args)


if __name__ == "__main__":
    main()
