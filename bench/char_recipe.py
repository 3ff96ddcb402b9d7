"""nanoGPT's CPU recipe for character-level Shakespeare, side by side: nanoGPT, accel_gpt + AdamW, accel_gpt + Muon.

The recipe is nanoGPT's README's CPU run (4 layers x 4 heads x 128 wide, no biases, no dropout, context 64, batch 12,
2,000 iterations, lr 1e-3 -> 1e-4 after 100 warm-up iterations, beta2 0.99); accel_gpt runs it as the
`shakespeare-char-cpu` preset. nanoGPT is the peer's unmodified `train.py`/`model.py`/`configurator.py` from
`--nanogpt DIR`, copied into a scratch folder (it reads `data/<dataset>/` and writes `out/` relative to its working
directory).

Same data, one split: nanoGPT holds out the LAST 10% of the characters, accel_gpt's `shakespeare-char` prepare preset
the FIRST `val_tokens` (111,540 = 10%). The benchmark rotates the text (its last 111,540 characters first) and
prepares that with the preset, so both sides train on the same 1,003,854 characters and hold out the same 111,540,
with the same 65-character vocabulary; nanoGPT gets those very ids as its `train.bin`/`val.bin` (+ `meta.pkl`).

Every side is one process on one thread (OMP/MKL_NUM_THREADS=1), run one at a time, with the same glibc malloc
settings (accel_gpt's own CPU setting, given to nanoGPT too). Cost is the child's CPU seconds (user + sys), which
a shared machine disturbs far less than wall time. Quality is one scorer for every model: accel_gpt's GPT (nanoGPT's
checkpoint keys are the same names) over every non-overlapping 64-character window of the held-out split, instead of
nanoGPT's estimate from 20 random batches. Muon trains `--muon_steps` steps (default 1,000) on a schedule of that
length (the recipe's warm-up, then the cosine ending at its last step; `--muon_schedule recipe` keeps the 2,000-step
schedule and stops early instead), saving a checkpoint every `--every` steps; the first one at or below nanoGPT's
final loss gives the steps to reach it, and the CPU time to reach it is the Muon run's CPU seconds pro-rated to
that step.

    python bench/char_recipe.py --nanogpt PEERS/nanogpt --text tinyshakespeare.txt [--work runs/char_recipe] \
        [--rounds 3] [--muon_steps 1000] [--sides nanogpt,adamw,muon]

Results: one JSON line per run in WORK/results.jsonl as each finishes (a later call adds to it: the table takes
every run in the file), and a table at the end: per side the median CPU seconds of its runs. `--rounds N` runs
nanoGPT and AdamW N times each, alternating which goes first, since the same command's CPU time drifts between
calls on a shared machine.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

from accel_gpt.checkpoint import complete_checkpoints
from accel_gpt.data import shards
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.weights import load_model
from bench import ablate
from bench.benchlib import REPO, child_env, header
from bench.peers import CPU_MALLOC

VAL_CHARS = 111_540  # the shakespeare-char preset's val_tokens: nanoGPT's last 10% of 1,115,394 characters
NANOGPT_FLAGS = (  # nanoGPT's README CPU command, with config/train_shakespeare_char.py's settings spelled out
    "--dataset=accel --device=cpu --compile=False --eval_iters=20 --log_interval=10 --block_size=64 --batch_size=12 "
    "--n_layer=4 --n_head=4 --n_embd=128 --lr_decay_iters=2000 --dropout=0.0 --bias=False --learning_rate=1e-3 "
    "--min_lr=1e-4 --warmup_iters=100 --beta2=0.99 --gradient_accumulation_steps=1 --eval_interval=250 "
    "--always_save_checkpoint=True --wandb_log=False --out_dir=out"
).split()


def prepare(text: Path, work: Path) -> Path:
    """The text rotated so that nanoGPT's held-out tail comes first, prepared with the shakespeare-char preset."""
    data_dir = work / "data"
    if (data_dir / shards.MANIFEST).is_file():
        return data_dir
    content = text.read_text(encoding="utf-8")
    rotated = work / "rotated.txt"
    rotated.write_text(content[-VAL_CHARS:] + content[:-VAL_CHARS], encoding="utf-8")
    cmd = ["run.py", "prepare", "--config", "shakespeare-char", "--dataset", str(rotated), "--out_dir", str(data_dir)]
    subprocess.run([sys.executable, *cmd], cwd=REPO, env=child_env(1), check=True, stdout=subprocess.DEVNULL)
    return data_dir


def split_tokens(data_dir: Path, split: str) -> np.ndarray:
    manifest = shards.read_manifest(data_dir)
    return np.concatenate(shards.open_split(data_dir, manifest, split))


