"""Issue 2's benchmark: does Accelerate cost anything visible? Target: accel_gpt / plain >= 0.97.

Tokens/s of `run.py train` on the tiny preset against the plain PyTorch loop (plain_loop.py) of the same
model, data and batch, in the same run: the two sides alternate (A B, B A, A B) in fresh processes under
the same threads and allocator settings; each side's rate is the median over its measured steps. The
ratio is the median of the per-pair ratios, printed last.

    python bench/train_throughput.py [--pairs 3] [--steps 20] [--threads 2] [--malloc mallopt|default|env]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from benchlib import (
    alternate,
    child_env,
    default_malloc,
    ensure_data,
    fmt_rate,
    load_average,
    of,
    pair_ratios,
    side_specs,
    table,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny-cpu", help="preset or YAML (default: tiny-cpu)")
    p.add_argument("--data_dir", default=None, help="prepared shards (default: tiny Shakespeare, written on first use)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="steps per run left out of the median")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--threads", type=int, default=None, help="OMP/MKL threads of both sides (default: torch's)")
    p.add_argument(
        "--malloc",
        choices=["default", "env", "mallopt"],
        default=None,
        help="allocator settings of both sides (default: mallopt on CPU, as accel_gpt sets itself; GPU: default)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    data_dir, source = ensure_data(args.data_dir)
    cuda = torch.cuda.is_available()
    args.malloc = args.malloc or default_malloc(cuda)
    env = child_env(args.threads, args.malloc)
    # log_every 1: a metrics row per step. On CPU the host sync it costs is free (ops run synchronously).
    train_args = ["--config", args.config, "--data_dir", str(data_dir), "--log_every", "1"]
    specs = side_specs(train_args, cuda=cuda, warmup=args.warmup, steps=args.steps, env=env, malloc=args.malloc)
    print(f"train_throughput: {args.config} on {'cuda' if cuda else 'cpu'}, torch {torch.__version__}, data: {source}")
    print(f"malloc {args.malloc}, threads {args.threads or 'default'}; before: {load_average()}", flush=True)
    results = alternate(specs, args.pairs, "train_throughput")
    ratios = pair_ratios(results, "accel_gpt", "plain")
    cpu_ratios = pair_ratios(results, "accel_gpt", "plain", cpu=True)
    sides = zip(of(results, "accel_gpt"), of(results, "plain"), ratios, cpu_ratios, strict=True)
    rows = [
        [str(i + 1), fmt_rate(a.tokens_per_sec), fmt_rate(p.tokens_per_sec), f"{r:.3f}"]
        + [fmt_rate(a.tokens_per_cpu_sec), fmt_rate(p.tokens_per_cpu_sec), f"{c:.3f}"]
        for i, (a, p, r, c) in enumerate(sides)
    ]
    header = ["pair", "accel_gpt tok/s", "plain tok/s", "ratio", "accel_gpt tok/CPU-s", "plain tok/CPU-s", "CPU ratio"]
    print(table(header, rows))
    print(f"after: {load_average()}")
    cpu_note = "" if cuda else f", {statistics.median(cpu_ratios):.3f} per CPU second"
    print(
        f"ratio accel_gpt / plain: {statistics.median(ratios):.3f} wall-clock{cpu_note} "
        f"(median of {args.pairs} pairs; target >= 0.97)"
    )


if __name__ == "__main__":
    main()
