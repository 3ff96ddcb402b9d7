"""The command line: every command's flags are generated from its config dataclass, then one function runs.

`--config NAME` (a YAML file or a preset) is read before the flags are built, so `--config NAME --help`
shows that preset's values as the defaults. Heavy libraries (torch, accelerate, datasets, transformers)
are imported only by the command that runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any, NoReturn

from accel_gpt.config import (
    CompareConfig,
    Config,
    EvalConfig,
    ExportConfig,
    PlotConfig,
    PrepareConfig,
    SampleConfig,
    TrainConfig,
    config_values,
    did_you_mean,
    preset_names,
)
from accel_gpt.errors import ConfigError, UserError, WindowError, is_main_rank


@dataclass(frozen=True)
class Command:
    config: type[Config]
    run: str  # "module:function", called with the resolved config
    help: str
    description: str
    one_process: bool = False  # builds no Accelerator and shares no work: under a launch of several, rank 0 runs it


COMMANDS = {
    "prepare": Command(
        PrepareConfig,
        "accel_gpt.data.prepare:run_prepare",
        "tokenize a dataset into token shards (GPT-2's, a BPE learned from it, or characters) + manifest.json",
        "Tokenize text (a Hugging Face hub id, local txt/json/jsonl/parquet/csv files or folders, a save_to_disk "
        "folder, or an http(s) URL: hub ids and URLs need internet) into fixed-size token shards that `train` reads. "
        "With no --dataset and no --preset, it prepares the tiny Shakespeare that ships with accel_gpt as the "
        "tinyshakespeare preset does (into data/shakespeare, which the tiny-cpu preset reads). "
        "Re-running the same command resumes an interrupted run and verifies a finished one. On several machines, "
        "--num_shards K --shard_index i (or RANK/WORLD_SIZE under accelerate launch) write OUT_DIR/part-i-of-K; "
        "the last part to finish (or --merge) writes OUT_DIR/manifest.json over all parts.",
    ),
    "train": Command(
        TrainConfig,
        "accel_gpt.train:train",
        "train a GPT (under `accelerate launch` for several processes)",
        "Train a GPT-2 model. Settings: the defaults below, then --config (a YAML file or a preset), then "
        "--field value flags. Processes, GPUs and mixed precision come from the Accelerate config / "
        "`accelerate launch` flags.",
    ),
    "eval": Command(
        EvalConfig,
        "accel_gpt.evaluate.command:run_eval",
        "HellaSwag accuracy and/or validation loss of a checkpoint; prints one JSON object",
        "Evaluate a run directory, a checkpoint, or a transformers GPT-2 folder / hub id, on any number of "
        "processes (`accelerate launch`): the result is the same for any number.",
    ),
    "sample": Command(
        SampleConfig,
        "accel_gpt.generate:run_sample",
        "generate text from a checkpoint",
        "Continue a prompt with a run dir, checkpoint dir, or transformers GPT-2 folder / hub id. "
        "The same seed gives the same text.",
        one_process=True,
    ),
    "export": Command(
        ExportConfig,
        "accel_gpt.export:run_export",
        "write a transformers model folder (weights, tokenizer, model card); --push_to_hub uploads it",
        "Write a folder that transformers' from_pretrained loads offline as a GPT2LMHeadModel (or, for a "
        "nanochat-block model, a NanoChatForCausalLM), and AutoTokenizer.from_pretrained "
        "load offline, with a model card (README.md) of how the model was trained; --push_to_hub REPO_ID then "
        "uploads it to the Hugging Face Hub (models trained with the char tokenizer cannot be exported).",
        one_process=True,
    ),
    "compare": Command(
        CompareConfig,
        "accel_gpt.compare:run_compare",
        "runs side by side: val loss, bits per byte, steps, tokens, time, parameters and the settings that differ",
        "Print one row per run directory: the last val loss and val bits per byte (comparable across tokenizers), "
        "steps, tokens, the steps' own time, parameters, and every setting that is not the same in all of them. "
        "--plot draws their curves into one figure; --log appends them to a tab-separated experiment log.",
        one_process=True,
    ),
    "plot": Command(
        PlotConfig,
        "accel_gpt.plot:run_plot",
        "PNG of loss, val bits per byte, lr, HellaSwag and tokens/s over steps (runs overlaid)",
        "Draw train/val loss, val bits per byte, learning rate, HellaSwag accuracy and tokens/s over optimizer steps "
        "from each run's metrics.jsonl; several runs are overlaid, one colour per run, named by their directory. "
        "Needs matplotlib: pip install 'accel_gpt[plot]'.",
        one_process=True,
    ),
}
CONFIG_FLAGS = {"prepare": ("--config", "--preset")}  # prepare's presets were named with --preset first


def main(argv: list[str] | None = None) -> None:
    try:
        name, cfg = parse(sys.argv[1:] if argv is None else argv)  # on every rank: bad input is said once, all exit 2
        world = os.environ.get("WORLD_SIZE", "1")
        launched = int(world) if world.isdigit() else 1
        if COMMANDS[name].one_process and launched > 1:
            if not is_main_rank():
                return
            others = "the other process exits" if launched == 2 else f"the other {launched - 1} processes exit"
            print(f"note: {name} runs on rank 0 only; {others}", file=sys.stderr)
        module, function = COMMANDS[name].run.split(":")
        getattr(importlib.import_module(module), function)(cfg)
    except UserError as e:
        if is_main_rank() or isinstance(e, WindowError):  # every rank meets the same bad input: say it once
            close_progress_bars()
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # the reader of stdout went away (`sample ... | head -3`): stop as quietly as it did
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail again
        sys.exit(141)  # as a process that SIGPIPE ended: 128 + 13
    except OSError as e:  # a file that cannot be read or written, wherever it is met: named in one line
        close_progress_bars()
        print(f"error: {describe_os_error(e)}", file=sys.stderr)  # every rank that meets it: it may be its own file
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C where nothing handles it (start-up, eval, sample): no traceback
        close_progress_bars()
        if is_main_rank():
            print("interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)


# What to do about a file error, by errno (the rest: the system's own words and the file are enough).
OS_ERROR_HINTS = {
    errno.EACCES: "check the file's permissions and owner",
    errno.EPERM: "check the file's permissions and owner",
    errno.EROFS: "the filesystem is read-only: choose a writable folder",
    errno.ENOSPC: "the disk is full: free some space or choose another disk",
    errno.EDQUOT: "the disk quota is used up: free some space or choose another disk",
    errno.ENAMETOOLONG: "shorten the path (each name at most 255 bytes)",
    errno.EMFILE: "raise the limit with `ulimit -n`, or give fewer --num_workers",
    errno.ENFILE: "close some programs and try again",
    errno.EIO: "the disk or its filesystem failed to read or write: check it (dmesg) and try again",
    errno.EFBIG: "a file size limit: raise `ulimit -f` (ulimit -f unlimited), or the filesystem's largest file",
}


def describe_os_error(e: OSError) -> str:
    """An OSError as one line: what failed, on which file, and what to do (no traceback)."""
    what = e.strerror or str(e) or type(e).__name__
    files = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    hint = OS_ERROR_HINTS.get(e.errno)
    line = f"{what}: {files}" if files else what
    return f"{line} ({hint})" if hint else line


def close_progress_bars() -> None:
    """End any progress bar's line first, so that the error is a line of its own, not glued to the bar."""
    tqdm = sys.modules.get("tqdm")  # a command that drew no bar never imported it
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def parse(argv: list[str]) -> tuple[str, Config]:
    """(command, its resolved config) for `argv`, without running anything; argparse exits on --help."""
    name = next((a for a in argv if not a.startswith("-")), None)
    if name not in COMMANDS:
        build_parser().parse_args(argv)  # prints the usage error (or the top-level help) and exits
    command = COMMANDS[name]
    flags = CONFIG_FLAGS.get(name, ("--config",))
    known = [
        *flags,
        *(f"--{f.name}" for f in fields(command.config) if f.name != "config" and not f.metadata["positional"]),
    ]
    for arg in argv:  # before argparse, so a misspelt flag is named even when a required one is missing
        key = arg.split("=")[0]
        if key.startswith("--") and key not in (*known, "--help"):
            hint = did_you_mean(key[2:], [k[2:] for k in known], prefix="--")
            raise ConfigError(f"unknown {name} flag '{key}'{hint}")
    config = ",".join(_flag_values(argv, flags)) or _default_preset(name, argv)
    parser = build_parser(name, config_values(command.config, config))
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return name, command.config.load(config, given)


