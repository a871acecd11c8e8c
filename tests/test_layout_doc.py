"""docs/ARCHITECTURE.md is the map a newcomer starts from: its layout names every module of
the package (a subpackage's ``__init__.py`` and ``__main__.py`` aside, which the folder's
own line stands for), and everything it names exists; it stays short enough to read in ten
minutes, with no benchmark figures (those live in BENCHMARKS.md, beside the command that
measured them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
LINE_BUDGET = 400
# a measured figure: a number with a unit of time, throughput or size per second, a ratio
# ("4x", "x faster") or a percentage; not a name with digits in it (k8s, v5e)
FIGURE = re.compile(
    r"(?<![\w.])\d(?:[\d.,]*\d)?\s*(?:ms|µs|us|s|seconds?|minutes?|min|[KMG]i?B/s|tok/s"
    r"|tokens/s|req/s|runs/s|/s|x|%)(?!\w)|\bx (?:faster|slower)\b"
)
# a folder (``name/``) or a file with one of these extensions, first on its line
NAME = re.compile(r"^( *)([\w./-]+/|[\w./-]+\.(?:py|sh|yaml|json|md|toml))(?:\s|$)")

pytestmark = pytest.mark.unit


def layout_paths() -> set[str]:
    """The paths the layout block names, folders joined by indentation."""
    text = MAP.read_text()
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
        if path.name not in ("__init__.py", "__main__.py") or path.parent == package
    }
    assert sorted(modules - named) == [], "add a line for each to docs/ARCHITECTURE.md's layout"


def test_what_the_layout_names_exists() -> None:
    missing = sorted(path for path in layout_paths() if not (ROOT / path).exists())
    assert missing == [], "docs/ARCHITECTURE.md's layout names files that are not there"


def figures(text: str) -> list[str]:
    return [line for line in text.splitlines() if FIGURE.search(line)]


def test_the_map_is_short_and_holds_no_figures() -> None:
    text = MAP.read_text()
    assert len(text.splitlines()) <= LINE_BUDGET, "move long notes to docs/<topic>.md"
    assert figures(text) == [], "figures live in BENCHMARKS.md; link there instead"


def test_every_design_note_is_linked_from_the_map_and_every_link_resolves() -> None:
    links = set(re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", MAP.read_text()))
    assert sorted(link for link in links if not (MAP.parent / link).is_file()) == []
    notes = {p.name for p in MAP.parent.glob("*.md")} - {MAP.name}
    assert sorted(notes - links) == [], "link each docs/<topic>.md from the map's Design notes"


def test_the_figure_check_sees_a_figure() -> None:
    seen = [
        "a run ends 0.17 s after a worker fails",
        "it took 92-99 ms here",
        "1,000 small files move 4-10x faster",
        "2,400 tok/s",
        "a quarter less: 25% of the time",
        "the tar stream is 3 x faster",
    ]
    assert figures("\n".join(seen)) == seen
    assert figures("k8s.py, v5e-16, 4 chips per worker, 128+N for signal N, exit 2") == []
