"""The command line: one mechanism for every command, generated from its config dataclass.

Every field of every command's dataclass is a flag with its one-line help; `--config NAME --help` shows
that preset's values as the defaults; a misspelt flag or preset is one line naming the close matches.
`--help` is fast because it imports no heavy library: checked through what it imports (in a fresh
interpreter), not by timing, since torch alone takes seconds to import and wall-clock limits are flaky
on a shared CPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from accel_gpt.cli import COMMANDS as CLI_COMMANDS
from accel_gpt.cli import build_parser, main, parse
from accel_gpt.config import coerce, preset_names, presets_dir
from tests.conftest import python_cmd, run_cmd

COMMANDS = ("prepare", "train", "eval", "sample", "export", "compare", "plot")
PRESETS = [(name, preset) for name in COMMANDS for preset in preset_names(CLI_COMMANDS[name].config)]
# Any of these in sys.modules after `--help` means the help path pays for a heavy import.
HEAVY = ("torch", "accelerate", "transformers", "datasets", "tiktoken", "numpy", "matplotlib", "safetensors", "pyarrow")
HELP_ARGVS = [["--help"]] + [[c, "--help"] for c in COMMANDS] + [[c, "--config", p, "--help"] for c, p in PRESETS]

IMPORTS_AFTER_HELP = f"""
import json, sys
from accel_gpt.cli import main
loaded = {{}}
for argv in {HELP_ARGVS!r}:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
    loaded[" ".join(argv)] = sorted(m for m in {HEAVY!r} if m in sys.modules)
print(json.dumps(loaded))
"""


@pytest.fixture(autouse=True)
def wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse wraps help to the terminal width and breaks long words (URLs): one line per option instead."""
    monkeypatch.setenv("COLUMNS", "1000")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def help_text(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def help_entries(out: str) -> dict[str, str]:
    """`--flag` (or a positional's metavar) -> its help text, from argparse's option listing."""
    entries: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        if re.match(r"^  \S", line):  # an option or positional starts at column 2
            invocation, _, text = line.strip().partition("  ")
            current = invocation.split(",")[0].split()[0]
            entries[current] = text.strip()
        elif current and re.match(r"^\s{3,}\S", line):  # its help, continued or on the next line
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def shown_default(entry: str) -> Any:
    match = re.search(r"\(default: (.*)\)$", entry)
    assert match, f"no default shown in {entry!r}"
    return ast.literal_eval(match.group(1))


def one_line_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err  # no usage dump, no traceback
    return err


@pytest.mark.slow
def test_help_imports_no_heavy_library() -> None:
    """Every command's `--help`, with and without a preset, in one fresh interpreter."""
    proc = run_cmd([sys.executable, "-c", IMPORTS_AFTER_HELP], timeout=60)
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert set(loaded) == {" ".join(argv) for argv in HELP_ARGVS}
    assert {f"{c} --help" for c in COMMANDS} <= set(loaded)
    assert {"train --config tiny-cpu --help", "prepare --config tinyshakespeare --help"} <= set(loaded)
    assert all(not mods for mods in loaded.values()), loaded


@pytest.mark.slow
def test_entry_points_answer_help() -> None:
    """`python run.py --help` and the installed `accel-gpt` console script both list every command."""
    commands = [python_cmd("--help")]
    script = shutil.which("accel-gpt", path=str(Path(sys.executable).parent))
    if script:  # installed by `pip install -e .`; absent only when the package is used uninstalled
        commands.append([script, "--help"])
    for argv in commands:
        out = run_cmd(argv, timeout=60).stdout
        assert "usage: accel-gpt" in out
        assert all(c in out for c in COMMANDS), out


def test_top_level_help_describes_every_command(capsys: pytest.CaptureFixture) -> None:
    out = help_text(capsys)
    for name in subcommands():
        assert name in out
    assert set(subcommands()) == set(COMMANDS) == set(CLI_COMMANDS)
    assert "Accelerate" in out


def test_every_option_has_help() -> None:
    for name, sub in subcommands().items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_every_config_field(command: str, capsys: pytest.CaptureFixture) -> None:
    """The dataclass is the only list of settings: each field is a flag whose help is its one-line `option` help."""
    entries = help_entries(help_text(capsys, command))
    cls = CLI_COMMANDS[command].config
    listed = []
    for f in fields(cls):
        key = f.name.upper().removesuffix("S") if f.metadata["positional"] else f"--{f.name}"
        assert key in entries, f"{command} --help does not list {key}"
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], f"{command} {key}: no one-line help"
        assert entries[key].startswith(f.metadata["help"]), (key, entries[key])
        listed.append(key)
    assert sorted(entries) == sorted([*listed, "-h"]), "a flag that is not a field of the dataclass"


