"""docs/ARCHITECTURE.md's layout is the map a newcomer starts from: it names every module of
the package (a subpackage's ``__init__.py`` aside, which the folder's own line stands for),
and everything it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a folder (``name/``) or a file with one of these extensions, first on its line
NAME = re.compile(r"^( *)([\w./-]+/|[\w./-]+\.(?:py|sh|yaml|json|md|toml))(?:\s|$)")

pytestmark = pytest.mark.unit


def layout_paths() -> set[str]:
    """The paths the layout block names, folders joined by indentation."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    folders: list[tuple[int, str]] = []
    named = set()
    for line in block.splitlines():
        found = NAME.match(line)
        if found is None:
            continue  # a description carried onto the next line
        indent, name = len(found.group(1)), found.group(2)
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = "".join(folder for _, folder in folders) + name
        if name.endswith("/"):
            folders.append((indent, name))
        named.add(path.rstrip("/"))
    return named


def test_the_layout_names_every_module() -> None:
    named = layout_paths()
    package = ROOT / "src" / "tpupod"
    modules = {
        str(path.relative_to(ROOT))
        for path in package.rglob("*.py")
        if path.name != "__init__.py" or path.parent == package
    }
    assert sorted(modules - named) == [], "add a line for each to docs/ARCHITECTURE.md's layout"


def test_what_the_layout_names_exists() -> None:
    missing = sorted(path for path in layout_paths() if not (ROOT / path).exists())
    assert missing == [], "docs/ARCHITECTURE.md's layout names files that are not there"
