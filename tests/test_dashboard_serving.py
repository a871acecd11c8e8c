"""The dashboard's serving page in a real browser, against a real fleet (agents, router and
the stub OpenAI servers of the fleet's tests) under a load generator of a fixed rate."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import CliResult, free_base_port
from tests.dashboard_server import (  # noqa: F401 (fixtures)
    TOKEN,
    Browser,
    Dashboard,
    browser_fixture,
    dashboard_fixture,
)
from tests.test_serve_fleet import STUB_COMMAND, stub_pid

# a real browser and a real dashboard process: generous under load, bounded
pytestmark = pytest.mark.timeout(180)

RATE = 20.0  # requests/s the generator sends
NONE = "\N{EN DASH}"  # what a cell shows without a value


class Load:
    """Open-loop load: a request every 1/RATE s (late ones go at once), counted as sent."""

    def __init__(self, base_url: str, token: str) -> None:
        self.sent = 0
        self.failed = 0
        self.started = time.monotonic()
        self.stop = threading.Event()
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
        auth = {"Authorization": f"Bearer {token}"}

        def run() -> None:
            with httpx.Client(headers=auth, timeout=10) as http:
                while not self.stop.is_set():
                    due = self.started + self.sent / RATE
                    time.sleep(max(0.0, due - time.monotonic()))
                    self.sent += 1
                    try:
                        http.post(f"{base_url}/chat/completions", json={**body, "max_tokens": 2})
                    except httpx.HTTPError:
                        self.failed += 1

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def rate(self) -> float:
        return self.sent / (time.monotonic() - self.started)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=15)


@pytest.fixture
def stub_fleet(cli: Callable[..., CliResult], state_home: Path) -> Iterator[tuple[str, str]]:
    """A local pod of one worker serving two stub servers; (base URL, token)."""
    pod = f"dsv{os.getpid()}"
    assert cli("up", "--name", pod, "--local", "1").code == 0
    try:
        up = cli(
            "serve", "up", "--pod", pod, "--model", "stub-model", "--backend", "command",
            "--command", STUB_COMMAND, "--servers-per-worker", "2",
            "--base-port", str(free_base_port()), "--health-interval", "0.5",
            "--restart-backoff", "0.2", "--startup-timeout", "60", timeout=120,
        )  # fmt: skip
        assert up.code == 0, up.err
        exports = cli("serve", "endpoint", "--pod", pod).out.splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        yield values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"]
    finally:
        cli("serve", "down", "--pod", pod, timeout=60)
        cli("down", "--pod", pod, timeout=60)


def page_rate(seen: Browser) -> float:
    cells = seen.page.locator("table.backends td.rps").all_inner_texts()
    return sum(float(c) for c in cells if c not in (NONE, ""))


def test_a_rate_is_timed_by_when_the_router_read_its_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rate's clock was the end of the fleet's whole status, which waits on every
    agent: on a loaded machine that moved by seconds from one round to the next and put
    the rate 10-30 % off (a clean clone's CI: 26.0 shown for 20 sent). It is the moment
    the router read its counts (its /backends says when)."""
    from tpupod.dashboard import serving as dashboard_serving
    from tpupod.serve.backends import Backend
    from tpupod.serve.fleet.record import FleetRecord, ServerRecord
    from tpupod.serve.fleet.status import fleet_status

    record = FleetRecord(
        pod="p", model="m", backend=Backend.COMMAND, python="python3",
        servers=[ServerRecord(worker=0, host="127.0.0.1", port=9, name="s0")],
        router_host="127.0.0.1", router_port=8, token="t", started=0.0,
    )  # fmt: skip
    # the router read 0 then 20 requests a second apart; each status took 1 s to 4 s more
    rounds = iter([(0, 1000.0, 1.0), (20, 1001.0, 4.0)])

    class Fleet:
        def __init__(self, *args: object) -> None:
            pass

        def record(self) -> FleetRecord:
            return record

        def status(self) -> object:
            count, at, took = next(rounds)
            time.sleep(took / 100)  # the status's own time, scaled down
            health = {"127.0.0.1:9": {"state": "up", "requests": count}}
            router = {"backends": ["127.0.0.1:9"], "health": health, "at": at}
            return fleet_status(record, [{"servers": []}], router)

    class State:
        def names(self) -> list[str]:
            return ["p"]

        def load(self, name: str) -> None:
            return None

    monkeypatch.setattr(dashboard_serving, "Fleet", Fleet)
    watcher = dashboard_serving.Serving()
    for _ in range(2):
        rows = asyncio.run(watcher.sample(State()))  # type: ignore[arg-type]
    assert rows[0]["backends"][0]["requests_per_s"] == pytest.approx(20.0)


@pytest.mark.timeout(240)
def test_requests_per_second_match_the_generator_and_a_killed_backend_is_counted(
    stub_fleet: tuple[str, str],
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
) -> None:
    base_url, token = stub_fleet
    board = dashboard(interval=2.0)
    seen = browser()
    page = seen.page
    page.goto(f"{board.url}/serving")
    page.locator("table.backends tbody tr").nth(1).wait_for(timeout=60_000)
    load = Load(base_url, token)
    try:
        rates = []
        # a sample every 2 s, a rate over the last 3: read after each. Under load a sample
        # takes longer and the window spans more than 6 s: at 8 s it still held the time
        # before the load began (CI: 17.7 shown for 20 sent). The last reads' windows do not.
        for _ in range(10):
            time.sleep(board.interval)
            page.wait_for_function(
                "() => [...document.querySelectorAll('table.backends td.rps')]"
                f".some(td => td.textContent.trim() !== '{NONE}')",
                timeout=30_000,
            )
            rates.append(page_rate(seen))
        shown = statistics.median(rates[-4:])
        sent = load.rate()
        assert abs(shown - sent) <= 0.1 * sent, (rates, sent)

        address = page.locator("table.backends tbody tr").first.get_attribute("data-backend")
        assert address is not None
        row = page.locator(f'table.backends tr[data-backend="{address}"]')
        assert row.locator("td.restarts").inner_text() == "0"
        os.kill(stub_pid(int(address.rsplit(":", 1)[1])), signal.SIGKILL)
        row.locator("td.restarts", has_text="1").wait_for(timeout=30_000)

        assert row.locator("td.user-restarts").inner_text() == "0"

        other = page.locator("table.backends tbody tr").nth(1)  # restarted by hand, with the token
        assert other.locator("td.restarts").inner_text() == "0"
        page.fill("#token", TOKEN)
        page.dispatch_event("#token", "change")
        page.on("dialog", lambda dialog: dialog.accept())  # "Restart the server on ...?"
        other.locator("button", has_text="restart").click()
        page.locator("#action-result", has_text="done").wait_for(timeout=30_000)
        # a restart asked for is counted apart, not as a crash (it was: restarts 1)
        other.locator("td.user-restarts", has_text="1").wait_for(timeout=30_000)
        assert other.locator("td.restarts").inner_text() == "0"

        other.locator("a.backend-log").click()  # its log, as 'tpupod serve logs' prints it
        page.locator("#backend-log", has_text="stub pid").wait_for(timeout=30_000)
    finally:
        load.close()
    assert not seen.errors, seen.errors
