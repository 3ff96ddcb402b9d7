"""What accel_gpt's `train_step` costs beyond the plain step, interleaved step by step in one process.

Whole-run comparisons on a shared 2-vCPU machine drift by more than the difference being looked for. Here
both steps live in one process and alternate every step (A B B A ...), so drift falls on both alike, and
each step's wall and CPU time are taken around it, host sync included. With the default near-empty model
(bench.py --overhead's shape) the difference is the per-step cost of Accelerate and the trainer's step
code: DataLoaderShard, accumulate(), backward(), clip_grad_norm_, the optimizer/scheduler wrappers, reduce.

    python bench/step_overhead.py [--steps 400] [--threads 1] [--flags '--config tiny-cpu'] [--cache_lomo_check]

It also times two per-step costs found with cProfile on their own: Accelerate 1.15's AcceleratedOptimizer.step
calls `is_lomo_available()` twice, an uncached `importlib.util.find_spec` over sys.path each time; and
accel_gpt's accumulate_gradients calls `model.train()` (a walk over every module) every step.
`--cache_lomo_check` applies the candidate fix (cache that answer) before the run, to measure what it saves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from benchlib import OVERHEAD_FLAGS, load_average, synthetic_data
from plain_loop import build_model, make_batches, make_optimizer, plain_step

from accel_gpt.config import load_config, parse_flags
from accel_gpt.train import build, build_accelerator, train_step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="steps per side, after 20 warm-up steps each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flags", default=None, help="train flags (default: the near-empty model on random tokens)")
    p.add_argument("--cache_lomo_check", action="store_true", help="cache accelerate's is_lomo_available() first")
    return p.parse_args()


def cache_lomo_check() -> None:
    """The candidate fix: the answer cannot change while the process runs, so ask importlib once."""
    import functools

    import accelerate.optimizer

    accelerate.optimizer.is_lomo_available = functools.cache(accelerate.optimizer.is_lomo_available)


def per_call_ms(fn: Callable[[], object], n: int = 200) -> float:
    """Median CPU milliseconds of one call."""
    samples = []
    for _ in range(n):
        c0 = time.process_time()
        fn()
        samples.append(time.process_time() - c0)
    return 1e3 * statistics.median(samples)


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.cache_lomo_check:
        cache_lomo_check()
    flags = args.flags or f"--config tiny-cpu --data_dir {synthetic_data(128)} {OVERHEAD_FLAGS}"
    overrides = parse_flags([*flags.split(), "--eval_every", "0", "--save_every", "0", "--log_with", "none"])
    cfg = load_config(overrides.pop("config", None), overrides | {"out_dir": str(os.devnull)})
    accelerator = build_accelerator(cfg)
    run = build(cfg, accelerator)
    accel_batches = iter(run.train_dl)
    device = accelerator.device
    model = build_model(cfg, device)
    optimizer = make_optimizer(model, cfg, device)
    plain_batches = make_batches(cfg, device)
    counter = {"accel_gpt": 0, "plain": 0}

    def accel() -> None:
        row = train_step(run, accel_batches, accelerator, cfg)
        torch.stack([row["loss"], row["grad_norm"].float()]).tolist()  # the host sync LogWindow does
        counter["accel_gpt"] += 1

    def plain() -> None:
        plain_step(model, optimizer, plain_batches, cfg, counter["plain"], bf16=False).tolist()
        counter["plain"] += 1

    times: dict[str, list[tuple[float, float]]] = {"accel_gpt": [], "plain": []}
    print(f"step_overhead: {flags}; {args.threads} thread(s); before: {load_average()}", flush=True)
    for i in range(20 + args.steps):
        for name, fn in (
            (("accel_gpt", accel), ("plain", plain)) if i % 2 == 0 else (("plain", plain), ("accel_gpt", accel))
        ):
            t = timed(fn)
            if i >= 20:
                times[name].append(t)
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    for name in times:
        print(
            f"{name:<10} wall {1e3 * wall[name]:8.3f} ms/step   CPU {1e3 * cpu[name]:8.3f} ms/step "
            f"(median of {args.steps})"
        )
    import accelerate.optimizer

    lomo, train_mode = per_call_ms(accelerate.optimizer.is_lomo_available), per_call_ms(run.model.train)
    print(f"per call: is_lomo_available() {lomo:.3f} ms CPU (2 per step); model.train() {train_mode:.3f} ms CPU")
    print(f"after: {load_average()}")
    print(
        f"accel_gpt - plain per step: wall {1e3 * (wall['accel_gpt'] - wall['plain']):+.3f} ms, "
        f"CPU {1e3 * (cpu['accel_gpt'] - cpu['plain']):+.3f} ms; ratio of rates (plain/accel_gpt time): "
        f"wall {wall['plain'] / wall['accel_gpt']:.3f}, CPU {cpu['plain'] / cpu['accel_gpt']:.3f}"
    )


if __name__ == "__main__":
    main()
