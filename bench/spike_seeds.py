"""The loss-spike guard over several seeds: is a guarded run ever stopped or left worse where the unguarded one
trains, and does it still skip a corrupted batch?

    python bench/spike_seeds.py --data_dir data/shakespeare [--seeds 1,2,3,4,5] [--zscore 6] [--plant 200] \
        [--work runs/spike_seeds] [--flags "--max_steps 300"]

Per seed, the `tiny-cpu` preset (the quick start: 2 x 4 x 64 tokens a step, lr 3e-3, warm-up 10) trains twice, with
`--spike_loss_zscore Z --spike_grad_zscore Z` and without, side by side (one thread each: the results do not depend
on the clock). With `--plant STEP` a copy of the data has the windows of global batch STEP overwritten with one
repeated token (a corrupted batch) and both sides train on it. Per run: the exit code, the last step, the final val
loss, and the steps the guard skipped. One JSON line per run in WORK/results.jsonl, then a table.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from accel_gpt.config import TrainConfig
from accel_gpt.data import shards
from accel_gpt.data.loader import WindowSampler
from bench.benchlib import REPO, child_env, header


def planted(data_dir: Path, work: Path, step: int, seed: int) -> Path:
    """A copy of `data_dir` whose windows of global batch `step` (1-based, under tiny-cpu's seed `seed`) hold one
    repeated token: the batch a corrupted shard would give."""
    out = work / f"planted-{step}-seed{seed}"
    if out.is_dir():
        return out
    shutil.copytree(data_dir, out, ignore=shutil.ignore_patterns(".*"))  # not the lock or the verified-shards cache
    cfg = TrainConfig.load("tiny-cpu", {"data_dir": str(out), "seed": seed})
    manifest = shards.read_manifest(out)
    (entry,) = manifest["splits"]["train"]  # the quick start's data: one training shard
    path = out / entry["file"]
    tokens = np.fromfile(path, dtype=manifest["dtype"])
    per_step, seq = cfg.windows_per_step, cfg.seq_len
    stream = iter(WindowSampler((len(tokens) - 1) // seq, seed, start=(step - 1) * per_step))
    for window in [next(stream) for _ in range(per_step)]:
        tokens[window * seq : (window + 1) * seq + 1] = manifest["vocab_size"] - 1
    tokens.tofile(path)
    entry["sha256"] = shards.sha256_file(path)
    entry.pop("max_id", None)
    shards.write_manifest(out, manifest)
    return out


def train(data_dir: Path, out: Path, seed: int, guard: float, flags: list[str]) -> dict:
    cmd = [sys.executable, "run.py", "train", "--config", "tiny-cpu", "--data_dir", str(data_dir), "--out_dir"]
    cmd += [str(out), "--overwrite", "true", "--seed", str(seed), "--sample_tokens", "0", "--log_every", "1", *flags]
    if guard:
        cmd += ["--spike_loss_zscore", str(guard), "--spike_grad_zscore", str(guard)]
    done = subprocess.run(cmd, cwd=REPO, env=child_env(1), capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if out.is_dir() else []
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return {
        "exit": done.returncode,
        "last_step": rows[-1]["step"] if rows else 0,
        "val_loss": round(val[-1], 4) if val else None,
        "skipped": [r["step"] for r in rows if r.get("skipped")],
        "error": next((line for line in done.stderr.splitlines() if line.startswith("error:")), None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", type=Path, required=True, help="the quick start's data (prepare's default)")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--zscore", type=float, default=6.0, help="the guarded side's loss and gradient z-scores")
    parser.add_argument("--plant", type=int, default=0, help="corrupt the global batch of this step (0: none)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "spike_seeds")
    parser.add_argument("--flags", default="", help="more train flags for both sides")
    args = parser.parse_args()
    print(header("spike_seeds"), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results = args.work / "results.jsonl"
    for seed in map(int, args.seeds.split(",")):
        data = planted(args.data_dir, args.work, args.plant, seed) if args.plant else args.data_dir
        sides = {"guarded": args.zscore, "unguarded": 0.0}
        with ThreadPoolExecutor(2) as pool:
            runs = {
                side: pool.submit(train, data, args.work / f"{side}-{seed}", seed, z, args.flags.split())
                for side, z in sides.items()
            }
            for side, run in runs.items():
                row = {"seed": seed, "side": side, "plant": args.plant, "zscore": sides[side], **run.result()}
                with open(results, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    print(f"\n{'seed':>4} {'plant':>5} {'side':>9} {'exit':>4} {'last':>5} {'val loss':>9}  skipped")
    for r in rows:
        val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
        print(
            f"{r['seed']:>4} {r['plant']:>5} {r['side']:>9} {r['exit']:>4} {r['last_step']:>5} {val:>9}  {r['skipped']}"
        )


if __name__ == "__main__":
    main()