def nanogpt_folder(nanogpt: Path, data_dir: Path, work: Path) -> Path:
    """A scratch copy of nanoGPT with our ids as its `accel` dataset."""
    folder = work / "nanogpt"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(nanogpt / name, folder / name)
    dataset = folder / "data" / "accel"
    dataset.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        split_tokens(data_dir, split).astype(np.uint16).tofile(dataset / f"{split}.bin")
    manifest = shards.read_manifest(data_dir)
    with open(dataset / "meta.pkl", "wb") as f:  # nanoGPT takes vocab_size from it (else GPT-2's 50,304)
        pickle.dump({"vocab_size": manifest["vocab_size"]}, f)
    return folder


def run(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run `cmd` (one thread, the same malloc settings for every side); its CPU seconds (user + sys)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=cwd, env={**child_env(1), **CPU_MALLOC}, stdout=out, stderr=subprocess.STDOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"{cmd[1]} failed (exit {done.returncode}); see {log}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@torch.no_grad()
def score(model: torch.nn.Module, val: np.ndarray, seq_len: int, batch: int = 64) -> float:
    """Mean cross-entropy (nats per character) over every non-overlapping window of the held-out split."""
    model.eval()
    n = (len(val) - 1) // seq_len
    x_all = torch.from_numpy(val[: n * seq_len].astype(np.int64)).view(n, seq_len)
    y_all = torch.from_numpy(val[1 : n * seq_len + 1].astype(np.int64)).view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch):
        logits, _ = model(x_all[i : i + batch])
        total += F.cross_entropy(logits.flatten(0, 1), y_all[i : i + batch].flatten(), reduction="sum").item()
    return total / (n * seq_len)


