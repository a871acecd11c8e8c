"""The background sampler: every source sampled at a fixed interval, shared by every viewer
(the workers and the fleets every ``interval``; the run records every second, the job store
four times a second: a folder listing, one grouped count).

``python -m tpupod.dashboard.sampler`` runs it in a process of its own (feed.py starts it
and says why) and writes a JSON line per source per take: its data when it changed, else only
when it was taken; its error when it failed; ``{"round": T}`` after each round of the
workers (the history's clock). It ends when its stdin closes: the dashboard went away. A
round asks at most ``concurrency`` pods at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tpupod.dashboard.jobs import Jobs
from tpupod.dashboard.probe import sample_pod
from tpupod.dashboard.runs import RunIndex
from tpupod.dashboard.serving import Serving
from tpupod.errors import StateError
from tpupod.pod.state import StateDir
from tpupod.providers import Connector, connect

TICK_S = 1.0  # how often the run records are read
JOBS_TICK_S = 0.25  # and the job store (one grouped count): a cancel shows within a second
TOPICS = ("pods", "runs", "jobs", "serving")
Report = Callable[[dict[str, Any]], None]


class Sampler:
    def __init__(
        self, interval: float, jobs_url: str | None, report: Report, concurrency: int = 8
    ) -> None:
        self.interval = interval
        self.report = report
        self.state = StateDir()
        self.jobs = Jobs(jobs_url)
        self.last: dict[str, Any] = {}  # each source's last data sent
        self.limit = asyncio.Semaphore(concurrency)
        self.connectors: dict[str, Connector] = {}
        self.run_index = RunIndex()
        self.serving = Serving()
        self.stopping = threading.Event()

    async def run(self) -> None:
        """Until stopped: the store and the run records (cheap: one query, a folder listing)
        every ``TICK_S`` or less, the workers and the fleets (commands on every host) every
        ``interval``, each on its own clock (a slow probe does not hold the cheap ones)."""
        tick = min(self.interval, TICK_S)
        await asyncio.gather(
            self._every(tick, ("runs",)),
            self._every(min(tick, JOBS_TICK_S), ("jobs",)),
            self._every(self.interval, ("pods", "serving")),
        )
        await self.close()

    async def _every(self, period: float, names: tuple[str, ...]) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            await self.round(names)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def round(self, names: tuple[str, ...] = TOPICS) -> None:
        """Take the named sources once (a round of the workers also marks the history)."""
        steps: dict[str, Callable[[], Awaitable[Any]]] = {
            "runs": lambda: asyncio.to_thread(self._runs),
            "jobs": lambda: asyncio.to_thread(self.jobs.summary),
            "pods": self._pods,
            "serving": lambda: self.serving.sample(self.state),
        }
        await asyncio.gather(*(self._take(name, steps[name]) for name in names))
        if "pods" in names:
            self.report({"round": time.time()})

    async def _take(self, name: str, step: Callable[[], Awaitable[Any]]) -> None:
        try:
            data = await asyncio.wait_for(step(), timeout=max(self.interval * 4, 10))
        except Exception as exc:  # a source's failure is shown, not raised
            self.report({"source": name, "error": _describe(exc), "error_at": time.time()})
            return
        news: dict[str, Any] = {"source": name, "at": time.time()}
        if name not in self.last or data != self.last[name]:
            self.last[name] = news["data"] = data
        self.report(news)

    async def _pods(self) -> list[dict[str, Any]]:
        names = await asyncio.to_thread(self.state.names)
        for gone in set(self.connectors) - set(names):
            await self.connectors.pop(gone).close()
        return list(await asyncio.gather(*(self._pod(name) for name in names)))

    async def _pod(self, name: str) -> dict[str, Any]:
        """One pod's sample; a pod whose record is broken is named with why, and the
        others are sampled still (one broken record failed the whole source)."""
        try:
            pod = await asyncio.to_thread(self.state.load, name)
        except StateError as exc:
            return {"name": name, "provider": "?", "workers": [], "reachable": 0,
                    "error": exc.message}  # fmt: skip
        connector = self.connectors.get(name)
        if connector is None:
            connector = self.connectors[name] = connect(pod, self.state)
        async with self.limit:
            samples = await sample_pod(pod, connector, timeout=max(self.interval * 0.8, 0.5))
        return {
            "name": name,
            "provider": pod.provider,
            "slices": pod.slices,
            "layout": pod.slice_layout(),  # "2 slices of 2 workers: w0-w1, w2-w3"
            "workers": [s.to_json() for s in samples],
            "reachable": sum(s.reachable for s in samples),
        }

    def _runs(self) -> dict[str, Any]:
        return self.run_index.take(self.state)

    async def close(self) -> None:
        for connector in self.connectors.values():
            with contextlib.suppress(Exception):
                await connector.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return str(message).splitlines()[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tpupod.dashboard.sampler")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--db", default=None)
    args = parser.parse_args(argv)
    # A terminal's Ctrl-C reaches the whole process group: the dashboard stops us (it closes
    # our stdin); a SIGINT here killed us mid-write and the dashboard started another
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout

    def report(message: dict[str, Any]) -> None:
        out.write(json.dumps(message, default=str) + "\n")
        out.flush()

    with contextlib.suppress(BrokenPipeError):
        asyncio.run(until_eof(Sampler(args.interval, args.db, report)))


async def until_eof(sampler: Sampler) -> None:
    """Sample until stdin ends (the dashboard closed it, or died), then stop at once: a
    probe or a sleep in progress is cancelled, not waited out."""
    loop = asyncio.get_running_loop()
    eof = asyncio.Event()

    def read_to_eof() -> None:  # os.read: no buffered reader's lock left held at exit
        while os.read(0, 4096):
            pass
        sampler.stopping.set()
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(eof.set)

    threading.Thread(target=read_to_eof, daemon=True).start()
    work = asyncio.create_task(sampler.run())
    ended = asyncio.create_task(eof.wait())
    await asyncio.wait({work, ended}, return_when=asyncio.FIRST_COMPLETED)
    for task in (work, ended):
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    await sampler.close()


if __name__ == "__main__":
    main()
