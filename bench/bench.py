"""Issue 6's benchmark: accel_gpt's training step against a plain PyTorch loop, on whatever device is here.

GPU (CUDA): GPT-2 124M (gpt2-124m preset, seq_len 1024, bf16 from accelerate_configs/single_gpu.yaml, fused
AdamW), compile off and on. CPU: the tiny-cpu preset in fp32, compile off and on. For each: tokens/s (median
over the measured steps of all runs of a side, warm-up excluded), MFU against the device's dense bf16 peak
(CPU: against a measured fp32 GEMM rate, as it has no bf16 units), peak memory, warm-up time (compilation);
the plain loop (plain_loop.py, no Accelerate) of the same model, data and batch alternates with it under the
same environment; then the trainer's prepared DataLoader alone. The last line is the ratio accel_gpt / plain.

    python bench/bench.py                               # both compile modes, device found
    python bench/bench.py --compile on --pairs 2        # one mode (GPU: keeps a call under 10 minutes)
    python bench/bench.py --overhead --threads 1        # per-step cost of the loop itself (a near-empty model)
    python bench/bench.py --find_max_batch 124m         # GPU: largest micro-batch that trains (bisection)
    python bench/bench.py --scaling 8                   # GPU: accel_gpt on 8 GPUs against 1, per GPU
"""

from __future__ import annotations

import argparse
import statistics

import torch
from benchlib import (
    BENCH_DIR,
    OVERHEAD_FLAGS,
    STEP_ONLY_FLAGS,
    ChildFailed,
    Result,
    Spec,
    alternate,
    child_env,
    default_malloc,
    ensure_data,
    fmt_bytes,
    fmt_rate,
    load_average,
    of,
    pair_ratios,
    pooled_rate,
    run_child,
    run_spec,
    side_specs,
    synthetic_data,
    table,
)

# GPT-2 sizes by name: n_layer, n_head, n_embd (seq_len 1024, vocab 50,304 from the preset).
GPT2_SIZES = {"124m": (12, 12, 768), "350m": (24, 16, 1024), "774m": (36, 20, 1280), "1558m": (48, 25, 1600)}
MAX_BATCH_CANDIDATES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="preset or YAML (default: gpt2-124m on GPU, tiny-cpu on CPU)")
    p.add_argument("--data_dir", default=None, help="prepared shards (default: tiny Shakespeare, else random tokens)")
    p.add_argument("--micro_batch_size", type=int, default=None, help="default: the preset's")
    p.add_argument("--compile", choices=["both", "on", "off"], default="both")
    p.add_argument("--flags", default="", help="more train flags for both sides, e.g. '--n_layer 1 --n_embd 8'")
    p.add_argument("--pairs", type=int, default=None, help="rounds of (accel_gpt, plain); default GPU 2, CPU 3")
    p.add_argument("--warmup", type=int, default=None, help="steps per run left out; default GPU 3, CPU 2")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run; default GPU 10, CPU 20")
    p.add_argument("--threads", type=int, default=None, help="OMP/MKL threads of both sides (default: torch's)")
    p.add_argument(
        "--malloc",
        choices=["default", "env", "mallopt"],
        default=None,
        help="allocator settings of both sides (default: mallopt on CPU, as accel_gpt sets itself; GPU: default)",
    )
    p.add_argument("--overhead", action="store_true", help="near-empty model: what the loop costs per step")
    p.add_argument("--find_max_batch", choices=sorted(GPT2_SIZES), default=None, help="GPU: probe micro-batches")
    p.add_argument("--scaling", type=int, default=None, metavar="N", help="GPU: accel_gpt on N GPUs against 1")
    args = p.parse_args()
    if args.overhead:  # 1 layer, width 16, vocab 128, 2 micro-steps of 1 x 16 tokens: the model costs ~nothing
        args.flags += f" {OVERHEAD_FLAGS}"
        args.data_dir = args.data_dir or str(synthetic_data(128))
        args.compile = "off" if args.compile == "both" else args.compile
        args.warmup, args.steps = args.warmup or 20, args.steps or 300
    cuda = torch.cuda.is_available()
    args.cuda = cuda
    args.config = args.config or ("gpt2-124m" if cuda else "tiny-cpu")
    args.malloc = args.malloc or default_malloc(cuda)
    args.pairs = args.pairs or (2 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 2)
    args.steps = args.steps or (10 if cuda else 20)
    return args


def base_args(args: argparse.Namespace, data_dir: str) -> list[str]:
    """Train flags both sides get. log_every 1: a metrics row and one host sync per step, for both sides."""
    flags = ["--config", args.config, "--data_dir", data_dir, "--log_every", "1"]
    if args.micro_batch_size:
        flags += ["--micro_batch_size", str(args.micro_batch_size)]
    return flags + args.flags.split()


