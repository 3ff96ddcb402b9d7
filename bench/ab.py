"""A/B of one training side under a few variants of its runtime, alternating in fresh processes.

    python bench/ab.py malloc          # plain side: glibc as it comes / MALLOC_* env vars / accel_gpt's mallopt()
    python bench/ab.py workers         # DataLoader num_workers 0 / 2
    python bench/ab.py fp32_outputs    # GPU (bf16): Accelerate's fp32 cast of the outputs as is / stripped

Each round runs every variant once (order reversed every other round); a variant's rate is the median
over its measured steps, and each ratio is taken against the first variant within the same round.
The malloc experiment runs the plain side by default: accel_gpt applies its mallopt() settings itself on CPU.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

import torch
from benchlib import Spec, alternate, child_env, ensure_data, fmt_bytes, fmt_rate, load_average, of, pooled_rate, table


@dataclass
class Variant:
    label: str
    flags: list[str] = field(default_factory=list)  # extra train flags
    worker_flags: list[str] = field(default_factory=list)
    malloc: str = "default"  # child_env's malloc mode


EXPERIMENTS = {
    "malloc": [
        Variant("glibc default"),
        Variant("MALLOC_* env", malloc="env"),
        Variant("mallopt", worker_flags=["--mallopt"]),
    ],
    "workers": [Variant("num_workers 0", ["--num_workers", "0"]), Variant("num_workers 2", ["--num_workers", "2"])],
    "fp32_outputs": [Variant("as is"), Variant("no fp32 cast", worker_flags=["--patch", "strip_fp32_outputs"])],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=sorted(EXPERIMENTS))
    p.add_argument("--side", choices=["accel_gpt", "plain"], default=None, help="default: plain for malloc")
    p.add_argument("--config", default=None, help="preset or YAML (default: gpt2-124m on GPU, tiny-cpu on CPU)")
    p.add_argument("--data_dir", default=None)
    p.add_argument("--compile", choices=["true", "false"], default="false")
    p.add_argument("--pairs", type=int, default=3, help="rounds")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--flags", default="", help="more train flags for every variant, e.g. '--micro_batch_size 32'")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    args.side = args.side or ("plain" if args.experiment == "malloc" else "accel_gpt")
    cuda = torch.cuda.is_available()
    config = args.config or ("gpt2-124m" if cuda else "tiny-cpu")
    data_dir, source = ensure_data(args.data_dir)
    base = ["--config", config, "--data_dir", str(data_dir), "--log_every", "1", "--compile", args.compile]
    base += args.flags.split()
    variants = EXPERIMENTS[args.experiment]
    specs = []
    for v in variants:
        worker_flags = v.worker_flags + (["--bf16"] if cuda and args.side == "plain" else [])
        env = child_env(args.threads, v.malloc)
        spec = Spec(
            args.side, v.label, base + v.flags, args.warmup, args.steps, env, cuda=cuda, worker_flags=worker_flags
        )
        specs.append(spec)
    print(f"ab {args.experiment}: {args.side}, {config}, compile {args.compile}, torch {torch.__version__}, {source}")
    print(f"before: {load_average()}", flush=True)
    results = alternate(specs, args.pairs, f"ab-{args.experiment}")
    first = of(results, variants[0].label)
    rows = []
    for v in variants:
        runs = of(results, v.label)
        ratios = [r.tokens_per_sec / f.tokens_per_sec for r, f in zip(runs, first, strict=True)]
        cpu_ratios = [r.tokens_per_cpu_sec / f.tokens_per_cpu_sec for r, f in zip(runs, first, strict=True)]
        peak = max(r.report["peak_mem_bytes"] for r in runs)
        rows.append(
            [
                v.label,
                fmt_rate(pooled_rate(runs)),
                f"{statistics.median(ratios):.3f}",
                " ".join(f"{x:.2f}" for x in ratios),
                fmt_rate(pooled_rate(runs, cpu=True)),
                f"{statistics.median(cpu_ratios):.3f}",
                fmt_bytes(peak),
                str(runs[0].report["mallopt"]),
            ]
        )
    header = [
        "variant",
        "tok/s",
        "ratio (median)",
        "per round",
        "tok/CPU-s",
        "CPU ratio",
        "peak mem",
        "mallopt applied",
    ]
    print(table(header, rows))
    print("tok/CPU-s counts this process's CPU time only (not DataLoader worker processes)")
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
