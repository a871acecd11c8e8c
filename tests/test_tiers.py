"""The tiers and the slow marks (tests/conftest.py) select what they say they do."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SLOW

TESTS = Path(__file__).parent


def test_every_slow_entry_names_a_test_that_exists() -> None:
    """A renamed or removed test would leave a stale entry that marks nothing."""
    stale = []
    for entry in sorted(SLOW):
        module, name = entry.split("::")
        tree = ast.parse((TESTS / module).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        if name not in defined:
            stale.append(entry)
    assert not stale, f"SLOW names tests that do not exist: {stale}"


@pytest.mark.local
def test_not_slow_leaves_out_exactly_the_slow_tests() -> None:
    def collected(marks: str) -> set[str]:
        argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marks]
        proc = subprocess.run(
            [*argv, str(TESTS / "test_readme.py")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=TESTS.parent,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return {line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line}

    slow = {entry.split("::")[1] for entry in SLOW if entry.startswith("test_readme.py::")}
    assert slow and collected("slow") == slow
    quick = collected("local and not slow")
    assert quick and not quick & slow