# ------------------------------------------------------------------------------------ accel_gpt vs plain


def compare(args: argparse.Namespace, data_dir: str, peak: float | None, peak_note: str) -> None:
    env = child_env(args.threads, args.malloc)
    modes = ["off", "on"] if args.compile == "both" else [args.compile]
    results: list[Result] = []
    for mode in modes:
        print(f"compile {mode}:", flush=True)
        flags = [*base_args(args, data_dir), "--compile", "true" if mode == "on" else "false"]
        specs = side_specs(
            flags, cuda=args.cuda, warmup=args.warmup, steps=args.steps, env=env, malloc=args.malloc, suffix=f"/{mode}"
        )
        results += alternate(specs, args.pairs, "bench")
    print_table(results, peak, peak_note, cpu_times=not args.cuda)
    loader_table(args, data_dir, env, results)
    print(f"after: {load_average()}")
    summary = []
    for mode in modes:
        for cpu in [False] if args.cuda else [False, True]:
            ratios = pair_ratios(results, f"accel_gpt/{mode}", f"plain/{mode}", cpu=cpu)
            kind = "per CPU second" if cpu else "wall-clock"
            summary.append(
                f"compile {mode} {kind} {statistics.median(ratios):.3f} ({' '.join(f'{r:.2f}' for r in ratios)})"
            )
    print(f"ratio accel_gpt / plain: {'; '.join(summary)} (median of per-pair ratios; target >= 1.0)")


def print_table(results: list[Result], peak: float | None, peak_note: str, cpu_times: bool) -> None:
    rows = []
    for label in dict.fromkeys(r.spec.label for r in results):
        runs = of(results, label)
        rate = pooled_rate(runs)
        flops = rate * runs[0].report["flops_per_token"] / runs[0].spec.num_processes
        steps = sum(len(r.step_seconds) for r in runs)
        rows.append(
            [
                label,
                fmt_rate(rate),
                f"{1000 * runs[0].tokens_per_step / rate:.0f}",
                fmt_flops(flops),
                f"{100 * flops / peak:.1f}%" if peak else "-",
                fmt_bytes(max(r.report["peak_mem_bytes"] for r in runs)),
                " / ".join(f"{r.compile_seconds:.0f}" for r in runs),
                f"{len(runs)}x{len(runs[0].step_seconds)}={steps}",
            ]
            + [fmt_rate(pooled_rate(runs, cpu=True))] * cpu_times
        )
    header = ["side/compile", "tok/s", "ms/step", "FLOP/s", "MFU", "peak mem", "warm-up extra s", "runs x steps"]
    header += ["tok/CPU-s"] * cpu_times
    first = results[0].report
    print(
        f"\nmodel {first['n_params'] / 1e6:.1f}M params, {first['flops_per_token'] / 1e6:.1f} MFLOP/token, "
        f"{first['tokens_per_step']:,} tokens/step, {first['threads']} threads; peak: {peak_note}"
    )
    print(f"peak mem = {first['mem_kind']}; warm-up extra = warm-up steps' time beyond ordinary steps (compile)")
    print(table(header, rows))


def fmt_flops(flops: float) -> str:
    return f"{flops / 1e12:,.1f} T" if flops >= 1e12 else f"{flops / 1e9:,.2f} G"


def loader_table(args: argparse.Namespace, data_dir: str, env: dict[str, str], results: list[Result]) -> None:
    """Batches/s of the trainer's prepared DataLoader alone, with 0 and 2 workers, against what a step eats."""
    need = max(pooled_rate(of(results, r.spec.label)) for r in results) / (results[0].report["tokens_per_step"])
    micro_per_step = results[0].report["tokens_per_step"] // results[0].report["micro_batch_tokens"]
    rows = []
    for workers in (0, 2):
        flags = [*base_args(args, data_dir), "--num_workers", str(workers)]
        spec = Spec("loader", f"loader-w{workers}", flags, 0, 0, env, cuda=args.cuda)
        report, _ = run_child(spec, [*flags, *STEP_ONLY_FLAGS], BENCH_DIR / "bench" / spec.label)
        rate = report["batches_per_sec"]
        rows.append([str(workers), f"{rate:,.1f}", f"{rate / (need * micro_per_step):,.0f}x"])
    print(f"\ndata loader alone (batches/s; the fastest training side eats {need * micro_per_step:,.2f} batches/s):")
    print(table(["num_workers", "batches/s", "headroom"], rows))


# --------------------------------------------------------------------------------------------- GPU only


