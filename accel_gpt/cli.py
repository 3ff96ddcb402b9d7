"""Command-line front: parse, pick the subcommand, call one function.

Heavy libraries (torch, accelerate, datasets, transformers) are imported only inside the command that
runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import sys

from accel_gpt.errors import UserError


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize a dataset into GPT-2 token shards + manifest.json",
        description="Tokenize text (a Hugging Face hub id, local txt/json/jsonl/parquet/csv files or folders, "
        "a save_to_disk folder, or an http(s) URL) into fixed-size token shards that `train` reads. "
        "Re-running the same command resumes an interrupted run and verifies a finished one.",
        epilog="Presets (flags given explicitly override them): tinyshakespeare = the classic 1.1 MB file by URL, "
        "one document, ~10% held out for val; fineweb-edu-10B = HuggingFaceFW/fineweb-edu, config sample-10BT, "
        "first 100M tokens for val (add --streaming --num_proc N). Both need internet. "
        "Several machines: --num_shards K --shard_index i (or RANK/WORLD_SIZE under accelerate launch) write "
        "OUT_DIR/part-i-of-K; the last part to finish (or --merge) writes OUT_DIR/manifest.json over all parts.",
    )
    p.add_argument("--dataset", help="hub id, local file/folder, save_to_disk folder, or http(s) URL of the text")
    p.add_argument("--preset", help="a named source: tinyshakespeare | fineweb-edu-10B (need internet)")
    p.add_argument("--dataset_config", default=None, help="hub dataset config name, e.g. sample-10BT")
    p.add_argument("--split", default=None, help="split to read (default: train)")
    p.add_argument("--val_split", default=None, help="the dataset's own validation split, if it has one")
    p.add_argument("--text_column", default="text", help="column holding the text (default: text)")
    p.add_argument(
        "--sample_by",
        choices=["line", "paragraph", "document"],
        default=None,
        help="plain text only: what one document is (default: paragraph, blank-line separated; "
        "document with --tokenizer char, whose stream has no separator)",
    )
    p.add_argument(
        "--tokenizer",
        choices=["gpt2", "char"],
        default="gpt2",
        help="gpt2 (tiktoken BPE, EOT 50256 before every document) or char (vocabulary built from the data)",
    )
    p.add_argument("--out_dir", default="data/shards", help="where shards and manifest.json go")
    p.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard (default: 100M)")
    p.add_argument(
        "--val_tokens",
        type=int,
        default=None,
        help="the first N tokens go to the val split (default: 0, or the preset's) when there is no --val_split",
    )
    p.add_argument("--num_proc", type=int, default=1, help="tokenizer worker processes")
    p.add_argument("--streaming", action="store_true", help="stream the dataset: bounded memory, any size")
    p.add_argument("--limit", type=int, default=None, help="read only the first N documents of each split")
    p.add_argument("--num_shards", type=int, default=None, help="split the input into K parts (one per node)")
    p.add_argument("--shard_index", type=int, default=None, help="which part (0..K-1) this process prepares")
    p.add_argument(
        "--merge", action="store_true", help="only merge the finished part-*-of-K folders of --out_dir: one manifest"
    )
    p.set_defaults(run=lambda a: _call("accel_gpt.data.prepare", "run_prepare", a))


def _add_train(sub: argparse._SubParsersAction) -> None:
    from accel_gpt.config import TrainConfig, field_names  # stdlib + yaml only: cheap

    defaults = TrainConfig.__dataclass_fields__
    fields = "\n".join(f"  --{n} (default: {defaults[n].default!r})" for n in field_names())
    p = sub.add_parser(
        "train",
        help="train a GPT (under `accelerate launch` for several processes)",
        description="Train a GPT-2 model. Settings: dataclass defaults, then --config (a YAML file or a "
        "preset name from accel_gpt/presets), then --field value flags. Processes, GPUs and mixed "
        "precision come from the Accelerate config / `accelerate launch` flags.",
        epilog="config fields (each one is a flag):\n" + fields,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML file or preset name (tiny-cpu, gpt2-124m, ...)")
    p.set_defaults(run=_run_train)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="HellaSwag accuracy and/or validation loss of a checkpoint; prints one JSON object",
        description="Evaluate a run directory, a checkpoint, or a transformers GPT-2 folder / hub id.",
    )
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir, or transformers GPT-2 folder/hub id")
    p.add_argument("--hellaswag", default=None, help="HellaSwag source: jsonl path/URL or hub id (Rowan/hellaswag)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N HellaSwag examples")
    p.add_argument("--data_dir", default=None, help="token shards whose 'val' split gives the validation loss")
    p.add_argument(
        "--eval_steps",
        type=int,
        default=20,
        help="validation batches of --batch_size windows, shared out over the ranks (default: 20)",
    )
    p.add_argument("--batch_size", type=int, default=8, help="sequences (or HellaSwag examples) per forward pass")
    p.add_argument("--out", default=None, help="write one jsonl line per HellaSwag example here")
    p.set_defaults(run=lambda a: _call("accel_gpt.evaluate", "run_eval", a))


def _add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a checkpoint",
        description="Continue a prompt with a run dir, checkpoint dir, or transformers GPT-2 folder / hub id. "
        "The same seed gives the same text.",
    )
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir, or transformers GPT-2 folder/hub id")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate (default: 100)")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="divides the logits: < 1 is more conservative (default: 1.0)"
    )
    p.add_argument("--top_k", type=int, default=50, help="keep the k most likely tokens (0 = all; default: 50)")
    p.add_argument("--num_samples", type=int, default=1, help="independent continuations to print (default: 1)")
    p.add_argument("--seed", type=int, default=1337, help="random seed: same seed, same text (default: 1337)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.set_defaults(run=lambda a: _call("accel_gpt.sample", "run_sample", a))


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a transformers GPT2LMHeadModel folder (weights + tokenizer)",
        description="Write a folder that transformers' GPT2LMHeadModel.from_pretrained and "
        "AutoTokenizer.from_pretrained load offline (models trained with the char tokenizer cannot be exported).",
    )
    p.add_argument("--checkpoint", required=True, help="run dir or checkpoint dir")
    p.add_argument("--out_dir", required=True, help="a new or empty folder for from_pretrained")
    p.set_defaults(run=lambda a: _call("accel_gpt.hf", "run_export", a))


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="PNG of loss, lr, HellaSwag and tokens/s over steps (runs overlaid)",
        description="Draw train/val loss, learning rate, HellaSwag accuracy and tokens/s over optimizer steps from "
        "each run's metrics.jsonl; several runs are overlaid, one colour per run, named by their directory. "
        "Needs matplotlib: pip install 'accel_gpt[plot]'.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument(
        "--out", default="runs.png", help="output file; .png (default: runs.png), .pdf or .svg picks the format"
    )
    p.set_defaults(run=lambda a: _call("accel_gpt.plot", "run_plot", a))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel-gpt",
        description="GPT-2 pretraining with Hugging Face Accelerate: prepare -> train -> eval/sample/export.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_prepare, _add_train, _add_eval, _add_sample, _add_export, _add_plot):
        add(sub)
    return parser


def _call(module: str, func: str, args: argparse.Namespace) -> None:
    import importlib

    getattr(importlib.import_module(module), func)(args)


def _run_train(args: argparse.Namespace) -> None:
    from accel_gpt.config import load_config, parse_flags

    cfg = load_config(args.config, parse_flags(args.extra))
    from accel_gpt.train import train

    train(cfg)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        args.run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
