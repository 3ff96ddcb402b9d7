"""Which tokenizer a small model should train on: the same shape, the same CPU time, on characters, on byte-level
BPEs of several sizes learned from the text, and on GPT-2's 50,257 tokens, scored in bits per byte on one held-out
text.

    python bench/vocab_sweep.py --shape tiny-cpu --seconds 60
    python bench/vocab_sweep.py --shape char-recipe --seconds 180 --vocabs char,2048 -- --arch nanochat
    python bench/vocab_sweep.py --text numbers.txt --vocabs 4096,4096:N2,4096:N3

A BPE's size may name another split of digit runs to learn with (`SIZE:N2`: runs of up to two, accel_gpt's
before it took llama.cpp's `bailingmoe` split; `SIZE:N3`: up to three, as llama.cpp's `llama-bpe`; plain `SIZE` or
`SIZE:N1`: accel_gpt's own single digits),
for the GGUF export's choice of pre-tokenizer. `--text` replaces the bundled tiny Shakespeare (a text with numbers
for that choice).

The text is the bundled tiny Shakespeare: its first 10% (cut at a blank line; `--held_out last`: its last 10%, as
nanoGPT holds it out) is the held-out document and the rest the training document, the same two for every
tokenizer (checked: the val split's bytes are the held-out text's). A BPE learns from the training document only (a
prepare of it alone) and then prepares both with `--tokenizer_file`.
Each run trains by `--time_budget` (one thread; the steps' own time, so start-up and the first step are left out)
with `max_steps` out of reach, so its schedule decays over the budget, and is then scored by `run.py eval` over the
whole held-out split. The model's shape is the preset's (`--shape`), its vocabulary the data's (padded to 128);
flags after `--` go to every `train`. Runs are in sequence, one at a time: the CPU seconds are the train
processes' user+sys.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchlib import REPO, RUNS, child_env, header

SHAPES = {"tiny-cpu": "tiny-cpu", "char-recipe": "shakespeare-char-cpu"}
TEXT = REPO / "accel_gpt" / "data" / "tinyshakespeare.txt"


def split_text(held_out: str, source: Path = TEXT) -> tuple[str, str]:
    """The held-out text and the training text: `first`, the first ~10% (up to a blank line); `last`, the last 10%
    exactly as nanoGPT's shakespeare_char cuts it (`data[int(n * 0.9):]`), whose loss its README reports."""
    text = source.read_text(encoding="utf-8")
    if held_out == "last":
        cut = int(len(text) * 0.9)
        return text[cut:], text[:cut]
    cut = text.index("\n\n", len(text) // 10) + 2
    return text[:cut], text[cut:]


def run(cmd: list[str], log: Path) -> tuple[float, str]:
    """CPU seconds (user+sys) of a child process, and its stdout; its stderr goes to `log`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as err:
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(threads=1), stdout=subprocess.PIPE, stderr=err, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, proc.stdout


def prepared(work: Path, name: str, held_out: str, rest: str) -> Path:
    """The two documents as shards of tokenizer `name` (char | gpt2 | a BPE's size), val = the held-out one."""
    from accel_gpt.tokenizer import Tokenizer

    data = work / f"data-{name}"
    if (data / "manifest.json").is_file():
        return data
    corpus = work / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": held_out}) + "\n" + json.dumps({"text": rest}) + "\n")
    flags = ["--tokenizer", name] if name in ("char", "gpt2") else []
    if name == "char":
        val = len(held_out)
    elif name == "gpt2":
        val = 1 + len(Tokenizer("gpt2").encode(held_out))
    else:
        (work / "train.txt").write_text(rest)
        learned = work / f"tokenizer-{name}"
        shutil.rmtree(learned, ignore_errors=True)
        size, _, digits = name.partition(":")
        flags = ["--dataset", str(work / "train.txt"), "--tokenizer", "bpe", "--vocab_size", size]
        run_prepare(flags, learned, work, DIGIT_RUNS[digits])
        val = 1 + len(Tokenizer.bpe_file(learned / "tokenizer.json").encode(held_out))
        flags = ["--tokenizer", "bpe", "--tokenizer_file", str(learned / "tokenizer.json")]
    run_prepare(["--dataset", str(corpus), *flags, "--val_tokens", str(val)], data, work)
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["bytes"]["val"] == len(held_out.encode()), (name, manifest["bytes"])
    return data


def run_prepare(flags: list[str], out: Path, work: Path, digits: str = "") -> None:
    """`run.py prepare FLAGS`; with `digits`, its BPE learns with that digit-run alternative in the split instead."""
    if not digits or digits == DIGIT_RUNS[""]:
        run([sys.executable, "run.py", "prepare", *flags, "--out_dir", str(out)], work / "prepare.log")
        return
    own, other = f"|{DIGIT_RUNS['']}|", f"|{digits}|"
    learn_with = (
        "import sys; from accel_gpt import bpe; from accel_gpt.cli import main; "
        f"assert {own!r} in bpe.SPLIT_PATTERN, 'the split no longer has the digit runs this replaces'; "
        f"bpe.SPLIT_PATTERN = bpe.SPLIT_PATTERN.replace({own!r}, {other!r}); "
        "pre = bpe._pre_tokenizer; bpe._pre_tokenizer = lambda pattern=bpe.SPLIT_PATTERN: pre(pattern); "
        "main(sys.argv[1:])"
    )
    run([sys.executable, "-c", learn_with, "prepare", *flags, "--out_dir", str(out)], work / "prepare.log")


# A BPE name's suffix -> the split's digit-run alternative it learns with ("": accel_gpt's own, single digits).
DIGIT_RUNS = {"": r"\p{N}", "N1": r"\p{N}", "N2": r"\p{N}{1,2}", "N3": r"\p{N}{1,3}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="tiny-cpu")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--vocabs", default="char,512,1024,2048,4096,8192,gpt2")
    parser.add_argument("--held_out", choices=("first", "last"), default="first")
    parser.add_argument("--text", type=Path, default=TEXT, help="the text (default: the bundled tiny Shakespeare)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    print(header("bench/vocab_sweep.py"))
    print(f"shape {args.shape} ({SHAPES[args.shape]}), {args.seconds:g} s of steps each, one thread, flags {extra}")
    work = RUNS / f"vocab_sweep-{args.held_out}" / ("" if args.text == TEXT else args.text.stem)
    work.mkdir(parents=True, exist_ok=True)
    held_out, rest = split_text(args.held_out, args.text)
    print("| tokenizer | ids | parameters | steps | train CPU s | val bits per byte |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.vocabs.split(","):
        data = prepared(work, name, held_out, rest)
        manifest = json.loads((data / "manifest.json").read_text())
        vocab = manifest["vocab_size"] if name == "char" else -(-manifest["vocab_size"] // 128) * 128
        out = work / f"run-{args.shape}-{name}"
        shutil.rmtree(out, ignore_errors=True)
        flags = [
            *("--config", SHAPES[args.shape], "--data_dir", str(data), "--out_dir", str(out)),
            *("--vocab_size", str(vocab), "--max_steps", "100000000", "--time_budget", f"{args.seconds:g}"),
            *("--eval_every", "0", "--save_every", "0", "--sample_tokens", "0", "--log_every", "50"),
            *("--log_with", "none", *extra),
        ]
        cpu, _ = run([sys.executable, "run.py", "train", *flags], work / f"train-{name}.log")
        windows = (manifest["tokens"]["val"] - 1) // read_seq_len(out)  # the whole held-out split
        _, scored = run(
            [sys.executable, "run.py", "eval", "--checkpoint", str(out), "--data_dir", str(data), "--eval_windows",
             str(windows)], work / f"eval-{name}.log",
        )  # fmt: skip
        result = json.loads(scored)
        card = json.loads((out / "model_config.json").read_text())
        params = parameters(card["model"])
        print(
            f"| {name if name in ('char', 'gpt2') else 'bpe ' + DIGIT_RUNS[name.partition(':')[2]]} | "
            f"{manifest['vocab_size']:,} | {params / 1e6:.2f}M | "
            f"{card['step']:,} | {cpu:.0f} | {result['val_bpb']:.4f} |",
            flush=True,
        )
    print(f"runs in {work} (load average at the end {os.getloadavg()[0]:.2f})")


def read_seq_len(run_dir: Path) -> int:
    return json.loads((run_dir / "model_config.json").read_text())["model"]["seq_len"]


def parameters(model: dict) -> int:
    from types import SimpleNamespace

    from accel_gpt.memory import parameter_counts

    shape = {"bias": True, "n_kv_head": None, **model}
    return parameter_counts(SimpleNamespace(**shape))[0]


if __name__ == "__main__":
    main()