def find_max_batch(args: argparse.Namespace, data_dir: str) -> None:
    """The largest micro-batch (x 1024 tokens) that trains 2 steps of accel_gpt on this GPU, bf16.

    One micro-step per optimizer step (total_batch_size = micro-batch x seq_len); compile as --compile
    says (default: off, the larger footprint). Bisects MAX_BATCH_CANDIDATES (a size that fits means every
    smaller one does): about 4 launches instead of one per candidate, which matters inside a device lease.
    """
    n_layer, n_head, n_embd = GPT2_SIZES[args.find_max_batch]
    compile_flag = "true" if args.compile == "on" else "false"
    env = child_env(args.threads, args.malloc)
    rows: dict[int, list[str]] = {}

    def fits(micro: int) -> bool:
        flags = [
            *base_args(args, data_dir),
            *("--n_layer", str(n_layer), "--n_head", str(n_head), "--n_embd", str(n_embd)),
            *("--micro_batch_size", str(micro), "--total_batch_size", str(micro * 1024), "--compile", compile_flag),
        ]
        spec = Spec("accel_gpt", f"maxbatch-{args.find_max_batch}-{micro}", flags, 1, 1, env, cuda=True)
        try:
            result = run_spec(spec, BENCH_DIR / "max_batch" / spec.label)
        except ChildFailed as e:
            if "out of memory" not in e.log.lower():
                raise
            rows[micro] = [str(micro), "out of memory", "-"]
            print(f"  micro-batch {micro}: out of memory", flush=True)
            return False
        rows[micro] = [str(micro), fmt_bytes(result.report["peak_mem_bytes"]), fmt_rate(result.tokens_per_sec)]
        print(f"  micro-batch {micro}: fits", flush=True)
        return True

    lo, hi = -1, len(MAX_BATCH_CANDIDATES)  # candidates[lo] fits (or none does), candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(MAX_BATCH_CANDIDATES[mid]) else (lo, mid)
    best = MAX_BATCH_CANDIDATES[lo] if lo >= 0 else None
    print(table(["micro-batch", "peak mem", "tok/s (1 step)"], [rows[m] for m in sorted(rows)]))
    print(f"largest micro-batch for GPT-2 {args.find_max_batch} (compile {compile_flag}): {best}")


def scaling(args: argparse.Namespace, data_dir: str) -> None:
    """accel_gpt on N GPUs (DDP, accelerate_configs/multi_gpu.yaml) against 1 GPU: tokens/s per GPU."""
    env = child_env(args.threads, args.malloc)
    flags = [*base_args(args, data_dir), "--compile", "false" if args.compile == "off" else "true"]
    specs = [
        Spec("accel_gpt", f"{n}gpu", flags, args.warmup, args.steps, env, cuda=True, num_processes=n)
        for n in (1, args.scaling)
    ]
    results = alternate(specs, args.pairs, "scaling")
    one, many = (pooled_rate(of(results, s.label)) for s in specs)
    print(
        table(
            ["GPUs", "tok/s", "tok/s per GPU"],
            [["1", fmt_rate(one), fmt_rate(one)], [str(args.scaling), fmt_rate(many), fmt_rate(many / args.scaling)]],
        )
    )
    print(f"scaling efficiency per GPU, {args.scaling} vs 1: {many / args.scaling / one:.3f}")


# ------------------------------------------------------------------------------------------------- main


def device_peak(args: argparse.Namespace, env: dict[str, str]) -> tuple[float | None, str]:
    """GPU: the dense bf16 data-sheet peak. CPU: a measured fp32 GEMM rate (no bf16 units, no data sheet)."""
    if args.cuda:
        from accel_gpt.metrics import device_peak_flops

        peak = device_peak_flops(torch.device("cuda"))
        name = torch.cuda.get_device_name()
        return peak, (f"{name} dense bf16 {peak / 1e12:.0f} TFLOP/s" if peak else f"{name}: unknown, no MFU")
    report, _ = run_child(Spec("gemm", "gemm", [], 0, 0, env), [], BENCH_DIR / "bench" / "gemm")
    rate = report["gemm_flops"]
    return rate, f"CPU, best measured fp32 1024^3 GEMM {rate / 1e9:.1f} GFLOP/s (MFU column = share of that)"


def main() -> None:
    args = parse_args()
    data_dir, source = ensure_data(args.data_dir)
    device = torch.cuda.get_device_name() if args.cuda else "cpu"
    print(f"bench: {args.config} on {device}, torch {torch.__version__}, data: {source}")
    print(f"malloc {args.malloc}, threads {args.threads or 'default'}; before: {load_average()}", flush=True)
    if args.find_max_batch:
        find_max_batch(args, str(data_dir))
    elif args.scaling:
        scaling(args, str(data_dir))
    else:
        peak, note = device_peak(args, child_env(args.threads, args.malloc))
        compare(args, str(data_dir), peak, note)


if __name__ == "__main__":
    main()
