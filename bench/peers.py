"""accel_gpt against the trainers a user would run instead, on the same device, in the same call, on the same tokens.

The peers are llm.c's PyTorch reference trainer (`train_gpt2.py`) and nanoGPT (`train.py` + `model.py` +
`configurator.py`), unmodified and NOT part of this repository: `--peers DIR` names a folder holding
`llmc/train_gpt2.py`, `nanogpt/*.py` and `export_tokens.py` (which writes a prepared folder's tokens in the
peers' formats). Each side trains GPT-2 124M from scratch for `--steps` steps; the sides alternate over
`--rounds`, each run a fresh process; each side's rate is the median tokens/s of its steps after `--warmup`
(compilation), pooled over rounds, and the ratios accel_gpt / peer come last. Every finished run appends one
JSON line to `--out` at once, so a timeout loses only the run in progress.

GPU (bf16, compile on, seq_len 1024, micro-batch 64, 524,288 tokens per step, as the gpt2-124m preset):

    python bench/peers.py --peers PEERS --data_dir DATA --out runs/peers.jsonl

CPU rehearsal (fp32, no compile, 124M at seq_len 64, micro-batch 2, 128 tokens per step; same glibc malloc
settings for all sides):

    python bench/peers.py --peers PEERS --data_dir DATA --steps 6 --warmup 2 --rounds 1

A/B of accel_gpt settings in the same call: each `--variant NAME='[VAR=value ...] --flag value ...'` adds a side
`accel_gpt:NAME` that trains with those extra train flags (and environment variables), e.g.

    --variant chunk='--loss_chunk 16384' --variant cudnn='--attention_backend cudnn'
    --variant autotune='TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 --compile_mode max-autotune-no-cudagraphs'
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchlib import REPO, header

CPU_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}  # accel_gpt's own CPU setting


@dataclass(frozen=True)
class Shape:
    seq_len: int
    micro_batch: int
    total_batch: int
    dtype: str  # bfloat16 | float32
    compile: bool

    @property
    def accumulation(self) -> int:
        return self.total_batch // (self.micro_batch * self.seq_len)


GPU = Shape(seq_len=1024, micro_batch=64, total_batch=524_288, dtype="bfloat16", compile=True)
CPU = Shape(seq_len=64, micro_batch=2, total_batch=128, dtype="float32", compile=False)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=Path, required=True, help="folder with llmc/, nanogpt/ and export_tokens.py")
    p.add_argument("--data_dir", type=Path, required=True, help="a `run.py prepare` folder of GPT-2 tokens")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the median (compilation)")
    p.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating")
    p.add_argument("--sides", default="accel_gpt,llmc,nanogpt", help="comma-separated subset of the sides")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC",
                   help="an extra accel_gpt side NAME trained with [VAR=value ...] --flag value ...")  # fmt: skip
    p.add_argument("--micro_batch", type=int, default=0, help="override the micro-batch (global batch kept)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run (killed after)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "peers", help="scratch folder")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per finished run here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    gpu = torch.cuda.is_available()
    shape = GPU if gpu else CPU
    if args.micro_batch:
        shape = Shape(shape.seq_len, args.micro_batch, shape.total_batch, shape.dtype, shape.compile)
    work = args.work.resolve()
    setup(args.peers.resolve(), args.data_dir.resolve(), work)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(header("peers"))
    print(f"{device}, torch {torch.__version__}: GPT-2 124M, seq_len {shape.seq_len}, micro-batch {shape.micro_batch}"
          f" x {shape.accumulation} micro-steps = {shape.total_batch:,} tokens/step, {shape.dtype}, "
          f"compile {shape.compile}; {args.steps} steps, median after {args.warmup}")  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({} if gpu else CPU_MALLOC))
    rates: dict[str, list[float]] = {}
    variants = dict(parse_variant(v) for v in args.variant)
    sides = args.sides.split(",") + [f"accel_gpt:{name}" for name in variants]
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            kind, _, variant = side.partition(":")
            flags, variant_env = variants.get(variant, ([], {}))
            cmd, cwd = COMMANDS[kind](args, shape, work, gpu, flags)
            started = time.perf_counter()
            per_step = run_side(side, cmd, cwd, env | variant_env, args.timeout, shape, work)
            measured = per_step[args.warmup :]
            rates.setdefault(side, []).extend(measured)
            record = {"side": side, "round": round_, "tok_per_s": measured, "first_steps": per_step[: args.warmup],
                      "wall_s": time.perf_counter() - started, "device": device, "shape": shape.__dict__}  # fmt: skip
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
            median = statistics.median(measured) if measured else float("nan")
            print(f"  round {round_} {side:16s} median {median:12,.0f} tok/s over {len(measured)} steps", flush=True)
    medians = {side: statistics.median(r) for side, r in rates.items() if r}
    for side, median in medians.items():
        print(f"{side:16s} {median:12,.0f} tok/s")
    if "accel_gpt" in medians:
        for side, median in medians.items():
            if side != "accel_gpt":
                print(f"accel_gpt / {side}: {medians['accel_gpt'] / median:.3f}")


def parse_variant(spec: str) -> tuple[str, tuple[list[str], dict[str, str]]]:
    """`NAME=[VAR=value ...] --flag value ...` -> (NAME, (flags, environment))."""
    name, sep, rest = spec.partition("=")
    if not sep or not name.isidentifier():
        raise SystemExit(f"--variant {spec!r}: expected NAME='[VAR=value ...] --flag value ...'")
    words, env = shlex.split(rest), {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name, (words, env)


def setup(peers: Path, data_dir: Path, work: Path) -> None:
    """The peers' own copies and the prepared tokens in their formats, in the scratch folder."""
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "llmc_train.bin").is_file():
        export = [sys.executable, str(peers / "export_tokens.py"), str(data_dir), str(work)]
        subprocess.run(export, check=True, capture_output=True, text=True)
    shutil.copy(peers / "llmc" / "train_gpt2.py", work / "train_gpt2.py")
    for f in (peers / "nanogpt").glob("*.py"):
        shutil.copy(f, work / "nanogpt" / f.name)