def _default_preset(name: str, argv: list[str]) -> str:
    """`prepare` given no text and no preset prepares the bundled tiny Shakespeare as its preset does: a first run
    needs no argument, and writes the folder that the `tiny-cpu` preset reads. `--help` shows the plain defaults."""
    given = {a.split("=")[0] for a in argv}
    return "tinyshakespeare" if name == "prepare" and not given & {"--dataset", "--merge", "--help", "-h"} else ""


def _flag_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """Every value given to `flags`, in order: `--config a --config b` layers b over a, as a later flag wins."""
    values = []
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in flags:
            values.append(value if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    return [value for value in values if value]


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in the product's form: one `error:` line, exit 2 (argparse prints its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser(only: str | None = None, defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; `only`'s flags show `defaults` (a preset's values) in their help."""
    parser = _Parser(
        prog="accel-gpt",
        description="GPT-2 pretraining with Hugging Face Accelerate: prepare -> train -> eval/sample/export/plot.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        positionals = [f.name.upper().removesuffix("S") for f in fields(command.config) if f.metadata["positional"]]
        config = "[--config FILE_OR_PRESET]" if preset_names(command.config) else "[--config FILE]"
        usage = " ".join(["%(prog)s", *(f"{p} [{p} ...]" for p in positionals), config])
        p = sub.add_parser(
            name,
            usage=usage + " [--FIELD VALUE ...]",
            help=command.help,
            description=command.description,
            epilog=_epilog(command.config),
            allow_abbrev=False,
        )
        _add_fields(p, command.config, CONFIG_FLAGS.get(name, ("--config",)), defaults if name == only else {})
    return parser


def _epilog(cls: type[Config]) -> str:
    names = preset_names(cls)
    if not names:
        return "--config takes a YAML file of the settings above."
    return f"presets: {', '.join(names)} (`--config NAME --help` shows a preset's values)"


def _add_fields(p: argparse.ArgumentParser, cls: type[Config], config_flags: tuple[str, ...], preset: dict) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        meta, kind = f.metadata, hints[f.name]
        if f.name == "config":
            metavar = "FILE_OR_PRESET" if preset_names(cls) else "FILE"  # eval, sample, export, plot: no presets
            p.add_argument(*config_flags, dest="config", metavar=metavar, help=meta["help"])
            continue
        default = preset.get(f.name, f.default if f.default is not MISSING else f.default_factory())
        if meta["positional"]:  # optional where the --config file gives it
            nargs, kwargs = ("*", {"default": argparse.SUPPRESS}) if f.name in preset else ("+", {})
            p.add_argument(f.name, nargs=nargs, metavar=f.name.upper().removesuffix("S"), help=meta["help"], **kwargs)
            continue
        required = meta["required"] and f.name not in preset
        shown = " (required)" if required else "" if default in ("", None) else f" (default: {default!r})"
        kwargs: dict[str, Any] = dict(help=(meta["help"] + shown).replace("%", "%%"), default=argparse.SUPPRESS)
        if kind is bool:
            kwargs.update(nargs="?", const="true", metavar="true|false")
        elif typing.get_origin(kind) is typing.Literal:
            words = [str(c).lower() if isinstance(c, bool) else c for c in typing.get_args(kind)]
            kwargs.update(metavar="|".join(w for w in words if w))
            if "true" in words:  # a switch with more states (compile: auto): a bare --compile still means true
                kwargs.update(nargs="?", const="true")
        else:
            kwargs.update(metavar=_metavar(kind))
        p.add_argument(f"--{f.name}", required=required, **kwargs)


def _metavar(kind: Any) -> str:
    text = str(kind)
    return "N" if "int" in text else "X" if "float" in text else "VALUE"