def test_train_help_names_the_launcher(capsys: pytest.CaptureFixture) -> None:
    assert "accelerate launch" in help_text(capsys, "train")


@pytest.mark.parametrize(("command", "preset"), PRESETS, ids=[f"{c}-{p}" for c, p in PRESETS])
def test_config_help_shows_the_presets_values(command: str, preset: str, capsys: pytest.CaptureFixture) -> None:
    """`--config NAME --help` is how to read a preset: every value it sets is the default shown for that flag."""
    cls = CLI_COMMANDS[command].config
    values = yaml.safe_load((presets_dir(cls) / f"{preset}.yaml").read_text())
    entries = help_entries(help_text(capsys, command, "--config", preset))
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        expected = coerce(key, value, hints[key])  # as the command will see it: 3.0e-3 and 0.003 are one value
        assert shown_default(entries[f"--{key}"]) == expected, (key, entries[f"--{key}"])


def test_preset_defaults_named_examples(capsys: pytest.CaptureFixture) -> None:
    assert shown_default(help_entries(help_text(capsys, "train"))["--n_layer"]) == 12
    assert shown_default(help_entries(help_text(capsys, "train", "--config", "tiny-cpu"))["--n_layer"]) == 2
    assert shown_default(help_entries(help_text(capsys, "prepare"))["--val_tokens"]) == 0
    tiny = help_entries(help_text(capsys, "prepare", "--preset", "tinyshakespeare"))
    assert shown_default(tiny["--val_tokens"]) == 29_000 and shown_default(tiny["--tokenizer"]) == "bpe"
    assert (
        shown_default(help_entries(help_text(capsys, "prepare", "--preset=shakespeare-char"))["--tokenizer"]) == "char"
    )


