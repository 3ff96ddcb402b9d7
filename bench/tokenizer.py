"""`prepare --tokenizer bpe`: how long learning the tokenizer takes on ~100 MB of text, and how fast `prepare` then
writes shards with it against the GPT-2 (tiktoken) path on the same text.

    python bench/tokenizer.py                                # ~100 MB, vocabularies 8192 and 32768, 2 rounds
    python bench/tokenizer.py --mb 10 --vocabs 2048 --rounds 1
    python bench/tokenizer.py --text path/a.txt --text path/b.jsonl    # other text first (a jsonl's string values)

The corpus is varied text found on this machine, deterministic: the --text files (a .jsonl file gives its rows'
string values, e.g. HellaSwag's contexts and endings), then the installed Python packages' own sources and documents
(.py, .md, .rst, .txt under site-packages, in sorted order), concatenated as blank-line-separated paragraphs up to
--mb megabytes. Both sides are `python run.py prepare` processes on the same file with the same --num_proc, each
with an empty datasets cache, timed from the outside; the bpe side's learning time is what its own line reports,
and its encoding time is the rest.
Throughput is in megabytes of text per second, since the two make different numbers of tokens of the same text.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchlib import REPO, child_env, header

SUFFIXES = (".py", ".md", ".rst", ".txt")


def texts_of(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            out += [v for v in row.values() if isinstance(v, str)] + [
                s for v in row.values() if isinstance(v, list) for s in v if isinstance(s, str)
            ]
        return out
    return [path.read_text(encoding="utf-8", errors="replace")]


def make_corpus(out: Path, mb: float, extra: list[Path]) -> int:
    """Paragraphs of the --text files, then of the installed packages' files, up to `mb` megabytes."""
    limit, size = int(mb * 1e6), 0
    sources = [*extra, *sorted(p for p in Path(sysconfig.get_paths()["purelib"]).rglob("*") if p.suffix in SUFFIXES)]
    with open(out, "w", encoding="utf-8") as f:
        for path in sources:
            if not path.is_file():
                continue
            for text in texts_of(path):
                text = re.sub(r"\n{2,}", "\n", text).strip()  # blank lines separate the documents
                if not text:
                    continue
                f.write(text + "\n\n")
                size += len(text.encode()) + 2
                if size >= limit:
                    return size
    return size


def prepare(corpus: Path, out: Path, num_proc: int, *flags: str) -> tuple[float, str]:
    """Seconds of a `prepare` process and its stderr; each with an empty datasets cache, so that every side pays for
    reading the text into Arrow once."""
    shutil.rmtree(out, ignore_errors=True)
    cache = out.with_name(out.name + "-datasets-cache")
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [sys.executable, "run.py", "prepare", "--dataset", str(corpus), "--out_dir", str(out), "--num_proc"]
    env = child_env() | {"HF_DATASETS_CACHE": str(cache)}
    start = time.perf_counter()
    proc = subprocess.run([*cmd, str(num_proc), *flags], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"prepare failed:\n{proc.stderr[-3000:]}")
    return took, proc.stderr


def learned(stderr: str) -> tuple[float, int]:
    """(seconds, characters) of the tokenizer's learning, from its line."""
    match = re.search(r"learned from ([\d,]+) characters of the train split in ([\d.]+)s", stderr)
    if match is None:
        sys.exit(f"no learning line in:\n{stderr[-2000:]}")
    return float(match.group(2)), int(match.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--vocabs", default="8192,32768")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num_proc", type=int, default=2)
    parser.add_argument("--text", type=Path, action="append", default=[])
    args = parser.parse_args()
    print(header("bench/tokenizer.py"))
    work = Path(tempfile.mkdtemp(prefix="tokenizer-bench-"))
    try:
        corpus = work / "corpus.txt"
        size = make_corpus(corpus, args.mb, args.text)
        print(f"corpus: {size / 1e6:.1f} MB, --num_proc {args.num_proc}")
        gpt2, bpe = [], {int(v): [] for v in args.vocabs.split(",")}
        for _ in range(args.rounds):  # alternate the sides: the machine drifts
            gpt2.append(prepare(corpus, work / "gpt2", args.num_proc)[0])
            for vocab, times in bpe.items():
                took, stderr = prepare(corpus, work / f"bpe{vocab}", args.num_proc, "--tokenizer", "bpe",
                                       "--vocab_size", str(vocab))  # fmt: skip
                seconds, chars = learned(stderr)
                times.append((took, seconds, chars))
        base = statistics.median(gpt2)
        print("| side | learning the tokenizer | prepare, whole | encoding: MB/s | encoding / GPT-2's |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| gpt2 (tiktoken) | - | {base:.1f} s | {size / 1e6 / base:.2f} | 1.00 |")
        for vocab, times in bpe.items():
            whole = statistics.median(t for t, _, _ in times)
            learn = statistics.median(s for _, s, _ in times)
            encode = whole - learn
            chars = times[0][2]
            print(
                f"| bpe {vocab:,} | {learn:.1f} s ({chars / 1e6:.0f}M characters) | {whole:.1f} s | "
                f"{size / 1e6 / encode:.2f} | {base / encode:.2f} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
