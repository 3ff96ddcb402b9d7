"""Inference speed through the code the commands use: sampling with and without the KV cache (`generate`, as
`run.py sample`), and HellaSwag scoring (`score_hellaswag`, as `run.py eval` and the trainer).

The model has a preset's shapes and random weights unless --checkpoint names a run, checkpoint or transformers
GPT-2 folder (speed does not depend on the weights). Defaults: GPU: gpt2-124m shapes, bf16 autocast. CPU:
tiny-cpu shapes, fp32. Timings alternate between the variants over --rounds (this machine's speed drifts
between calls) and the best round of each is reported; the two sampling modes must give the same tokens.
Under `accelerate launch` HellaSwag is scored by the whole group and its rate is the group's.

    python bench/generate_throughput.py                                     # both, the device's defaults
    python bench/generate_throughput.py --what sampling --model gpt2-124m   # GPT-2 124M shapes, prompt 256, 64 new
    python bench/generate_throughput.py --what hellaswag --hellaswag FILE --batch_sizes 16,64   # all rows of FILE
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from accelerate import Accelerator

from accel_gpt.config import MODEL_FIELDS, TrainConfig
from accel_gpt.evaluate.hellaswag import hellaswag_loader, hellaswag_metrics, load_hellaswag, score_hellaswag
from accel_gpt.generate import generate
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.runtime import make_accelerator
from bench.benchlib import REPO, header

HELLASWAG = REPO / "tests" / "data" / "hellaswag_val.jsonl"  # 50 rows; the full set has 10,042


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["sampling", "hellaswag", "both"], default="both")
    p.add_argument("--model", default="gpt2-124m" if cuda else "tiny-cpu", help="train preset whose shapes to use")
    p.add_argument("--checkpoint", default=None, help="real weights instead: run dir, checkpoint, transformers folder")
    p.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default="bf16" if cuda else "no")
    p.add_argument("--rounds", type=int, default=2, help="timed passes per variant, alternating")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--prompt_tokens", type=int, default=None, help="default: a quarter of the context")
    sampling.add_argument("--new_tokens", type=int, default=None, help="default: 64, at most half the context")
    sampling.add_argument("--batch", type=int, default=1, help="sequences generated together")
    hellaswag = p.add_argument_group("hellaswag")
    hellaswag.add_argument("--hellaswag", default=str(HELLASWAG), help="jsonl rows (default: tests/data's 50 rows)")
    hellaswag.add_argument("--limit", type=int, default=0, help="score only the first N rows (0 = all)")
    hellaswag.add_argument("--batch_sizes", default="1,8", help="examples per forward pass, comma-separated")
    hellaswag.add_argument("--compile", action="store_true", help="torch.compile the model first")
    return p.parse_args()


def build_model(args: argparse.Namespace, accelerator: Accelerator) -> tuple[torch.nn.Module, GPTConfig]:
    """The model, with autocast from --mixed_precision as `run.py eval` applies it (prepare_model, no wrapping)."""
    if args.checkpoint:
        from accel_gpt.weights import load_model

        model, card = load_model(args.checkpoint, accelerator.device)
        cfg = card.model
    else:
        preset = TrainConfig.load(args.model, {"data_dir": "unused"})
        cfg = GPTConfig(**{name: getattr(preset, name) for name in MODEL_FIELDS})
        torch.manual_seed(0)
        model = GPT(cfg).to(accelerator.device).eval()
    if args.mixed_precision != "no":
        model = accelerator.prepare_model(model, evaluation_mode=True)
    return model, cfg


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, fn()) with the GPU drained on both sides."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def sampling(args: argparse.Namespace, model: torch.nn.Module, cfg: GPTConfig, device: torch.device) -> None:
    """Greedy generation with the KV cache against re-reading the whole window for every new token."""
    prompt_tokens = args.prompt_tokens or cfg.seq_len // 4
    new_tokens = args.new_tokens or min(64, cfg.seq_len // 2)
    prompt = torch.randint(0, min(cfg.vocab_size, 50257), (args.batch, prompt_tokens), device=device)
    best: dict[bool, float] = {}
    outputs: dict[bool, torch.Tensor] = {}
    for _ in range(args.rounds):
        for use_cache in (True, False):
            seconds, outputs[use_cache] = timed(
                lambda use_cache=use_cache: generate(
                    model, cfg, prompt, new_tokens, temperature=0.0, use_cache=use_cache
                )
            )
            best[use_cache] = min(best.get(use_cache, float("inf")), seconds)
            print(f"  cache {'on ' if use_cache else 'off'}: {seconds:.2f} s", flush=True)
    new = args.batch * new_tokens
    print(f"sampling: batch {args.batch}, prompt {prompt_tokens}, {new_tokens} new tokens, best of {args.rounds}")
    for use_cache in (True, False):
        print(f"  cache {'on ' if use_cache else 'off'}: {best[use_cache]:.2f} s, {new / best[use_cache]:,.1f} tok/s")
    same = torch.equal(outputs[True], outputs[False])
    print(f"speed-up with the cache {best[False] / best[True]:.2f}x; same tokens: {same}", flush=True)


def hellaswag(args: argparse.Namespace, model: torch.nn.Module, cfg: GPTConfig, accelerator: Accelerator) -> None:
    """Examples/s of `score_hellaswag` over the rows, for each batch size (examples per forward pass)."""
    examples = load_hellaswag(args.hellaswag, args.limit or None)
    if args.compile:
        model.compile()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    loaders = {b: accelerator.prepare_data_loader(hellaswag_loader(examples, cfg.seq_len, b)) for b in sizes}
    for b in sizes:  # warm-up: tokenizer, allocator, kernels (and compilation) out of the timings
        warm = examples[: 4 * b * accelerator.num_processes]
        score_hellaswag(model, accelerator, accelerator.prepare_data_loader(hellaswag_loader(warm, cfg.seq_len, b)))
    best: dict[int, float] = {}
    metrics: dict[str, Any] = {}
    for _ in range(args.rounds):
        for b in sizes:
            seconds, predictions = timed(lambda b=b: score_hellaswag(model, accelerator, loaders[b]))
            best[b] = min(best.get(b, float("inf")), seconds)
            metrics = hellaswag_metrics(predictions)
            if accelerator.is_main_process:
                print(f"  batch {b}: {seconds:.2f} s", flush=True)
    if accelerator.is_main_process:
        rates = ", ".join(f"batch {b}: {len(examples) / s:,.1f} examples/s ({s:.2f} s)" for b, s in best.items())
        print(f"hellaswag: {len(examples)} examples, {accelerator.num_processes} process(es), best of {args.rounds}")
        print(f"  {rates}; acc_norm {metrics['acc_norm']:.4f}", flush=True)


def main() -> None:
    args = parse_args()
    accelerator = make_accelerator(mixed_precision=args.mixed_precision)
    model, cfg = build_model(args, accelerator)
    if accelerator.is_main_process:
        weights = args.checkpoint or f"{args.model} shapes, random weights"
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
        print(header("generate_throughput"))
        print(f"{weights}; {where}; mixed precision {args.mixed_precision}", flush=True)
    if args.what in ("sampling", "both") and accelerator.is_main_process:
        sampling(args, model, cfg, accelerator.device)
    if args.what in ("hellaswag", "both"):
        hellaswag(args, model, cfg, accelerator)


if __name__ == "__main__":
    main()
