"""Causal attention on a CPU under bf16: torch's bf16 kernel against the same inputs cast to fp32, by shape.

The measurement behind `accel_gpt.model.CPU_FP32_ATTENTION_MAX_T`: on a CPU under bf16, `attend` computes attention
over up to that many positions in fp32 (inputs cast up, output cast back), because torch's bf16 flash-attention
kernel, its backward most, was the slower there on the CPU it was measured on. Each row times a forward + backward
of `scaled_dot_product_attention(is_causal=True)` on bf16 tensors both ways, the two sides alternated call by call,
and says which was faster and whether the rule picks it. Run it on each CPU class before trusting the constant there
(it was set on an AVX512-BF16 EPYC); to see an AVX2-only CPU's bf16 path on this machine, cap oneDNN and ATen:

    python bench/attention_precision.py [--threads 1,2] [--repeats 11]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/attention_precision.py

CPU ms is the process's CPU time (all threads), the figure a shared machine disturbs least; wall ms beside it.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from accel_gpt.model import CPU_FP32_ATTENTION_MAX_T
from bench.benchlib import alternate, header, table

# (batch, heads, positions, head width): nanoGPT's CPU recipe, the 23M case of bench/cost_by_size.py, and around them
SHAPES = [
    (12, 4, 64, 32),
    (12, 2, 64, 64),
    (12, 4, 128, 32),
    (8, 2, 256, 64),
    (8, 6, 256, 64),
    (8, 12, 256, 64),
    (8, 4, 512, 32),
    (8, 6, 512, 64),
    (4, 12, 768, 64),
    (4, 12, 1024, 64),
]


def bf16_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def fp32_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What `attend` does under the rule: the inputs cast to fp32, the output back to bf16."""
    y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return y.to(torch.bfloat16)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(CPU ms, wall ms) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return 1000 * (time.process_time() - cpu), 1000 * (time.perf_counter() - wall)


def measure(shape: tuple[int, int, int, int], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (CPU ms, wall ms) of a forward + backward per side, the sides alternated call by call."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(*shape, generator=gen).bfloat16()
    sides = {"bf16": bf16_kernel, "fp32": fp32_kernel}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for i, name in alternate(list(sides), repeats + 2):  # the first two rounds warm up
        spent = timed(lambda fn=sides[name]: fn(q, k, v).backward(grad))
        if i >= 2:
            runs[name].append(spent)
    return {name: tuple(statistics.median(t[j] for t in rows) for j in (0, 1)) for name, rows in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=11, help="timed calls per side and shape")
    args = parser.parse_args()
    print(header("attention_precision"))
    print(f"the rule: fp32 up to {CPU_FP32_ATTENTION_MAX_T} positions, bf16 beyond")
    cols = ["threads", "batch x heads x positions x width", "bf16 CPU ms", "fp32 CPU ms", "bf16 wall ms",
            "fp32 wall ms", "fp32 / bf16 (CPU)", "rule", "rule faster"]  # fmt: skip
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for shape in SHAPES:
            got = measure(shape, args.repeats)
            ratio = got["fp32"][0] / got["bf16"][0]
            rule = "fp32" if shape[2] <= CPU_FP32_ATTENTION_MAX_T else "bf16"
            faster = "fp32" if ratio < 1 else "bf16"
            cells = [f"{got[side][j]:.2f}" for j in (0, 1) for side in ("bf16", "fp32")]
            rows.append([str(threads), " x ".join(map(str, shape)), *cells, f"{ratio:.2f}", rule,
                         "yes" if rule == faster else "no"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(table(cols, rows))


if __name__ == "__main__":
    main()
