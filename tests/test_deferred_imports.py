"""Every import inside a function in src/tpupod says why it is not at the top of its module.

An import inside a function is deferred for a reason: the CLI's start-up (a fast path, or
a command that loads only what it uses), an optional extra imported where it is used, or
a worker process that should not pay for it. Each one says which, in one of two ways:

- a comment on the import's line (its first line) or on the line just above it; a
  ``# type: ignore[...]`` or ``# noqa`` pragma alone says nothing;
- a paragraph of its module's docstring starting ``Deferred imports:``, where every deferred
  import of the module shares one reason (for ``cli/``, the package's docstring, in
  ``cli/__init__.py``, covers every module under it).

An import without a reason belongs at the top of its module (tests/test_import_circles.py
checks that no import, deferred or not, closes a circle).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tpupod"
PARAGRAPH = "Deferred imports:"
# the packages whose __init__.py docstring may state the reason for every module under them
PACKAGE_WIDE = ("cli",)
PRAGMA = re.compile(r"#\s*(type:\s*ignore(\[[^\]]*\])?|noqa(:\s*[A-Z0-9, ]+)?)\s*")

pytestmark = pytest.mark.unit


def says_deferred(docstring: str | None) -> bool:
    """Whether a docstring has a paragraph that starts with ``Deferred imports:``."""
    lines = (docstring or "").splitlines()
    return any(
        line.strip().startswith(PARAGRAPH) and (i == 0 or not lines[i - 1].strip())
        for i, line in enumerate(lines)
    )


def has_comment(line: str) -> bool:
    """Whether ``line`` carries a comment of words, not only a type checker's pragma."""
    if "#" not in line:
        return False
    comment = PRAGMA.sub("", line[line.index("#") :])
    return bool(comment.strip().lstrip("#").strip())


def deferred_imports(path: Path) -> list[int]:
    """The first line of every import inside a function of ``path``."""
    tree = ast.parse(path.read_text())
    return sorted(
        {
            node.lineno
            for func in ast.walk(tree)
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(func)
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
    )


def unexplained(path: Path, root: Path) -> list[str]:
    """``path:line`` for each deferred import of ``path`` that says no why."""
    text = path.read_text()
    if says_deferred(ast.get_docstring(ast.parse(text))):
        return []
    top = path.relative_to(root).parts[0]
    package = root / top / "__init__.py"
    if top in PACKAGE_WIDE and says_deferred(ast.get_docstring(ast.parse(package.read_text()))):
        return []
    lines = text.splitlines()
    return [
        f"{path.relative_to(root)}:{number}"
        for number in deferred_imports(path)
        if not has_comment(lines[number - 1])
        and not (number > 1 and lines[number - 2].strip().startswith("#"))
    ]


def test_every_deferred_import_says_why() -> None:
    found = [where for path in sorted(SRC.rglob("*.py")) for where in unexplained(path, SRC)]
    assert found == [], (
        "an import inside a function says why (a comment, or a 'Deferred imports:' paragraph "
        f"in its module's docstring), or moves to the top of its module: {found}"
    )


def test_the_check_sees_an_unexplained_import_and_each_way_to_explain_one(
    tmp_path: Path,
) -> None:
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text('"""The CLI."""\n')
    body = (
        "def bare():\n    import shutil\n\n"
        "def pragma():\n    import grpc  # type: ignore[import-untyped]\n\n"
        "def commented():\n    import json  # the worker's only\n\n"
        "def above():\n    # an optional extra\n    from jax import numpy\n\n"
        "async def nested():\n    def inner():\n        import time\n"
    )
    plain = tmp_path / "plain.py"
    plain.write_text(body)
    assert unexplained(plain, tmp_path) == ["plain.py:2", "plain.py:5", "plain.py:16"]
    (tmp_path / "cli" / "cmd.py").write_text(body)
    assert unexplained(tmp_path / "cli" / "cmd.py", tmp_path) == [
        "cli/cmd.py:2",
        "cli/cmd.py:5",
        "cli/cmd.py:16",
    ]
    documented = tmp_path / "documented.py"
    documented.write_text('"""A module.\n\nDeferred imports: start-up time.\n"""\n' + body)
    assert unexplained(documented, tmp_path) == []
    mentioned = tmp_path / "mentioned.py"  # a paragraph starts with it, not a mention
    mentioned.write_text('"""A module; see Deferred imports: elsewhere."""\n' + body)
    assert len(unexplained(mentioned, tmp_path)) == 3
    (tmp_path / "cli" / "__init__.py").write_text('"""The CLI.\n\nDeferred imports: start."""\n')
    assert unexplained(tmp_path / "cli" / "cmd.py", tmp_path) == []
    assert len(unexplained(plain, tmp_path)) == 3  # the package's paragraph covers cli/ only
