"""No import circles among tpupod's modules: a module's imports, wherever they are (at its
top level, under ``if TYPE_CHECKING:``, inside functions: a deferred import is still a
dependency, as a reader and a drawing of the layers see it), never lead back to it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

pytestmark = pytest.mark.unit


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports at its top level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:  # `from pkg import mod` names the module itself
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return (found & modules) - {name}


def circles(src: Path, package: str) -> list[list[str]]:
    """Every group of modules that import each other round (Tarjan's strongly connected
    components of more than one module), each sorted."""
    paths = {module_name(p, src): p for p in (src / package).rglob("*.py")}
    graph = {name: imports(name, path, set(paths)) for name, path in paths.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return sorted(found)


def test_no_module_imports_itself_round_a_circle() -> None:
    assert circles(SRC, "tpupod") == []


def test_the_check_sees_a_circle_through_a_type_hint_and_a_deferred_import(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.results import R\n"
    )
    (pkg / "results.py").write_text("from pkg.errors import E\n")
    (pkg / "late.py").write_text("def f():\n    from pkg import lazy\n")
    (pkg / "lazy.py").write_text("from . import late\n")
    assert circles(tmp_path, "pkg") == [["pkg.errors", "pkg.results"], ["pkg.late", "pkg.lazy"]]