def accel_gpt_cmd(
    args: argparse.Namespace, s: Shape, work: Path, gpu: bool, flags: list[str]
) -> tuple[list[str], Path]:
    out = work / "accel_gpt"
    shutil.rmtree(out, ignore_errors=True)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launch += [str(REPO / "accelerate_configs" / "single_gpu.yaml"), str(REPO / "run.py")] if gpu else []
    train = [*(launch if gpu else [sys.executable, str(REPO / "run.py")]), "train"]
    train += ["--data_dir", str(args.data_dir.resolve()), "--out_dir", str(out), "--max_steps", str(args.steps)]
    train += ["--seq_len", str(s.seq_len), "--micro_batch_size", str(s.micro_batch)]
    train += ["--total_batch_size", str(s.total_batch), "--compile", str(s.compile).lower(), "--warmup_steps", "700"]
    train += ["--eval_every", "0", "--save_every", "0", "--sample_tokens", "0", "--log_every", "1"]
    train += ["--log_with", "none", *flags]
    return train, REPO


def llmc_cmd(args: argparse.Namespace, s: Shape, work: Path, gpu: bool, flags: list[str]) -> tuple[list[str], Path]:
    cmd = [sys.executable, "train_gpt2.py", "--input_bin", "llmc_train.bin", "--model", "d12"]
    cmd += ["--batch_size", str(s.micro_batch), "--sequence_length", str(s.seq_len)]
    cmd += ["--total_batch_size", str(s.total_batch), "--num_iterations", str(args.steps)]
    cmd += ["--compile", str(int(s.compile)), "--dtype", s.dtype, "--write_tensors", "0"]
    cmd += ["--overfit_single_batch", "0", "--learning_rate", "6e-4", "--warmup_iters", "700", "--weight_decay", "0.1"]
    cmd += ["--tensorcores", "1", "--flash", "1"] if gpu else ["--device", "cpu"]
    return cmd, work


def nanogpt_cmd(args: argparse.Namespace, s: Shape, work: Path, gpu: bool, flags: list[str]) -> tuple[list[str], Path]:
    cmd = [sys.executable, "train.py", "--dataset=accel", f"--batch_size={s.micro_batch}"]
    cmd += [f"--block_size={s.seq_len}", "--bias=True", f"--gradient_accumulation_steps={s.accumulation}"]
    cmd += [f"--max_iters={args.steps}", f"--compile={s.compile}", f"--dtype={s.dtype}", "--eval_interval=100000"]
    cmd += ["--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False", "--warmup_iters=700"]
    cmd += [] if gpu else ["--device=cpu"]
    return cmd, work / "nanogpt"


COMMANDS = {"accel_gpt": accel_gpt_cmd, "llmc": llmc_cmd, "nanogpt": nanogpt_cmd}


def run_side(side: str, cmd: list[str], cwd: Path, env: dict, timeout: int, s: Shape, work: Path) -> list[float]:
    """Run one side to the end (killed after `timeout`); its tokens/s at each step, from its own output."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        output, failed = proc.stdout + proc.stderr, proc.returncode != 0
    except subprocess.TimeoutExpired as e:
        output, failed = (e.stdout or b"").decode() + (e.stderr or b"").decode(), True
    if side.startswith("accel_gpt"):
        path = work / "accel_gpt" / "metrics.jsonl"
        rates = [json.loads(line)["tokens_per_sec"] for line in path.read_text().splitlines()] if path.exists() else []
    elif side == "llmc":
        rates = [float(m) for m in re.findall(r"\| (\d+) tok/s\)", output)]
    else:
        rates = [s.total_batch / (float(ms) / 1000) for ms in re.findall(r"^iter \d+: .*time ([\d.]+)ms", output, re.M)]
    if failed:
        print(f"  {side} failed or timed out after {len(rates)} steps:\n{output[-3000:]}", flush=True)
    return rates


if __name__ == "__main__":
    main()
