"""Cost as the work grows: training from tiny-cpu to about 100M parameters in both blocks, and `prepare` as the
text grows to a gigabyte.

    python bench/cost_by_size.py train                                   # 4 sizes x 2 blocks, one round
    python bench/cost_by_size.py train --sizes tiny,23m --blocks nanochat --rounds 2
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/cost_by_size.py train   # the AVX2 class, emulated
    python bench/cost_by_size.py prepare --text_dirs /usr/lib/python3 --mb 125,250,500,1000

train: per size and block, up to four sides in fresh processes, alternating (bench/train_throughput.py's runs):
- `default`: the shape's flags only: precision, compilation and threads are what the trainer picks (its start-up
  line, quoted in the table). What `auto` picks depends on the run's length, so this side is set up for a whole run
  (`--default_steps`, unset: the trainer's own max_steps) and stopped by SIGTERM once it has logged its steps;
- `fp32`: `--mixed_precision no --compile false`, what the trainer did before it chose by device;
- `best`: the fastest flags known for this class: `--mixed_precision bf16 --compile true` where the CPU has bf16
  matrix units, `--compile true` elsewhere (fp32);
- `plain`: bench/plain_loop.py, the loop a nanoGPT user writes, on the same model, data and batch (fp32 on a CPU).
tokens/s are medians of the steps after the warm-up ones (compilation stays out). The share of the peak is the
default side's FLOP/s (6N + 12LHQT per token) over torch's own 2048x2048 matmul in the precision it chose, timed in
this process at the children's thread count. The default side also evaluates and saves once, at its last step: the
table quotes its final line's seconds per evaluation and per checkpoint, and its peak memory (max RSS) against the
estimate it gave at start. Data: --text (default tests/data's 250 KB, where a BPE stops at about 4,400 ids; give a
larger text for the 16,384 of the sizes' comments) as a byte-level BPE of --vocab_size ids (`run.py prepare`).

prepare: `run.py prepare --tokenizer bpe --vocab_size 16384` of the first --mb megabytes of the text files under
--text_dirs (*.py, *.txt, *.md, *.rst, *.c, *.h; read in a fixed order, repeated if short), tokenizer learning
included; wall time, MB/s, tokens/s and the process tree's peak RSS, which should stay flat as the text grows.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from accel_gpt.choices import flops_per_token
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.precision import cpu_capability
from bench.benchlib import (
    REPO,
    RUNS,
    TEXT,
    alternate,
    child_env,
    fmt_rate,
    header,
    load_average,
    median,
    run_child,
    table,
)
from bench.train_throughput import ChildFailed, Side, fresh_run_dir, measure

# name: n_layer, n_head, n_embd, seq_len, micro_batch_size, tokens per step
SIZES = {
    "tiny": (2, 4, 64, 64, 4, 512),  # the tiny-cpu preset's shape
    "small": (4, 4, 128, 256, 8, 2048),  # nanoGPT's CPU recipe's width and depth
    "23m": (6, 6, 384, 256, 8, 8192),  # 23.2M with nanochat's block and 16,384 ids (a text large enough to learn them)
    "100m": (12, 12, 768, 256, 8, 2048),  # GPT-2 124M's blocks: 98M (gpt2, tied) / 110M (nanochat) at 16,384 ids
}
STEP_ONLY = "--hellaswag_every 0 --sample_tokens 0 --log_with none --log_every 1 --warmup_steps 2 --eval_windows 16"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train", help="tokens/s, peak share, memory, eval and checkpoint cost by size")
    train.add_argument("--sizes", default=",".join(SIZES), help=f"some of {', '.join(SIZES)}")
    train.add_argument("--blocks", default="gpt2,nanochat")
    train.add_argument("--sides", default="default,fp32,best,plain")
    train.add_argument("--rounds", type=int, default=1, help="alternating rounds of the sides")
    train.add_argument("--warmup", type=int, default=2, help="steps per run left out")
    train.add_argument("--steps", type=int, default=4, help="measured steps per run")
    train.add_argument("--vocab_size", type=int, default=16384, help="the BPE's ids (a small text learns fewer)")
    train.add_argument("--text", type=Path, default=TEXT, help="the text to learn the BPE from and train on")
    train.add_argument("--threads", type=int, default=None, help="OMP threads of every child (default: theirs)")
    train.add_argument("--flags", default="", help="more train flags for every side, e.g. '--optimizer muon'")
    train.add_argument(
        "--default_steps", type=int, default=None, help="the default side's max_steps (unset: the trainer's own)"
    )
    prep = sub.add_parser("prepare", help="prepare's throughput and peak memory as the text grows")
    prep.add_argument("--text_dirs", required=True, help="comma-separated folders of text files")
    prep.add_argument("--mb", default="125,250,500,1000", help="text sizes, in MB")
    prep.add_argument("--vocab_size", type=int, default=16384)
    return p.parse_args()


# ------------------------------------------------------------------------------------------------ train


def prepared(text: Path, vocab_size: int) -> Path:
    """`text` as a byte-level BPE of `vocab_size` ids, prepared once under runs/bench/data/."""
    out = RUNS / "data" / f"{text.stem}-{text.stat().st_size}-bpe-{vocab_size}"
    if not (out / "manifest.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "run.py", "prepare", "--dataset", str(text), "--tokenizer", "bpe"]
        cmd += ["--vocab_size", str(vocab_size), "--val_tokens", "20000", "--out_dir", str(out)]
        child = run_child(cmd, child_env(), out.with_suffix(".log"), gpu=False)
        if child.returncode != 0:
            raise SystemExit(f"prepare failed:\n{child.log[-2000:]}")
    return out


def matmul_peak(dtype: torch.dtype, threads: int) -> float:
    """FLOP/s of torch's own 2048x2048 matmul in `dtype` on `threads` threads (median of 5, after 2)."""
    torch.set_num_threads(threads)
    a, b = (torch.randn(2048, 2048).to(dtype) for _ in range(2))
    times = []
    for i in range(7):
        start = time.perf_counter()
        torch.mm(a, b)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 2 * 2048**3 / median(times)


