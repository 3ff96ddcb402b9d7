"""The command line's help: complete for every command, and fast because it imports no heavy library.

Speed is checked through what `--help` imports (in a fresh interpreter), not by timing: torch alone
takes seconds to import, and wall-clock limits are flaky on a shared CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

from accel_gpt.cli import build_parser, main
from accel_gpt.config import field_names
from tests.conftest import python_cmd, run_cmd

COMMANDS = ("prepare", "train", "eval", "sample", "export", "plot")
# Any of these in sys.modules after `--help` means the help path pays for a heavy import.
HEAVY = ("torch", "accelerate", "transformers", "datasets", "tiktoken", "numpy", "matplotlib", "safetensors", "pyarrow")

IMPORTS_AFTER_HELP = f"""
import json, sys
from accel_gpt.cli import main
loaded = {{}}
for argv in [["--help"]] + [[c, "--help"] for c in {list(COMMANDS)!r}]:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
    loaded[" ".join(argv)] = sorted(m for m in {HEAVY!r} if m in sys.modules)
print(json.dumps(loaded))
"""


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def help_text(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_imports_no_heavy_library() -> None:
    proc = run_cmd([sys.executable, "-c", IMPORTS_AFTER_HELP], timeout=60)
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert set(loaded) == {"--help", *(f"{c} --help" for c in COMMANDS)}
    assert all(not mods for mods in loaded.values()), loaded


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
    assert set(subcommands()) == set(COMMANDS)
    assert "Accelerate" in out


def test_every_option_has_help() -> None:
    for name, sub in subcommands().items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest} has no help"


def test_train_help_lists_every_config_field(capsys: pytest.CaptureFixture) -> None:
    out = help_text(capsys, "train")
    missing = [name for name in field_names() if f"--{name} " not in out]
    assert not missing, f"train --help does not list: {missing}"
    assert "accelerate launch" in out


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
        (["plot", "runs/a", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
        (["sample"], "required: --checkpoint"),
    ],
)
def test_usage_errors_exit_2_with_usage(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: accel-gpt") and message in err
