"""Generation speed (new tokens/s) with and without the KV cache, through the `generate` that `run.py sample` uses.

GPT-2 124M shapes (random weights: the speed does not depend on them), greedy, on CUDA in bf16 autocast when
present, else CPU fp32. Both modes alternate over --rounds and must produce the same tokens; the best round
of each is reported.

    python bench/sample_throughput.py                          # 124M, prompt 256, 64 new tokens
    python bench/sample_throughput.py --prompt_tokens 960 --new_tokens 128   # past the 1024 context
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from accel_gpt.model import GPT, GPTConfig  # noqa: E402
from accel_gpt.sample import generate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt_tokens", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT(GPTConfig()).to(device).eval()
    prompt = torch.randint(0, 50257, (args.batch, args.prompt_tokens), device=device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    best: dict[bool, float] = {}
    outputs: dict[bool, torch.Tensor] = {}
    for _ in range(args.rounds):
        for use_cache in (True, False):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with autocast:
                outputs[use_cache] = generate(model, prompt, args.new_tokens, temperature=0.0, use_cache=use_cache)
            if device == "cuda":
                torch.cuda.synchronize()
            best[use_cache] = min(best.get(use_cache, float("inf")), time.perf_counter() - t0)
    same = torch.equal(outputs[True], outputs[False])
    new = args.batch * args.new_tokens
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"GPT-2 124M, {name}, batch {args.batch}, prompt {args.prompt_tokens}, {args.new_tokens} new tokens")
    for use_cache in (True, False):
        print(f"  cache {'on ' if use_cache else 'off'}: {best[use_cache]:.2f} s, {new / best[use_cache]:.1f} tok/s")
    print(f"speed-up {best[False] / best[True]:.2f}x; same tokens: {same}")


if __name__ == "__main__":
    main()
