"""The manual in docs/: the configuration reference is generated from the config dataclasses, and the checked-in
page must be what the code generates today; every link between the pages reaches its page and heading."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import fields
from pathlib import Path

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


# ------------------------------------------------------------------------------------------ the manual's links

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped, spaces as -, and
    -1, -2, ... after repeats."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return found


def links(page: Path) -> list[str]:
    """The targets of a page's Markdown links, code blocks and inline code left out."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text(encoding="utf-8")))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: (not checked offline)
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target} (no such heading)")
    return broken


def test_every_link_of_the_manual_reaches_its_page_and_heading() -> None:
    assert sum(len(links(page)) for page in PAGES) > 30  # the pages link to each other
    for page in PAGES:
        assert not broken_links(page), f"{page.relative_to(REPO)}: {broken_links(page)}"


def test_the_link_check_finds_a_missing_page_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Two words: `code`\n\n[x](b.md) [y](#two-words-code) [z](#three)\n")
    assert anchors(tmp_path / "a.md") == {"a", "two-words-code"}
    assert broken_links(tmp_path / "a.md") == ["b.md (no such file)", "#three (no such heading)"]


def test_the_readme_is_a_front_page_with_a_map_of_every_page() -> None:
    """At most about 250 lines, linking every page of docs/; each page opens with what its reader can do."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= 250
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, f"the README's map does not name docs/{page.name}"
        if page.name != "config.md":  # the generated reference says what it is in its own first lines
            opening = page.read_text(encoding="utf-8").split("\n\n")[1]
            assert opening.startswith("After this page you "), page.name