def nanogpt_model(checkpoint: Path) -> GPT:
    """nanoGPT's checkpoint in accel_gpt's GPT: the same parameter names (a compiled model's prefix stripped)."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=False)  # nanoGPT pickles its config dicts
    args = ckpt["model_args"]
    cfg = GPTConfig(args["n_layer"], args["n_head"], args["n_embd"], args["block_size"], args["vocab_size"])
    model = GPT(GPTConfig(**{**cfg.to_dict(), "bias": args["bias"]}))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items() if not k.endswith(".attn.bias")}
    model.load_state_dict(state)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="the peer's folder: train.py, model.py, ...")
    parser.add_argument("--text", type=Path, required=True, help="tiny Shakespeare's input.txt")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "char_recipe")
    parser.add_argument("--steps", type=int, default=2000, help="nanoGPT's and the AdamW sides' iterations")
    parser.add_argument("--muon_steps", type=int, default=1000, help="the Muon sides' steps")
    parser.add_argument(
        "--muon_schedule", choices=["own", "recipe"], default="own",
        help="own: the schedule ends at muon_steps; recipe: the recipe's 2,000-step schedule, stopped at muon_steps",
    )  # fmt: skip
    parser.add_argument("--every", type=int, default=50, help="Muon's checkpoint interval: the crossing's resolution")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating A B, B A, ...")
    parser.add_argument("--sides", default="nanogpt,adamw,muon", help=f"nanogpt or one of {', '.join(SIDES)}")
    parser.add_argument("--flags", default="", help="more train flags for accel_gpt's sides, e.g. '--rope_theta 1e5'")
    parser.add_argument("--without", default="", help="nanochat sides: parts taken out (bench/ablate.py)")
    parser.add_argument("--embedding_std", type=float, help="nanochat sides: the embedding's init std")
    parser.add_argument("--head_std", type=float, help="nanochat sides: the head's init std")
    parser.add_argument("--tag", default="", help="names these runs in the table: SIDE/TAG")
    args = parser.parse_args()
    chosen = args.sides.split(",")
    unknown = [side for side in chosen if side != "nanogpt" and side not in SIDES]
    if unknown:
        parser.error(f"--sides {','.join(unknown)}: not one of nanogpt, {', '.join(SIDES)}")
    print(header("char_recipe"), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    data_dir = prepare(args.text, args.work)
    val = split_tokens(data_dir, "val")
    results_file = args.work / "results.jsonl"
    rows = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.is_file() else []

    def record(row: dict) -> None:
        rows.append(row)
        with open(results_file, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def nanogpt() -> None:
        folder = nanogpt_folder(args.nanogpt, data_dir, args.work)
        cpu = run([sys.executable, "train.py", *NANOGPT_FLAGS, f"--max_iters={args.steps}"], folder, folder / "log")
        loss = score(nanogpt_model(folder / "out" / "ckpt.pt"), val, 64)
        record({"side": "nanogpt", "steps": args.steps, "cpu_s": round(cpu, 1), "val_loss": round(loss, 4)})

    def accel_gpt(side: str) -> None:
        label = f"{side}/{args.tag}" if args.tag else side
        arch, optimizer = SIDES[side]
        out = args.work / label.replace("/", "-")
        train = ["run.py", "train", "--config", "shakespeare-char-cpu", "--data_dir", str(data_dir), "--overwrite"]
        train += ["true", "--arch", arch, "--optimizer", optimizer, "--out_dir", str(out), *args.flags.split()]
        ablated = {"embedding_std": args.embedding_std, "head_std": args.head_std}
        if arch == "nanochat" and (args.without or any(v is not None for v in ablated.values())):
            wrapper = ["bench/ablate.py", "--without", args.without]
            wrapper += [f for name, v in ablated.items() if v is not None for f in (f"--{name}", str(v))]
            train = [*wrapper, "--", *train[1:]]
            ablate.apply(args.without)  # the scorer below loads the ablated model's checkpoints
        if optimizer == "adamw":
            cpu = run([sys.executable, *train, "--max_steps", str(args.steps)], REPO, out.parent / f"{out.name}.log")
            loss = score(load_model(out)[0], val, 64)
            record({"side": label, "steps": args.steps, "cpu_s": round(cpu, 1), "val_loss": round(loss, 4)})
            return
        horizon = args.muon_steps if args.muon_schedule == "own" else args.steps
        flags = ["--max_steps", str(args.muon_steps), "--schedule_steps", str(horizon), "--save_every", str(args.every)]
        cpu = run([sys.executable, *train, *flags, "--keep_checkpoints", "0"], REPO, out.parent / f"{out.name}.log")
        curve = [
            (int(p.name.removeprefix("step_")), score(load_model(p)[0], val, 64)) for p in complete_checkpoints(out)
        ]
        target = next((r["val_loss"] for r in rows if r["side"] == "nanogpt"), None)
        reached = next((step for step, loss in curve if target is not None and loss <= target), None)
        row = {"side": label, "steps": args.muon_steps, "cpu_s": round(cpu, 1), "val_loss": round(curve[-1][1], 4)}
        row["curve"] = [[step, round(loss, 4)] for step, loss in curve]
        row["target"], row["steps_to_target"] = target, reached
        row["cpu_s_to_target"] = round(cpu * reached / args.muon_steps, 1) if reached else None
        record(row)

    for i in range(args.rounds):
        for side in chosen if i % 2 == 0 else chosen[::-1]:
            nanogpt() if side == "nanogpt" else accel_gpt(side)
    print_table(rows)


# accel_gpt's sides: (arch, optimizer). AdamW sides train `--steps` (the recipe's), Muon sides `--muon_steps`.
SIDES = {
    "adamw": ("gpt2", "adamw"),
    "muon": ("gpt2", "muon"),
    "nanochat-adamw": ("nanochat", "adamw"),
    "nanochat-muon": ("nanochat", "muon"),
}


def print_table(rows: list[dict]) -> None:
    """Per side: its runs' median CPU seconds (the losses are deterministic), and the ratio to nanoGPT's; then each
    curve's crossing of nanoGPT's final loss."""
    sides = {}
    for row in rows:
        sides.setdefault(row["side"], []).append(row)
    cpu = {side: statistics.median(r["cpu_s"] for r in runs) for side, runs in sides.items()}
    peer = cpu.get("nanogpt")
    width = max(len(side) for side in sides)
    header = f"{'side':{width}} {'runs':>4} {'steps':>6} {'CPU s':>8} {'CPU s/step':>10} {'val loss':>9}"
    print(f"\n{header} {'CPU / nanoGPT':>14}")
    for side, runs in sides.items():
        last = runs[-1]
        ratio = f"{cpu[side] / peer:.3f}" if peer else "-"
        line = f"{side:{width}} {len(runs):>4} {last['steps']:>6} {cpu[side]:>8.1f} {cpu[side] / last['steps']:>10.3f}"
        print(f"{line} {last['val_loss']:>9.4f} {ratio:>14}")
    for side, runs in sides.items():
        last = runs[-1]
        if "curve" not in last or not peer:
            continue
        if last["steps_to_target"]:
            print(
                f"{side} reached nanoGPT's {last['target']:.4f} at step {last['steps_to_target']} "
                f"in {last['cpu_s_to_target']:.1f} CPU s = {last['cpu_s_to_target'] / peer:.3f}x nanoGPT's CPU time"
            )
        else:
            print(f"{side} did not reach nanoGPT's {last['target']} within {last['steps']} steps")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    main()