@dataclass
class Said:
    """What the default side's log says of its choices and costs."""

    precision: str
    compiled: bool
    threads: str
    estimate: str
    peak: str
    evaluation: str
    checkpoint: str

    @classmethod
    def read(cls, log: str) -> Said:
        def find(pattern: str, default: str = "-") -> str:
            match = re.search(pattern, log)
            return match.group(1) if match else default

        return cls(
            precision=find(r"mixed precision (\S+) \("),
            compiled=" | compiled (" in log or ", compiled (" in log,
            threads=find(r"(\d+) threads? \("),
            estimate=find(r"memory about (\S+ \S+) per process"),
            peak=find(r"peak memory (\S+ \S+) \(estimated"),
            evaluation=find(r"1 evaluation, (\S+) s each"),
            checkpoint=find(r"1 checkpoint, (\S+) s each"),
        )


def shape_flags(size: str, block: str, data_dir: Path, steps: int | None) -> list[str]:
    n_layer, n_head, n_embd, seq_len, micro, tokens = SIZES[size]
    flags = ["--data_dir", str(data_dir), "--arch", block, *STEP_ONLY.split()]
    flags += ["--max_steps", str(steps)] if steps else []
    flags += ["--n_layer", str(n_layer), "--n_head", str(n_head), "--n_embd", str(n_embd), "--seq_len", str(seq_len)]
    return [*flags, "--micro_batch_size", str(micro), "--total_batch_size", str(tokens)]


def train_sides(size: str, block: str, args: argparse.Namespace, data_dir: Path, bf16_units: bool) -> list[Side]:
    steps = args.warmup + args.steps
    more = args.flags.split()
    base = [*shape_flags(size, block, data_dir, steps), *more]
    off = ["--eval_every", "0", "--save_every", "0"]
    best = ["--mixed_precision", "bf16", "--compile", "true"] if bf16_units else ["--compile", "true"]
    whole = [*shape_flags(size, block, data_dir, args.default_steps), "--eval_every", str(steps), *more]
    stop_itself = args.default_steps is not None and args.default_steps <= steps
    every = {
        # SIGTERM: it saves once and exits 0; a run that ends by itself at that step is not signalled (too late)
        "default": Side("default", "accel_gpt", whole, stop_after=None if stop_itself else steps),
        "fp32": Side("fp32", "accel_gpt", [*base, *off, "--mixed_precision", "no", "--compile", "false"]),
        "best": Side("best", "accel_gpt", [*base, *off, *best]),
        "plain": Side("plain", "plain", [*base, *off, "--compile", "false"]),
    }
    return [every[name] for name in args.sides.split(",")]


