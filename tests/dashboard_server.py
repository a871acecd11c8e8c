"""A real `tpupod dashboard` process for the dashboard tests, and a headless Chromium
(Debian's, driven by playwright through its executable path: nothing is downloaded)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_base_port, require, tpupod_argv

TOKEN = "test-dashboard-token"


@dataclass
class Dashboard:
    proc: subprocess.Popen[str]
    port: int
    interval: float
    token: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, **options: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **options)

    def post(self, path: str, **options: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=10, **options)


def start(
    *,
    interval: float = 1.0,
    token: str | None = TOKEN,
    extra: tuple[str, ...] = (),
    new_session: bool = False,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Dashboard:
    """Start the dashboard (the CLI, as a user would) and wait until it answers; with
    ``new_session``, as the leader of a process group of its own (a terminal's Ctrl-C
    reaches the whole group)."""
    port = port or free_base_port(1)
    argv = ["dashboard", "--port", str(port), "--interval", str(interval), *extra]
    if token:
        argv += ["--token", token]
    proc = subprocess.Popen(
        tpupod_argv(*argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
        env={**os.environ, **(env or {})},
    )
    board = Dashboard(proc, port, interval, token)
    deadline = time.monotonic() + 90  # two processes' imports on a loaded machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the dashboard ended: {proc.communicate()}")
        try:
            # answering, and the sampling process has read the run records once
            auth = {"Authorization": f"Bearer {token}"} if token else {}
            if board.get("/api/runs", headers=auth).json().get("state") not in (None, "loading"):
                return board
        except httpx.TransportError:
            time.sleep(0.1)
    stop(board)  # no leftover dashboard (and sampler) when it was only slow
    raise AssertionError("the dashboard did not answer within 90 s")


def start_run(pod: str, program: str, folder: Path) -> subprocess.Popen[bytes]:
    """`tpupod run` of ``program`` (written to ``folder``, which it gets as its argument)
    on every worker of ``pod``, as a user starts one; the caller ends it."""
    (folder / "prog.py").write_text(program)
    argv = ["run", "--pod", pod, "--", sys.executable, str(folder / "prog.py"), str(folder)]
    return subprocess.Popen(tpupod_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop(board: Dashboard) -> None:
    if board.proc.returncode is not None:  # a test ended it
        for pipe in (board.proc.stdout, board.proc.stderr):
            if pipe is not None:
                pipe.close()
        return
    board.proc.terminate()
    try:
        board.proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        board.proc.kill()
        board.proc.communicate()


@pytest.fixture(name="dashboard")
def dashboard_fixture(state_home: Any) -> Iterator[Any]:
    """``dashboard(interval=..., token=...)`` starts one; each is stopped afterwards."""
    started: list[Dashboard] = []

    def make(**options: Any) -> Dashboard:
        started.append(start(**options))
        return started[-1]

    yield make
    for board in started:
        stop(board)


@dataclass
class Browser:
    """A Chromium page that collects console errors and uncaught exceptions."""

    page: Any
    errors: list[str] = field(default_factory=list)


@pytest.fixture(name="browser")
def browser_fixture() -> Iterator[Callable[[], Browser]]:
    """``browser()`` opens the page (call it after making pods: playwright's sync API runs an
    event loop in this thread, so ``asyncio.run`` cannot be called while it is open)."""
    chromium = shutil.which("chromium")
    require(chromium is not None, "the browser tests need Debian's chromium (apt install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "the browser tests need playwright (pip install playwright)")
        raise
    with contextlib.ExitStack() as stack:

        def open_page() -> Browser:
            pw = stack.enter_context(sync_playwright())
            launched = pw.chromium.launch(
                executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"]
            )
            stack.callback(launched.close)
            page = launched.new_page(viewport={"width": 1440, "height": 900})
            seen = Browser(page)
            page.on("console", lambda m: seen.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen.errors.append(str(e)))
            return seen

        yield open_page
