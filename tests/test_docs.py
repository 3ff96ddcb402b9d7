"""The manual in docs/: the configuration reference is generated from the config dataclasses, and the checked-in
page must be what the code generates today."""

from __future__ import annotations

from dataclasses import fields

from conftest import REPO

from accel_gpt.cli import COMMANDS
from accel_gpt.configdoc import render


def test_the_config_reference_is_what_the_code_generates() -> None:
    page = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert page == render(), "docs/config.md is stale: run `python -m accel_gpt.configdoc > docs/config.md`"


def test_the_reference_has_every_setting_of_every_command_with_its_help() -> None:
    page = render()
    for name, command in COMMANDS.items():
        section = page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        for f in fields(command.config):
            assert f"| `{f.name}`" in section and f.metadata["help"].replace("|", "\\|") in section, (name, f.name)
    assert "| `learning_rate` | `0.0006` |" in page and "`tiny-cpu` (`0.003`)" in page
