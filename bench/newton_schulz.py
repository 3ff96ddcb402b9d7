"""What bf16 costs against fp32 on this device: Muon's Newton-Schulz per matrix shape, and a forward + backward under
bf16 autocast, one thread, CPU milliseconds (`time.process_time`, the median of `--repeats` timings).

These are the measurements behind `accel_gpt.precision`'s decisions: which dtype `muon_ns_dtype auto` picks for a
shape, and the warning for bf16 mixed precision on a CPU without bf16 matrix units. To see another class on this
machine, cap oneDNN (which runs torch's CPU bf16 matmuls) below bf16, e.g. an AVX2-only CPU's bf16 path:

    python bench/newton_schulz.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/newton_schulz.py

Newton-Schulz: `accel_gpt.muon.orthogonalize` of 4 same-shaped matrices (5 iterations), as one batch and one at a
time. Model: nanoGPT's CPU recipe (4 x 4 x 128, 12 x 64 characters, vocabulary 65), both blocks.
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

from accel_gpt.config import TrainConfig
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.muon import orthogonalize
from bench.benchlib import header, table

SHAPES = [(64, 64), (256, 64), (128, 128), (384, 128), (512, 128), (128, 512), (768, 768)]
SCHEDULE = [(3.4445, -4.7750, 2.0315)] * 5  # torch's Muon defaults: 5 iterations of one quintic


def ms(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU milliseconds of one call, after 2 warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def newton_schulz_rows(repeats: int) -> list[list[str]]:
    rows = []
    for shape in SHAPES:
        g = torch.randn(4, *shape)
        row = [f"4 x {shape[0]}x{shape[1]}"]
        for dtype in (torch.float32, torch.bfloat16):
            batched = ms(lambda: orthogonalize(g, SCHEDULE, 1e-7, dtype), repeats)  # noqa: B023
            one = ms(lambda: [orthogonalize(m[None], SCHEDULE, 1e-7, dtype) for m in g], repeats)  # noqa: B023
            row += [f"{batched:.2f}", f"{one:.2f}"]
        row.append(f"{float(row[1]) / float(row[3]):.2f}")
        rows.append(row)
    return rows


def autocast_rows(repeats: int) -> list[list[str]]:
    rows = []
    tokens = torch.randint(0, 65, (12, 65), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for arch in ("gpt2", "nanochat"):
        shape = dict(n_layer=4, n_head=4, n_embd=128, seq_len=64, vocab_size=65)
        cfg = TrainConfig(data_dir="-", arch=arch, micro_batch_size=12, total_batch_size=768, **shape)
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg.model_settings()))

        fp32, bf16 = (ms(lambda: forward_backward(model, x, y, half), repeats) for half in (False, True))  # noqa: B023
        rows.append([arch, f"{fp32:.1f}", f"{bf16:.1f}", f"{bf16 / fp32:.2f}"])
    return rows


def forward_backward(model: GPT, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(x, y)[1].backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(header("newton_schulz"))
    print("\nNewton-Schulz, 5 iterations, CPU ms (batched: the 4 as one batch; each: one at a time)")
    cols = ["matrices", "fp32 batched", "fp32 each", "bf16 batched", "bf16 each", "fp32 / bf16 (batched)"]
    print(table(cols, newton_schulz_rows(args.repeats)))
    print("\nforward + backward of nanoGPT's CPU recipe, CPU ms")
    print(table(["block", "fp32", "bf16 autocast", "bf16 / fp32"], autocast_rows(args.repeats)))


if __name__ == "__main__":
    main()
