"""HellaSwag scoring throughput (examples/s) through the same `score_hellaswag` the trainer and `eval` use.

CPU (the default): the tiny test model over the first --limit rows of the shared validation file.
GPU: GPT-2 124M over all 10,042 rows, random-init weights unless --checkpoint names a transformers
GPT-2 folder or an accel_gpt run (the speed does not depend on the weights), bf16 autocast.

    python bench/hellaswag_throughput.py                                   # tiny model, CPU, 200 rows
    python bench/hellaswag_throughput.py --model gpt2-124m --limit 0 --mixed_precision bf16  # GPU
    add --write to replace the `## HellaSwag` section of bench/RESULTS.md with the result.

Under `accelerate launch` it runs on every process and reports the whole group's rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO.parent / "shared" / "tiktoken_cache"))

import torch  # noqa: E402

from accel_gpt.distributed import make_accelerator  # noqa: E402
from accel_gpt.evaluate.hellaswag import hellaswag_metrics, load_hellaswag, score_hellaswag  # noqa: E402
from accel_gpt.model import GPT, GPTConfig  # noqa: E402

MODELS = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=64, vocab_size=50304),
    "gpt2-124m": GPTConfig(),  # 12 layers, 12 heads, width 768, context 1024, vocabulary 50,304
}
SECTION = "## HellaSwag"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "hellaswag_val.jsonl"))
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--checkpoint", default=None, help="weights to load instead of random init (run dir / HF folder)")
    p.add_argument("--limit", type=int, default=200, help="rows to score (0 = all)")
    p.add_argument("--batch_sizes", default="1,8", help="examples per forward pass, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per batch size, alternating sizes")
    p.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--compile", action="store_true", help="model.compile() before scoring")
    p.add_argument("--write", action="store_true", help="replace the ## HellaSwag section of bench/RESULTS.md")
    return p.parse_args()


def build_model(args: argparse.Namespace, device: torch.device) -> GPT:
    if args.checkpoint:
        from accel_gpt.artifacts import load_model

        return load_model(args.checkpoint, device)[0]
    torch.manual_seed(0)
    return GPT(MODELS[args.model]).to(device).eval()


def timed(fn):
    """(seconds, fn()) with the GPU drained on both sides."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main() -> None:
    args = parse_args()
    accelerator = make_accelerator(mixed_precision=args.mixed_precision)
    examples = load_hellaswag(args.data, limit=args.limit or None)
    model = build_model(args, accelerator.device)
    if args.mixed_precision != "no":
        model = accelerator.prepare_model(model, evaluation_mode=True)
    if args.compile:
        model.compile()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    for b in sizes:  # warm-up: tokenizer, allocator, kernels (and compilation) out of the timings
        score_hellaswag(model, accelerator, examples[: 4 * b * accelerator.num_processes], b)
    seconds: dict[int, list[float]] = {b: [] for b in sizes}
    metrics = {}
    for _ in range(args.repeats):  # alternate the sizes: this machine's speed drifts between calls
        for b in sizes:
            elapsed, predictions = timed(lambda b=b: score_hellaswag(model, accelerator, examples, b))
            seconds[b].append(elapsed)
            metrics = hellaswag_metrics(predictions)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    lines = [
        f"{args.model}{' (' + args.checkpoint + ')' if args.checkpoint else ' (random init)'}, "
        f"{len(examples)} examples, {accelerator.num_processes} process(es), {device}, "
        f"mixed_precision={args.mixed_precision}{', compiled' if args.compile else ''}: "
        + ", ".join(f"batch {b}: {len(examples) / min(s):,.1f} examples/s ({min(s):.2f} s)" for b, s in seconds.items())
        + f"; acc_norm {metrics['acc_norm']:.4f}; load average {os.getloadavg()[0]:.1f} (a shared machine)"
    ]
    if accelerator.is_main_process:
        print("\n".join(lines))
        if args.write:
            write_section(lines, " ".join(sys.argv[1:]))


def write_section(lines: list[str], argv: str) -> None:
    """Add this run's lines to the `## HellaSwag` section of bench/RESULTS.md (made if missing), leaving
    every other section alone."""
    path = REPO / "bench" / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    threads = os.environ.get("OMP_NUM_THREADS")
    command = f"{'OMP_NUM_THREADS=' + threads + ' ' if threads else ''}python bench/hellaswag_throughput.py {argv}"
    entry = [f"- `{command}`"] + [f"  - {line}" for line in lines]
    start = text.find(SECTION)
    if start == -1:
        intro = [
            SECTION,
            "",
            "Scoring throughput of `score_hellaswag` (4 candidates per example in one right-padded batch,",
            "several examples per forward pass); best of the timed passes, batch sizes alternated.",
            "",
        ]
        text = text.rstrip("\n") + "\n\n" + "\n".join(intro + entry) + "\n"
    else:
        end = text.find("\n## ", start + len(SECTION))
        end = len(text) if end == -1 else end + 1
        rest = "\n" + text[end:] if end < len(text) else ""
        text = text[:end].rstrip("\n") + "\n\n" + "\n".join(entry) + "\n" + rest
    path.write_text(text)


if __name__ == "__main__":
    main()
