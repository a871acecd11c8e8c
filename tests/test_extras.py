"""A command whose extra is not installed says so before any work, on the launcher and on
each worker: the extra's name and its pip line, exit 1, never an internal error.

The test venv holds every extra, so these tests hide packages from the processes they
start: a ``sitecustomize`` on PYTHONPATH puts a finder first on ``sys.meta_path`` that
refuses the named top-level packages, as a venv without them would. (scripts/newcomer.sh,
which CI runs, checks the same in a real venv made by ``make demo``.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, pod_processes, tpupod_argv
from tpupod.errors import MissingExtra
from tpupod.extras import EXTRAS, for_missing_module, missing, require, worker_argv

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "fixtures" / "qwen2-tiny"

BLOCKER = """\
import os, sys

_BLOCKED = set(os.environ["TPUPOD_TEST_HIDE"].split(","))


class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hidden())
"""


@pytest.fixture
def hiding(tmp_path: Path) -> Callable[..., dict[str, str]]:
    """The environment of a process that cannot import the named packages."""
    folder = tmp_path / "hide"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCKER)

    def env(*packages: str) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path, "TPUPOD_TEST_HIDE": ",".join(packages)}

    return env


def run(env: dict[str, str], *args: str, timeout: float = 60) -> CliResult:
    started = time.monotonic()
    proc = subprocess.run(
        tpupod_argv(*args), capture_output=True, text=True, timeout=timeout, env=env
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def said_missing(result: CliResult, command: str, extra: str) -> None:
    assert result.code == 1, result
    assert "internal error" not in result.err and "Traceback" not in result.err
    assert f"error: '{command}' needs the {extra} extra" in result.err, result.err
    assert f"hint: pip install 'tpupod[{extra}]'" in result.err


@pytest.mark.unit
def test_every_extra_of_pyproject_is_in_the_table() -> None:
    """The table names the extras users install by; `missing` finds them all here."""
    text = (REPO / "pyproject.toml").read_text()
    for extra in EXTRAS:
        assert f"\n{extra} = [" in text, extra
        if extra != "sgl":
            assert missing(extra) == [], extra  # the test venv has every extra but sgl's use


@pytest.mark.unit
def test_a_failed_import_names_its_extra() -> None:
    exc = ModuleNotFoundError("No module named 'aiohttp.web'", name="aiohttp.web")
    found = for_missing_module(exc, "'tpupod serve up'")
    assert isinstance(found, MissingExtra) and found.extra == "serve"
    assert str(found) == "'tpupod serve up' needs the serve extra (not installed: aiohttp.web)"
    pulled_in = ModuleNotFoundError("No module named 'psycopg'", name="psycopg")
    assert getattr(for_missing_module(pulled_in, "x"), "extra", None) == "jobs"
    assert for_missing_module(ModuleNotFoundError("no", name="nosuch"), "x") is None
    assert for_missing_module(ValueError("no"), "x") is None
    require("'tpupod jobs ls'", "jobs", "serve")  # installed here: nothing to say


@pytest.mark.local
@pytest.mark.parametrize(
    ("args", "command", "extra", "hidden"),
    [
        (["jobs", "ls"], "tpupod jobs ls", "jobs", "sqlalchemy"),
        (["jobs", "submit", "--", "echo", "hi"], "tpupod jobs submit", "jobs", "sqlalchemy"),
        (["jobs", "serve"], "tpupod jobs serve", "jobs", "fastapi"),
        (["dashboard", "--port", "0"], "tpupod dashboard", "dashboard", "fastapi"),
        (["fanout", "--prompt", "hi"], "tpupod fanout", "serve", "httpx"),
        (
            ["bench", "checkpoint", "-c", str(REPO / "examples" / "bench_checkpoint.yaml")],
            "tpupod bench checkpoint",
            "checkpoint-bench",
            "matplotlib",
        ),
    ],
)
def test_a_command_without_its_extra_says_which_at_once(
    state_home: Path,
    hiding: Callable[..., dict[str, str]],
    args: list[str],
    command: str,
    extra: str,
    hidden: str,
) -> None:
    result = run(hiding(hidden), *args)
    said_missing(result, command, extra)
    assert result.seconds < 10  # before any work (the benchmark took minutes, then failed)


@pytest.mark.local
def test_serve_up_without_the_serve_extra_starts_nothing(
    state_home: Path, hiding: Callable[..., dict[str, str]], make_pod: Callable[..., object]
) -> None:
    pod = make_pod(workers=2)
    name = pod.name  # type: ignore[attr-defined]
    result = run(hiding("aiohttp"), "serve", "up", "--pod", name, "--model", str(TINY))
    said_missing(result, "tpupod serve up", "serve")
    assert pod_processes(name) == []
    assert not (state_home / "pods" / name / "serve.json").exists()


@pytest.mark.local
def test_extract_without_the_model_extra_says_so_and_convert_arc_needs_none(
    state_home: Path, hiding: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "text": "hi"}\n')
    args = ["extract", "--model", str(TINY), "--data", str(data), "--out", str(tmp_path / "o")]
    said_missing(run(hiding("numpy"), *args, "--layers", "1"), "tpupod extract", "model")
    # convert-arc needs no model: it still works without the extra
    arc = run(
        hiding("numpy", "jax"),
        "extract",
        "convert-arc",
        str(REPO / "examples" / "arc_tasks.json"),
        str(tmp_path / "arc.jsonl"),
    )
    assert arc.code == 0, arc


@pytest.mark.local
def test_a_worker_process_checks_its_extras_before_it_runs(
    hiding: Callable[..., dict[str, str]],
) -> None:
    """What serve up, bench checkpoint and a replica start on each worker: the check runs
    there (an SSH host's Python may lack what the launcher has), then the module."""
    argv = worker_argv(sys.executable, "serve,model", "tpupod.serve.builtin", "--help")
    hidden = subprocess.run(argv, capture_output=True, text=True, env=hiding("safetensors"))
    assert hidden.returncode == 1
    assert hidden.stderr.splitlines() == [
        "error: 'tpupod serve' needs the model extra on this worker (not installed: safetensors)",
        "hint: pip install 'tpupod[model]'",
    ]
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "usage: python -m tpupod.serve.builtin" in shown.stdout


@pytest.mark.local
def test_serve_up_names_the_workers_whose_python_lacks_an_extra(
    state_home: Path,
    hiding: Callable[..., dict[str, str]],
    make_pod: Callable[..., object],
    tmp_path: Path,
) -> None:
    """The launcher has every extra; the workers' Python (--worker-python, as an SSH host's
    python3 would) lacks the model extra: serve up says so before it starts anything."""
    pod = make_pod(workers=2)
    name = pod.name  # type: ignore[attr-defined]
    env = hiding("safetensors")
    python = tmp_path / "python"
    python.write_text(
        f"#!/bin/sh\nPYTHONPATH={env['PYTHONPATH']} TPUPOD_TEST_HIDE=safetensors "
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    args = ["serve", "up", "--pod", name, "--model", str(TINY), "--worker-python", str(python)]
    result = run(dict(os.environ), *args)
    assert result.code == 1, result
    assert (
        "error: 'tpupod serve up' needs the model extra on w0, w1 (not installed: safetensors)"
        in result.err
    )
    assert "hint: pip install 'tpupod[model]'" in result.err
    assert [p for p in pod_processes(name) if "tpupod.serve" in " ".join(p.cmdline())] == []


@pytest.mark.local
def test_init_jax_on_a_worker_without_jax_says_which_extra(
    state_home: Path,
    hiding: Callable[..., dict[str, str]],
    make_pod: Callable[..., object],
    tmp_path: Path,
) -> None:
    """A program run on a pod whose workers' Python lacks jax: each worker said
    ModuleNotFoundError in a traceback from tpupod's own jaxinit.py (a new user's trial).
    It is the extra's two lines, on every worker, and the run's first failure names it."""
    pod = make_pod(workers=2)
    program = tmp_path / "prog.py"
    program.write_text("import tpupod\ntpupod.init_jax()\nprint('never')\n")
    result = run(hiding("jax"), "run", "--pod", pod.name, "--", sys.executable, str(program))  # type: ignore[attr-defined]
    assert result.code == 1, result
    assert "Traceback" not in result.err and "never" not in result.out, result.err
    # The first to fail says it; the other is stopped, its same two lines kept in its log.
    said = "] error: 'tpupod.init_jax()' needs the jax extra on this worker (not installed: jax)"
    assert said in result.err and "] hint: pip install 'tpupod[jax]'" in result.err, result.err
    first = re.findall(r"^(w\d) .* exit 1 .*hint: pip install 'tpupod\[jax\]'$", result.err, re.M)
    failed_first = re.search(r"^first failure: (w\d) ", result.err, re.M)
    assert failed_first and failed_first.group(1) in first, result.err
