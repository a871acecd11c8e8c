"""Ctrl-C at any moment of a command's start: exit 130 and no traceback.

A Ctrl-C in the first ~0.2 s of a command (while Python imports the CLI) printed a
traceback through cli/entry.py and the imports, ending in KeyboardInterrupt. Sleeping a
guessed time before the signal lands on a different import each run, and sometimes on
Python's own start-up: here the command's process sends itself SIGINT when it first imports
a given module (a ``sitecustomize`` the test puts on PYTHONPATH, no hook in tpupod), so each
start-up step is hit on purpose, every time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tpupod.pod.record import Pod

# Loaded by Python's site before the command runs; it drops its variables (and PYTHONPATH)
# at once, so the processes the command starts (a launcher, workers) are left alone.
SITECUSTOMIZE = """\
import os, signal, sys

_at = os.environ.pop("INTERRUPT_AT_IMPORT", None)
_log = os.environ.pop("IMPORTS_LOG", None)
os.environ.pop("PYTHONPATH", None)


class _Interrupter:
    def find_spec(self, name, path=None, target=None):
        if _log:
            with open(_log, "a") as out:
                out.write(name + "\\n")
        if name == _at:
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, _Interrupter())
"""

ENTRY = "tpupod.cli.entry"  # before it, the console script's own import: kept tiny


def tpupod_script() -> list[str]:
    """The console script a user runs (``python -m tpupod`` where it is not installed)."""
    script = Path(sys.executable).with_name("tpupod")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tpupod"]


def start(argv: list[str], hook: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*tpupod_script(), *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(hook), **env},
        check=False,
    )


def start_up_imports(argv: list[str], hook: Path) -> list[str]:
    """The modules the command imports after the console script called ``main``, in order
    (a run to its end, not interrupted)."""
    log = hook / "imports.log"
    start(argv, hook, IMPORTS_LOG=str(log))
    names = log.read_text().split()
    return names[names.index(ENTRY) + 1 :]


def spread(names: list[str], count: int) -> list[str]:
    """``count`` names spread evenly over ``names``, the first and the last among them."""
    step = max(1, (len(names) - 1) / max(1, count - 1))
    return list(dict.fromkeys(names[min(len(names) - 1, round(i * step))] for i in range(count)))


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["exec", "--", "sleep", "1"],
        ["run", "--", "sleep", "1"],
    ],
)
def test_ctrl_c_during_start_up_is_exit_130_without_a_traceback(
    command: list[str], make_pod: Callable[..., Pod], tmp_path: Path
) -> None:
    pod = make_pod(workers=2)
    argv = [command[0], "--pod", pod.name, *command[1:]]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    imports = start_up_imports(argv, hook)
    assert len(imports) > 3, imports
    for module in spread(imports, 6):
        ended = start(argv, hook, INTERRUPT_AT_IMPORT=module)
        assert "Traceback" not in ended.stderr, (module, ended.stderr)
        assert ended.returncode == 130, (module, ended.returncode, ended.stderr)