def train(args: argparse.Namespace) -> None:
    data_dir = prepared(args.text, args.vocab_size)
    units = cpu_capability().bf16_units
    threads = args.threads or torch.get_num_threads()
    peaks = {"no": matmul_peak(torch.float32, threads)}
    if units:  # emulated, a bf16 matmul of this size takes half a minute: no run picks bf16 there
        peaks["bf16"] = matmul_peak(torch.bfloat16, threads)
    said = ", ".join(f"{'fp32' if k == 'no' else k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
    print(f"matmul 2048x2048 on {threads} threads: {said}; data {data_dir}", flush=True)
    args.cuda = False
    rows = []
    for size in args.sizes.split(","):
        for block in args.blocks.split(","):
            sides = train_sides(size, block, args, data_dir, units)
            for i, label in alternate([s.label for s in sides], args.rounds):
                side = next(s for s in sides if s.label == label)
                run_dir = fresh_run_dir(RUNS / "cost_by_size" / f"{size}-{block}-{label}-{i}")
                try:
                    side.runs.append(measure(side, args, run_dir, args.warmup))
                except ChildFailed as e:
                    print(f"  {size} {block} {label}: failed\n{e.log[-1500:]}", flush=True)
                    continue
                if label == "default":
                    side.said = Said.read(run_dir.with_suffix(".log").read_text(errors="replace"))
                print(f"  {size} {block} {label} round {i + 1}: {fmt_rate(side.runs[-1].tokens_per_sec)} tok/s")
            rows.append(train_row(size, block, sides, peaks))
            print(table(TRAIN_COLUMNS, rows[-1:]), flush=True)
    print(f"\n{table(TRAIN_COLUMNS, rows)}\nafter: {load_average()}")


TRAIN_COLUMNS = [
    "size", "block", "params", "default: chosen", "default tok/s", "fp32 tok/s", "best tok/s", "plain tok/s",
    "default/fp32", "default/plain", "share of peak", "peak mem (estimate)", "eval s", "checkpoint s",
]  # fmt: skip


def train_row(size: str, block: str, sides: list[Side], peaks: dict[str, float]) -> list[str]:
    by = {s.label: s for s in sides if s.runs}
    default = by.get("default")
    cfg = next(iter(by.values())).config
    fpt = flops_per_token(cfg)
    with torch.device("meta"):
        params = f"{GPT(GPTConfig(**cfg.model_settings())).num_params(non_embedding=False) / 1e6:.1f}M"

    def rate(label: str) -> str:
        return fmt_rate(by[label].tokens_per_sec()) if label in by else "-"

    def ratio(label: str) -> str:
        return f"{default.tokens_per_sec() / by[label].tokens_per_sec():.2f}" if label in by else "-"

    if default is None:
        return [size, block, params, "-", "-", rate("fp32"), rate("best"), rate("plain"), *["-"] * 6]
    said = default.said
    chosen = f"{said.precision}, {'compiled' if said.compiled else 'eager'}, {said.threads} thr"
    share = f"{100 * default.tokens_per_sec() * fpt / peaks.get(said.precision, peaks['no']):.0f}%"
    memory = f"{said.peak} ({said.estimate})"
    return [size, block, params, chosen, rate("default"), rate("fp32"), rate("best"), rate("plain"), ratio("fp32"),
            ratio("plain"), share, memory, said.evaluation, said.checkpoint]  # fmt: skip


# ------------------------------------------------------------------------------------------------ prepare


def text_files(dirs: str) -> list[Path]:
    files = []
    for folder in dirs.split(","):
        files += sorted(p for p in Path(folder).rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    if not files:
        raise SystemExit(f"no text files under {dirs}")
    return files


def write_text(files: list[Path], megabytes: int, out: Path) -> int:
    """The first `megabytes` MB of `files`' UTF-8 text (repeated if short) in one file; returns its bytes."""
    limit, written = megabytes * 10**6, 0
    with open(out, "w", encoding="utf-8") as sink:
        while written < limit:
            for path in files:
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                sink.write(text + "\n\n")
                written += len(text.encode()) + 2
                if written >= limit:
                    break
    return written


def prepare(args: argparse.Namespace) -> None:
    files = text_files(args.text_dirs)
    work = RUNS / "cost_by_size" / "prepare"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows = []
    for mb in (int(m) for m in args.mb.split(",")):
        text = work / f"text-{mb}mb.txt"
        size = write_text(files, mb, text)
        out = work / f"prepared-{mb}mb"
        cmd = [sys.executable, "run.py", "prepare", "--dataset", str(text), "--tokenizer", "bpe"]
        cmd += ["--vocab_size", str(args.vocab_size), "--out_dir", str(out)]
        child = run_child(cmd, child_env(), out.with_suffix(".log"), gpu=False)
        if child.returncode != 0:
            print(f"{mb} MB: failed\n{child.log[-2000:]}")
            continue
        tokens = re.search(r"prepared: .*?([\d,]+) tokens", child.log)
        learned = re.search(r"learned from .*? in ([\d.]+)s", child.log)
        n = int(tokens.group(1).replace(",", "")) if tokens else 0
        rows.append([f"{size / 1e6:,.0f}", f"{child.seconds:.0f}", f"{size / 1e6 / child.seconds:.2f}",
                     fmt_rate(n / child.seconds), learned.group(1) if learned else "-",
                     f"{child.peak_mem / 2**30:.2f} GiB"])  # fmt: skip
        print(table(PREPARE_COLUMNS, rows[-1:]), flush=True)
        text.unlink()
        shutil.rmtree(out, ignore_errors=True)
    print(f"\n{table(PREPARE_COLUMNS, rows)}\nafter: {load_average()}")


PREPARE_COLUMNS = ["text MB", "wall s", "MB/s", "tokens/s", "learning s", "peak RSS"]


def main() -> None:
    args = parse_args()
    print(header("cost_by_size"), flush=True)
    os.chdir(REPO)
    train(args) if args.what == "train" else prepare(args)


if __name__ == "__main__":
    main()
