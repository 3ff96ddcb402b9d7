"""accel_gpt's training step against the plain PyTorch loop (bench/plain_loop.py) of the same model, data and batch.

Both sides are real commands in fresh child processes, alternating (A B, B A, ...) under the same environment
(threads; on CPU both apply the trainer's glibc settings): `run.py train`, under `accelerate launch
--config_file accelerate_configs/single_gpu.yaml` (bf16) on GPU, and `bench/plain_loop.py` (bf16 autocast on
GPU). Eval, saving and trackers are off and both sides sync with the host once per step (`--log_every 1`);
step times come from each side's metrics.jsonl. Per side: tokens/s (median over the measured steps of all its
runs, warm-up steps left out), ms/step, FLOP/s, MFU (GPU: against the dense bf16 peak in accel_gpt/tracking.py;
none on CPU), peak memory, warm-up time beyond ordinary steps (compilation). The last line is the ratio
accel_gpt / plain, the median of the per-pair ratios. Defaults: GPU: GPT-2 124M (gpt2-124m preset: seq_len
1024, micro-batch 64, 524,288 tokens per step), bf16. CPU: the tiny-cpu preset, fp32. Data: tests/data's tiny
Shakespeare as GPT-2 tokens (throughput does not depend on which tokens).

    python bench/train_throughput.py                          # compile off and on
    python bench/train_throughput.py --compile on --pairs 2   # one mode
    python bench/train_throughput.py --compile on --flags "--compile_mode max-autotune-no-cudagraphs"
    python bench/train_throughput.py --overhead --threads 1   # a near-empty model: the loops' own cost per step
    python bench/train_throughput.py --find_max_batch 350m    # GPU: the largest micro-batch that trains
    python bench/train_throughput.py --scaling 8              # GPU: accel_gpt on 8 GPUs against 1
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import functools
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from accel_gpt.choices import flops_per_token
from accel_gpt.cli import parse
from accel_gpt.config import TrainConfig
from bench.benchlib import (
    REPO,
    RUNS,
    TEXT,
    alternate,
    bench_data,
    child_env,
    fmt_bytes,
    fmt_flops,
    fmt_rate,
    gpu_name,
    header,
    load_average,
    median,
    peak_bf16_flops,
    read_steps,
    run_child,
    table,
)

# Everything but training steps off; a metrics row and one host sync per step on both sides.
STEP_ONLY = "--eval_every 0 --save_every 0 --hellaswag_every 0 --sample_tokens 0 --log_with none --log_every 1"
# 1 layer, width 16, 2 micro-steps of 1 x 16 characters (vocabulary 128): the model costs next to nothing,
# so a step's time is what the loop around it costs.
OVERHEAD = "--n_layer 1 --n_head 1 --n_embd 16 --seq_len 16 --vocab_size 128 --micro_batch_size 1 --total_batch_size 32"
GPT2_SIZES = {"124m": (12, 12, 768), "350m": (24, 16, 1024), "774m": (36, 20, 1280)}  # n_layer, n_head, n_embd
MAX_BATCH_CANDIDATES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="preset or YAML, both sides (default: gpt2-124m GPU, tiny-cpu CPU)")
    p.add_argument("--text", type=Path, default=TEXT, help="text to train on, tokenized once (default: tests/data's)")
    p.add_argument("--data_dir", default=None, help="prepared shards instead of --text")
    p.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default=None,
        help="default: both (off for the max batch and the overhead)",
    )
    p.add_argument("--pairs", type=int, default=None, help="rounds of (accel_gpt, plain); default GPU 2, CPU 3")
    p.add_argument("--warmup", type=int, default=None, help="steps per run left out; default GPU 3, CPU 2, overhead 20")
    p.add_argument(
        "--steps", type=int, default=None, help="measured steps per run; default GPU 10, CPU 20, overhead 200"
    )
    p.add_argument("--threads", type=int, default=None, help="OMP/MKL threads of every child (default: torch's)")
    p.add_argument(
        "--flags",
        default="",
        help="more train flags for accel_gpt, e.g. '--activation_checkpointing true'; the plain loop follows "
        "changes of model shape or batch but keeps its own loop (default compile mode, no checkpointing)",
    )
    p.add_argument("--overhead", action="store_true", help="near-empty model on character data: per-step cost")
    p.add_argument("--find_max_batch", choices=sorted(GPT2_SIZES), default=None, help="GPU: bisect micro-batch sizes")
    p.add_argument("--scaling", type=int, default=None, metavar="N", help="GPU: accel_gpt on N GPUs against 1")
    args = p.parse_args()
    args.cuda = torch.cuda.is_available()
    args.config = args.config or ("gpt2-124m" if args.cuda else "tiny-cpu")
    args.compile = args.compile or ("off" if args.find_max_batch or args.overhead else "both")
    args.pairs = args.pairs or (2 if args.cuda else 3)
    if args.warmup is None:
        args.warmup = 20 if args.overhead else 3 if args.cuda else 2
    args.steps = args.steps or (200 if args.overhead else 10 if args.cuda else 20)
    if args.overhead:
        args.flags = f"{OVERHEAD} {args.flags}"
    return args


# ------------------------------------------------------------------------------------------------ runs


@dataclass
class Side:
    """One kind of measured run: which program, which train flags, on how many processes."""

    label: str
    program: str  # "accel_gpt" (run.py train) or "plain" (bench/plain_loop.py)
    flags: list[str]
    processes: int = 1
    runs: list[Measured] = field(default_factory=list)
    stop_after: int | None = None  # SIGTERM the run after this many logged steps (it was set up for more)

    @functools.cached_property
    def config(self) -> TrainConfig:
        return parse(["train", *self.flags])[1]

    def tokens_per_sec(self) -> float:
        """Tokens per step over the median step time of all measured steps of all runs."""
        return self.config.total_batch_size / median([s for r in self.runs for s in r.steps])


@dataclass
class Measured:
    """What one run measured."""

    tokens_per_step: int
    steps: list[float]  # seconds per measured optimizer step
    warmup_extra: float  # warm-up steps' seconds beyond as many ordinary steps: compilation, first touches
    peak_mem: int | None
    losses: list[float]  # every step's, warm-up included

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens_per_step / median(self.steps)


def command(side: Side, out_dir: Path, cuda: bool) -> list[str]:
    """`run.py train` (through `accelerate launch` on GPU or on several processes) or the plain loop."""
    flags = [*side.flags, "--out_dir", str(out_dir)]
    if side.program == "plain":
        return [sys.executable, str(REPO / "bench" / "plain_loop.py"), *flags]
    if not cuda and side.processes == 1:
        return [sys.executable, str(REPO / "run.py"), "train", *flags]
    launch_config = "single_gpu.yaml" if side.processes == 1 else "multi_gpu.yaml" if cuda else "cpu_2proc.yaml"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(side.processes)]
    launch += ["--config_file", str(REPO / "accelerate_configs" / launch_config)]
    return [*launch, str(REPO / "run.py"), "train", *flags]


def measure(side: Side, args: argparse.Namespace, run_dir: Path, warmup: int) -> Measured:
    """One run of `side` in a fresh process; raises with the end of its log if it fails."""
    log = run_dir.with_suffix(".log")
    stop = (run_dir / "metrics.jsonl", side.stop_after) if side.stop_after else None
    child = run_child(command(side, run_dir, args.cuda), child_env(args.threads), log, args.cuda, stop)
    if child.returncode != 0:
        raise ChildFailed(f"{side.label} exited {child.returncode}; log: {log}", child.log)
    tokens = side.config.total_batch_size
    seconds, losses = read_steps(run_dir / "metrics.jsonl", tokens)
    (run_dir / "model.safetensors").unlink(missing_ok=True)  # the final weights: 0.5 GB for 124M
    steps = seconds[warmup:]
    warmup_extra = max(0.0, sum(seconds[:warmup]) - warmup * median(steps))
    return Measured(tokens, steps, warmup_extra, child.peak_mem, losses)


class ChildFailed(RuntimeError):
    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n{log[-3000:]}")
        self.log = log


def alternate_sides(sides: list[Side], args: argparse.Namespace, tag: str) -> None:
    """Runs of every side, alternating, each printed as it finishes (a timeout keeps the lines so far)."""
    for i, label in alternate([s.label for s in sides], args.pairs):
        side = next(s for s in sides if s.label == label)
        run = measure(side, args, fresh_run_dir(RUNS / tag / f"{label.replace('/', '-')}-{i}"), args.warmup)
        side.runs.append(run)
        print(
            f"  round {i + 1}/{args.pairs} {label:<16} {fmt_rate(run.tokens_per_sec)} tok/s, "
            f"{1000 * median(run.steps):.1f} ms/step, peak mem {fmt_bytes(run.peak_mem)}, "
            f"warm-up extra {run.warmup_extra:.1f} s",
            flush=True,
        )


def fresh_run_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.with_suffix(".log").unlink(missing_ok=True)
    return path


def train_flags(
    args: argparse.Namespace, data_dir: str, compile_on: bool, steps: int, extra: list[str] | None = None
) -> list[str]:
    """The train flags of a run; `--flags` come last, so they win."""
    flags = ["--config", args.config, "--data_dir", data_dir, *STEP_ONLY.split(), "--max_steps", str(steps)]
    return [*flags, "--compile", str(compile_on).lower(), *(extra or []), *args.flags.split()]


# ------------------------------------------------------------------------------------------- measurements


def compare(args: argparse.Namespace, data_dir: str, peak: float | None) -> None:
    modes = ["off", "on"] if args.compile == "both" else [args.compile]
    sides: list[Side] = []
    for mode in modes:
        print(f"compile {mode}:", flush=True)
        flags = train_flags(args, data_dir, mode == "on", args.warmup + args.steps)
        pair = [Side(f"accel_gpt/{mode}", "accel_gpt", flags), Side(f"plain/{mode}", "plain", flags)]
        alternate_sides(pair, args, "train_throughput")
        sides += pair
    print_summary(sides, peak, args.cuda)
    print(f"after: {load_average()}")
    ratios = []
    for accel, plain in zip(sides[::2], sides[1::2], strict=True):
        mode = accel.label.split("/")[1]
        diff = max(abs(a - p) for a, p in zip(accel.runs[0].losses, plain.runs[0].losses, strict=True))
        print(f"compile {mode}: the two sides' losses differ by at most {diff:.2e} (same model, data and steps)")
        per_pair = [a.tokens_per_sec / p.tokens_per_sec for a, p in zip(accel.runs, plain.runs, strict=True)]
        ratios.append(f"compile {mode} {median(per_pair):.3f} ({' '.join(f'{r:.2f}' for r in per_pair)})")
    print(f"ratio accel_gpt / plain (tokens/s, median of per-pair ratios): {'; '.join(ratios)}")


def print_summary(sides: list[Side], peak: float | None, cuda: bool) -> None:
    cfg = sides[0].config
    fpt = flops_per_token(cfg)
    rows = []
    for side in sides:
        rate = side.tokens_per_sec()
        peak_mem = max((r.peak_mem or 0) for r in side.runs) or None
        warmup = " / ".join(f"{r.warmup_extra:.1f}" for r in side.runs)
        row = [side.label, fmt_rate(rate), f"{1000 * cfg.total_batch_size / rate:.1f}", fmt_flops(rate * fpt)]
        rows.append(
            [*row, mfu(rate * fpt, peak), fmt_bytes(peak_mem), warmup, f"{len(side.runs)} x {len(side.runs[0].steps)}"]
        )
    print(
        f"\nmodel {cfg.n_layer} layers x {cfg.n_embd} wide, seq_len {cfg.seq_len}, vocab {cfg.vocab_size:,}: "
        f"{fpt / 1e6:,.2f} MFLOP/token (6N + 12LHQT); {cfg.total_batch_size:,} tokens/step; peak mem = "
        f"{'device memory in use (nvidia-smi)' if cuda else 'max RSS'}; warm-up extra = per run, the warm-up "
        "steps' time beyond ordinary steps (compilation: the first compiling run is cold)"
    )
    columns = ["side/compile", "tok/s", "ms/step", "FLOP/s", "MFU", "peak mem", "warm-up extra s", "runs x steps"]
    print(table(columns, rows))


def mfu(flops: float, peak: float | None) -> str:
    if not peak:
        return "-"
    share = flops / peak
    return f"{100 * share:.1f}%" if share <= 1 else "- (above peak: check the peak table)"


def find_max_batch(args: argparse.Namespace, data_dir: str) -> None:
    """The largest micro-batch that trains 2 steps of accel_gpt (one micro-step each) without running out of
    memory. Bisection over MAX_BATCH_CANDIDATES (a size that fits means every smaller one does): about 4
    launches instead of one per candidate."""
    n_layer, n_head, n_embd = GPT2_SIZES[args.find_max_batch]
    shape = ["--n_layer", str(n_layer), "--n_head", str(n_head), "--n_embd", str(n_embd)]
    seq_len = parse(["train", *train_flags(args, data_dir, args.compile == "on", 2, shape)])[1].seq_len
    rows: dict[int, list[str]] = {}

    def fits(micro: int) -> bool:
        batch = ["--micro_batch_size", str(micro), "--total_batch_size", str(micro * seq_len)]
        flags = train_flags(args, data_dir, args.compile == "on", 2, [*shape, *batch])
        side = Side(f"{args.find_max_batch}-{micro}", "accel_gpt", flags)
        try:
            run = measure(side, args, fresh_run_dir(RUNS / "max_batch" / side.label), warmup=1)
        except ChildFailed as e:
            if "out of memory" not in e.log.lower():
                raise
            rows[micro] = [str(micro), "out of memory", "-"]
        else:
            rows[micro] = [str(micro), fmt_bytes(run.peak_mem), fmt_rate(run.tokens_per_sec)]
        print(f"  micro-batch {micro}: {rows[micro][1]}", flush=True)
        return rows[micro][1] != "out of memory"

    lo, hi = -1, len(MAX_BATCH_CANDIDATES)  # candidates[lo] fits (or none does), candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(MAX_BATCH_CANDIDATES[mid]) else (lo, mid)
    print(table(["micro-batch", "peak mem", "tok/s (1 step)"], [rows[m] for m in sorted(rows)]))
    best = MAX_BATCH_CANDIDATES[lo] if lo >= 0 else None
    print(f"largest micro-batch for GPT-2 {args.find_max_batch}, compile {args.compile} {args.flags}: {best}")


def scaling(args: argparse.Namespace, data_dir: str) -> None:
    """accel_gpt on N processes (DDP: multi_gpu.yaml; on CPU cpu_2proc.yaml) against 1: tokens/s per process."""
    flags = train_flags(args, data_dir, args.compile != "off", args.warmup + args.steps)
    sides = [Side(f"{n}x", "accel_gpt", flags, processes=n) for n in (1, args.scaling)]
    alternate_sides(sides, args, "scaling")
    one, many = (s.tokens_per_sec() for s in sides)
    n = args.scaling
    rows = [["1", fmt_rate(one), fmt_rate(one)], [str(n), fmt_rate(many), fmt_rate(many / n)]]
    print(table(["processes", "tok/s", "tok/s per process"], rows))
    print(f"scaling efficiency per process, {n} vs 1: {many / n / one:.3f}")


def main() -> None:
    args = parse_args()
    data_dir = args.data_dir or str(bench_data(args.text, "char" if args.overhead else "gpt2"))
    name = gpu_name() if args.cuda else None
    peak = peak_bf16_flops(name) if name else None
    print(header("train_throughput"))
    device = f"{name}, dense bf16 peak {peak / 1e12:.0f} TFLOP/s" if peak else name or "CPU (no MFU: no bf16 peak)"
    print(f"{args.config} on {device}; data {data_dir}; threads {args.threads or 'default'}", flush=True)
    if args.find_max_batch:
        find_max_batch(args, data_dir)
    elif args.scaling:
        scaling(args, data_dir)
    else:
        compare(args, data_dir, peak)


if __name__ == "__main__":
    main()
