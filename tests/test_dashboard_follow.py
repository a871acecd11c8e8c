"""A running run's log follow (``/api/runs/ID/follow``) against a real dashboard process and
a real `tpupod run`: a viewer who leaves stops its follow; many who came and went leave
nothing behind that holds up the next viewer or the dashboard's exit."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.dashboard_server import Dashboard, dashboard_fixture, start_run  # noqa: F401 (a fixture)
from tpupod.pod.record import Pod

pytestmark = pytest.mark.timeout(240)

PROGRAM = """\
import pathlib, sys, time
d = pathlib.Path(sys.argv[1])
print("up", flush=True)
while not (d / "go").exists():
    time.sleep(0.02)
print("saw go", flush=True)
time.sleep(120)
"""
# more than the threads of asyncio's default executor on any machine (min(32, cores + 4)):
# each follow that outlived its viewer held one, and the next viewer's waited for a free one
VIEWERS = 34


def first_line(board: Dashboard, launch_id: str) -> str:
    """Open the run's follow, read its first batch with a log line, and leave (close the
    stream)."""
    url = f"{board.url}/api/runs/{launch_id}/follow"
    with httpx.stream("GET", url, timeout=30) as stream:
        for line in stream.iter_lines():
            if line.startswith('data: {"lines": [['):
                return line
    raise AssertionError("the follow ended without a line")


def test_viewers_who_left_hold_up_neither_the_next_viewer_nor_the_exit(
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    tmp_path: Path,
) -> None:
    pod = make_pod(2)
    run = start_run(pod.name, PROGRAM, tmp_path)
    try:
        board = dashboard(interval=1.0)
        deadline = time.monotonic() + 60
        while not (found := board.get("/api/runs").json()["data"]["runs"]):
            assert time.monotonic() < deadline, "the run never showed"
            time.sleep(0.2)
        launch_id = found[0]["id"]
        for _ in range(VIEWERS):
            assert ', "up"]' in first_line(board, launch_id)
        # one more viewer: its backlog at once, and a new line within the second
        url = f"{board.url}/api/runs/{launch_id}/follow"
        with httpx.stream("GET", url, timeout=httpx.Timeout(10, read=10)) as stream:
            lines = stream.iter_lines()
            assert any(', "up"]' in line for line in _until(lines, '"up"')), "no backlog"
            (tmp_path / "go").touch()
            said = time.monotonic()
            assert any(', "saw go"]' in line for line in _until(lines, "saw go"))
            assert time.monotonic() - said <= 1.0 + 0.5  # the 1 s, a half for load
        board.proc.terminate()
        try:  # a follow still polling in a thread kept the process from ending
            board.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            raise AssertionError("the dashboard did not end within 20 s of SIGTERM") from None
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()


def _until(lines: Iterator[str], text: str) -> list[str]:
    """The stream's lines up to the first that holds ``text``."""
    seen = []
    for line in lines:
        seen.append(line)
        if text in line:
            break
    return seen