def test_every_command_takes_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--config FILE` is not train's alone: a YAML file may give a required setting, and flags still win."""
    sample_yaml = tmp_path / "sample.yaml"
    sample_yaml.write_text("checkpoint: runs/a\ntemperature: 0\ntop_k: 5\n")
    name, cfg = parse(["sample", "--config", str(sample_yaml), "--top_k", "9"])
    assert name == "sample" and (cfg.checkpoint, cfg.temperature, cfg.top_k) == ("runs/a", 0.0, 9)
    eval_yaml = tmp_path / "eval.yaml"
    eval_yaml.write_text("checkpoint: runs/a\nhellaswag: h.jsonl\nlimt: 3\n")
    err = one_line_error(capsys, ["eval", "--config", str(eval_yaml)])
    assert err == f"error: unknown eval setting 'limt' in {eval_yaml}; did you mean limit?"


def test_config_given_twice_layers_the_second_over_the_first(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--config tiny-cpu --config mine.yaml` is the preset with mine.yaml's settings over it (as a later flag wins),
    not the preset alone; `--help` shows the layered values, and a comma-joined --config means the same."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"out_dir: {tmp_path / 'run_b'}\nmax_steps: 2\nlearning_rate: 0.002\n")
    _, alone = parse(["train", "--config", "tiny-cpu"])
    _, both = parse(["train", "--config", "tiny-cpu", "--config", str(mine), "--max_steps", "3"])
    assert (both.out_dir, both.max_steps, both.learning_rate) == (str(tmp_path / "run_b"), 3, 0.002)
    assert (both.n_layer, both.data_dir) == (alone.n_layer, alone.data_dir)  # the preset's, where mine is silent
    assert both.config == f"tiny-cpu,{mine}"
    _, again = parse(["train", f"--config=tiny-cpu,{mine}"])
    assert (again.out_dir, again.max_steps) == (str(tmp_path / "run_b"), 2)
    _, reversed_ = parse(["train", "--config", str(mine), "--config", "tiny-cpu"])
    assert reversed_.out_dir == alone.out_dir and reversed_.learning_rate == alone.learning_rate
    assert (
        shown_default(
            help_entries(help_text(capsys, "train", "--config", "tiny-cpu", "--config", str(mine)))["--max_steps"]
        )
        == 2
    )
    err = one_line_error(capsys, ["train", "--config", "tiny-cpu", "--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in err and "neither a YAML file nor a train preset" in err


def test_plot_help_names_its_inputs_and_extra(capsys: pytest.CaptureFixture) -> None:
    out = help_text(capsys, "plot")
    assert "RUN_DIR [RUN_DIR ...]" in out
    assert "--out" in out and "accel_gpt[plot]" in out


def test_prepare_help_names_presets_and_internet(capsys: pytest.CaptureFixture) -> None:
    out = " ".join(help_text(capsys, "prepare").split())  # argparse wraps lines
    for preset in ("tinyshakespeare", "fineweb-edu-10B"):
        assert preset in out
    assert "internet" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: COMMAND"),
        (["fly"], "invalid choice: 'fly'"),
        (["sample"], "required: --checkpoint"),
        (["export", "--checkpoint", "c"], "required: --out_dir"),
        (["plot"], "required: RUN_DIR"),
    ],
)
def test_usage_errors_exit_2_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    """argparse's own errors take the product's form: one `error:` line naming the --help to read (no usage)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line and line.endswith(" --help`)"), line


# (argv, the misspelt flag, the flag meant): the message lists the close matches, the meant one among them
MISSPELT_FLAGS = [
    (["train", "--data_dir", "d", "--learnin_rate", "1"], "--learnin_rate", "--learning_rate"),
    (["prepare", "--dataset", "x", "--shard_sise", "9"], "--shard_sise", "--shard_size"),
    (["sample", "--checkpoint", "c", "--tempreature", "0"], "--tempreature", "--temperature"),
    (["eval", "--checkpoint", "c", "--hellaswag", "h", "--limt", "3"], "--limt", "--limit"),
    (["export", "--checkpoint", "c", "--out_dri", "o"], "--out_dri", "--out_dir"),
    (["plot", "runs/a", "--ot", "x.png"], "--ot", "--out"),
    (["train", "--data_dir", "d", "--warmup_step=3"], "--warmup_step", "--warmup_steps"),
    (["sample", "--tempreature", "0"], "--tempreature", "--temperature"),  # named before the missing --checkpoint
]


@pytest.mark.parametrize(("argv", "bad", "meant"), MISSPELT_FLAGS, ids=[" ".join(a) for a, *_ in MISSPELT_FLAGS])
def test_misspelt_flag_is_one_line_naming_the_close_ones(argv: list[str], bad: str, meant: str, capsys) -> None:
    """The same one-line error for every command (argparse's own would be a usage dump)."""
    err = one_line_error(capsys, argv)
    prefix = f"error: unknown {argv[0]} flag '{bad}'; did you mean "
    assert err.startswith(prefix) and err.endswith("?"), err
    assert meant in err.removeprefix(prefix).removesuffix("?").split(", "), err


def test_unknown_flag_with_no_close_match_lists_the_known_ones(capsys: pytest.CaptureFixture) -> None:
    """Was argparse's "unrecognized arguments: --bogus 1" for every command but train: now one line like train's."""
    err = one_line_error(capsys, ["plot", "runs/a", "--bogus", "1"])
    assert err.startswith("error: unknown plot flag '--bogus'; ") and "--out" in err, err


def test_misspelt_preset_is_one_line_naming_the_close_ones(capsys: pytest.CaptureFixture) -> None:
    err = one_line_error(capsys, ["train", "--config", "tiny-cpuu", "--data_dir", "d"])
    assert "'tiny-cpuu' is neither a YAML file nor a train preset; did you mean tiny-cpu?" in err
    err = one_line_error(capsys, ["prepare", "--preset", "tinyshakespear"])
    assert "nor a prepare preset; did you mean tinyshakespeare" in err
    err = one_line_error(capsys, ["train", "--config", "tiny-cpuu", "--help"])  # not a help with wrong defaults
    assert "did you mean tiny-cpu?" in err
