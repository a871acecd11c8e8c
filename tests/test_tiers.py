"""The tiers and the slow marks (tests/conftest.py) select what they say they do."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LOCAL_TESTS, SLOW

TESTS = Path(__file__).parent


def test_every_entry_names_a_test_that_exists() -> None:
    """A renamed or removed test would leave a stale entry that marks nothing."""
    stale = []
    for entry in sorted(SLOW | LOCAL_TESTS):
        module, name = entry.split("::")
        tree = ast.parse((TESTS / module).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        if name not in defined:
            stale.append(entry)
    assert not stale, f"SLOW or LOCAL_TESTS name tests that do not exist: {stale}"


# a module whose slow tests no fixture shows as end-to-end, and one whose tests say "local"
MODULES = ("test_extract.py", "test_readme.py")


def collected(marks: str) -> set[str]:
    """The tests of MODULES that ``pytest -m MARKS`` selects (module::function)."""
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marks]
    proc = subprocess.run(
        [*argv, *(str(TESTS / module) for module in MODULES)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=TESTS.parent,
    )
    assert proc.returncode in (0, 5), proc.stdout[-2000:] + proc.stderr[-2000:]  # 5: none
    return {line.split("/")[-1].split("[")[0] for line in proc.stdout.splitlines() if "::" in line}


@pytest.mark.local
@pytest.mark.timeout(180)  # two collections of modules that import JAX
def test_slow_tests_are_marked_and_never_unit() -> None:
    """``-m slow`` selects SLOW's tests (so ``not slow`` leaves them out); none is in the
    unit tier, which make test-fast runs."""
    slow = {entry for entry in SLOW if entry.split("::")[0] in MODULES}
    assert collected("slow") == slow
    assert collected("unit and slow") == set()
