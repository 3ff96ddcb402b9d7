"""One measured child process of the benchmarks (started by benchlib.run_spec; not meant to be run by hand).

worker.py accel_gpt --report R.json [--mallopt] [--patch strip_fp32_outputs] -- TRAIN FLAGS
    runs `run.py train TRAIN FLAGS` in this process (under `accelerate launch` on GPU), then reports
    its peak memory; step times come from the run's metrics.jsonl
worker.py plain --report R.json [--mallopt] [--bf16] -- TRAIN FLAGS   the plain loop (plain_loop.py)
worker.py loader --report R.json -- TRAIN FLAGS              batches/s of the trainer's prepared DataLoader
worker.py gemm --report R.json                               fp32 GEMM FLOP/s (CPU: a measured peak)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib import REPO


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["accel_gpt", "plain", "loader", "gemm"])
    parser.add_argument("--report", required=True, type=Path)
    parser.add_argument("--mallopt", action="store_true", help="first apply accel_gpt's own glibc settings")
    parser.add_argument("--patch", choices=["strip_fp32_outputs"], default=None)
    parser.add_argument("--bf16", action="store_true", help="plain mode: bf16 autocast (as the GPU launch config)")
    parser.add_argument("--batches", type=int, default=200, help="loader mode: batches to time")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # everything after "--" is run.py train's
    args = parser.parse_args(argv[:cut])
    args.train_args = argv[cut + 1 :]
    report: dict[str, Any] = {"mallopt": keep_freed_memory() if args.mallopt else False}
    if args.mode == "gemm":
        report |= gemm_rate()
    else:
        cfg = train_config(args.train_args)
        if args.mode == "accel_gpt":
            marks = record_cpu_time()
            run_accel_gpt(args.train_args, args.patch)
            report["step_cpu_seconds"] = per_step(marks)
        elif args.mode == "plain":
            from plain_loop import train_plain

            report["step_seconds"], report["step_cpu_seconds"] = train_plain(cfg, cfg.max_steps, bf16=args.bf16)
        else:
            report |= loader_rate(cfg, args.batches)
        report |= describe(cfg)
    if os.environ.get("RANK", "0") == "0":
        args.report.write_text(json.dumps(report))


def keep_freed_memory() -> bool:
    """The trainer's own allocator settings (it applies them on CPU in make_accelerator), for the plain side."""
    from accel_gpt.distributed import keep_freed_memory

    return keep_freed_memory()


def train_config(train_args: list[str]):
    from accel_gpt.config import load_config, parse_flags

    flags = parse_flags(train_args)
    return load_config(flags.pop("config", None), flags)


def run_accel_gpt(train_args: list[str], patch: str | None) -> None:
    """Exactly `python run.py train ...`, in this process so that its peak memory can be read afterwards."""
    if patch == "strip_fp32_outputs":
        strip_fp32_outputs()
    sys.argv = [str(REPO / "run.py"), "train", *train_args]
    runpy.run_path(str(REPO / "run.py"), run_name="__main__")


def record_cpu_time() -> list[tuple[float, int]]:
    """Process CPU time at each metrics.jsonl write (with log_every 1: after every step's host sync).

    CPU seconds per step are what a load-robust comparison needs on a shared machine: other processes
    stretch the wall time of a step but hardly the CPU time it takes (one thread; not DataLoader workers).
    """
    from accel_gpt.metrics import MetricsFile

    marks: list[tuple[float, int]] = []
    write = MetricsFile.write

    def timed_write(self: MetricsFile, rows: list[dict[str, Any]]) -> None:
        marks.append((time.process_time(), len(rows)))
        write(self, rows)

    MetricsFile.write = timed_write
    return marks


def per_step(marks: list[tuple[float, int]]) -> list[float]:
    """CPU seconds of each step from the marks; the first window also holds start-up (a warm-up step)."""
    seconds, previous = [], 0.0
    for cpu, rows in marks:
        seconds += [(cpu - previous) / rows] * rows
        previous = cpu
    return seconds


def strip_fp32_outputs() -> None:
    """Experiment only: what accel_gpt would gain if Accelerate did not cast the model's outputs to fp32.

    Under mixed precision `Accelerator.prepare_model` wraps forward so that every bf16 output becomes fp32:
    the (B, T, vocab) logits, which the training step never reads, are copied to a new fp32 tensor at every
    micro-step. This replaces the wrapper by the identity before run.py builds its Accelerator.
    """
    import accelerate.accelerator

    accelerate.accelerator.convert_outputs_to_fp32 = lambda forward: forward


def loader_rate(cfg, batches: int) -> dict[str, Any]:
    """The trainer's own training DataLoader (built and prepared as train.py does), iterated alone."""
    from accel_gpt.train import build_accelerator, build_dataloaders

    accelerator = build_accelerator(cfg)
    train_dl, *_ = build_dataloaders(cfg, accelerator)
    it = iter(accelerator.prepare(train_dl))
    for _ in range(5):  # worker start-up, first page faults of the memory map
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        x, y = next(it)
    if x.is_cuda:
        torch.cuda.synchronize()  # the copies were non-blocking
    elapsed = time.perf_counter() - t0
    return {"batches_per_sec": batches / elapsed, "micro_batch_size": cfg.micro_batch_size}


def gemm_rate(n: int = 1024, bursts: int = 20) -> dict[str, Any]:
    """fp32 matmul FLOP/s on this device: on CPU the stand-in for a peak, since it has no bf16 units.

    The best of short bursts: on a shared machine a mean would measure the neighbours as much as the CPU.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b  # noqa: B018 - warm-up
    best = 0.0
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b  # noqa: B018
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return {"gemm_flops": best, "threads": torch.get_num_threads()}


def describe(cfg) -> dict[str, Any]:
    """Peak memory of this process and what MFU needs; the same fields for both sides."""
    from accel_gpt.config import MODEL_FIELDS
    from accel_gpt.metrics import device_peak_flops
    from accel_gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**{name: getattr(cfg, name) for name in MODEL_FIELDS}))
    cuda = torch.cuda.is_available()
    return {
        "tokens_per_step": cfg.total_batch_size,
        "micro_batch_tokens": cfg.micro_batch_size * cfg.seq_len,
        "flops_per_token": model.flops_per_token(),
        "n_params": model.num_params(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "peak_flops": device_peak_flops(torch.device("cuda")) if cuda else None,
        "peak_mem_bytes": torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "mem_kind": "torch.cuda.max_memory_allocated" if cuda else "max RSS",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    main()
