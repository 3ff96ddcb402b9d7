"""Peak memory and time of the LM head + cross-entropy, full logits against `chunked_lm_loss`, forward + backward.

GPT-2 124M's head (50,304 x 768, tied) over N rows of final hidden states, each variant in a fresh child process
so that its peak is its own: CPU peak RSS (ru_maxrss) above the inputs, or CUDA max_memory_allocated; the two
must give the same loss and gradients (checked). `--dtype bf16` runs under autocast as training does.

    python bench/loss_memory.py                          # N = 8 x 1024 rows, fp32, CPU
    python bench/loss_memory.py --rows 65536 --dtype bf16  # GPU: one 64 x 1024 micro-batch
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from accel_gpt.model import chunked_lm_loss
from bench.benchlib import header


def measure(rows: int, chunk: int, dtype: str, device: str) -> dict[str, float]:
    """One variant in this process: loss, gradient checksums, seconds, and peak bytes above the inputs."""
    torch.manual_seed(0)
    h = torch.randn(rows, 768, device=device, requires_grad=True)
    weight = (torch.randn(50_304, 768, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, 50_257, (rows,), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        if chunk:
            loss = chunked_lm_loss(h, weight, targets, chunk)
        else:
            loss = F.cross_entropy((h @ weight.t()).float(), targets)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        "loss": loss.item(),
        "grad_h": h.grad.double().abs().sum().item(),
        "grad_w": weight.grad.double().abs().sum().item(),
        "seconds": time.perf_counter() - start,
        "peak_bytes": peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8 * 1024, help="rows of hidden states (micro-batch x seq_len)")
    p.add_argument("--chunk", type=int, default=1024, help="rows per chunk of the chunked variant")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child is not None:
        print(json.dumps(measure(args.rows, args.child, args.dtype, device)))
        return
    results = {}
    for chunk in (0, args.chunk):
        cmd = [sys.executable, __file__, "--rows", str(args.rows), "--dtype", args.dtype, "--child", str(chunk)]
        results[chunk] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    full, chunked = results[0], results[args.chunk]
    print(header("loss_memory"))
    print(f"{device}, {args.rows:,} rows x 50,304 vocab, {args.dtype}, torch {torch.__version__}")
    for name, r in (("full logits", full), (f"chunked ({args.chunk} rows)", chunked)):
        print(f"  {name:22s} peak {r['peak_bytes'] / 2**20:8.0f} MiB   {r['seconds']:6.2f} s   loss {r['loss']:.6f}")
    for key in ("loss", "grad_h", "grad_w"):
        rel = abs(full[key] - chunked[key]) / abs(full[key])
        print(f"  {key}: relative difference {rel:.1e}")
    print(f"  peak memory ratio chunked / full: {chunked['peak_bytes'] / full['peak_bytes']:.2f}")


if __name__ == "__main__":
    main()
