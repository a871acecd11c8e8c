"""What the pages read: every source's last data, age and error, the bounded history, and the
viewers' event queues, fed by the sampling process (``python -m tpupod.dashboard.sampler``).

The sampler runs in a process of its own: probing hundreds of workers is CPU work (asyncio,
subprocesses or SSH sessions) that, in a thread of the web process, held the GIL against
every render (pages took 10-30x an empty answer). It writes one JSON line per change; this
side keeps the last of each and tells viewers at once. A sampler that dies is started again;
meanwhile every source says it failed and keeps its last data.

Every stream a viewer holds (``sse``) ends when the server begins to stop (``Closing``,
set from the signal: server.py): an open stream kept uvicorn's graceful shutdown waiting
until the browser left, so Ctrl-C did nothing and a second one cut the streams with
tracebacks. The browser reconnects to the next dashboard with the id of the last event it
got (``Last-Event-ID``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import IO, Any

from fastapi.responses import StreamingResponse

from tpupod.dashboard.jobs import Jobs
from tpupod.state import StateDir

HISTORY_S = 24 * 3600
TOPICS = ("pods", "runs", "jobs", "serving")
RESTART_S = 1.0  # wait before starting a sampler that ended again
STOP_S = 1.0  # a sampler told to stop (its stdin closed) is killed after this long


@dataclass
class Source:
    """One source's last data and last failure."""

    name: str
    data: Any = None
    at: float | None = None  # when the data was taken (None: never yet)
    error: str | None = None
    error_at: float | None = None
    version: int = 0  # counts changes: a page rendered at one version is valid until the next

    @property
    def state(self) -> str:
        if self.at is None:
            return "error" if self.error else "loading"
        return "stale" if self.error else "ok"

    def to_json(self, now: float) -> dict[str, Any]:
        age = None if self.at is None else round(now - self.at, 1)
        return {"source": self.name, "state": self.state, "age_s": age, "error": self.error}


@dataclass
class History:
    """Per-pod and overall series: (time, value) rings of a fixed length."""

    length: int
    series: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)

    def add(self, key: str, at: float, value: float | None) -> None:
        if value is not None:
            self.series.setdefault(key, deque(maxlen=self.length)).append((at, value))

    def since(self, key: str, start: float) -> list[tuple[float, float]]:
        return [p for p in self.series.get(key, ()) if p[0] >= start]


class Feed:
    def __init__(self, interval: float, jobs_url: str | None) -> None:
        self.interval = interval
        self.jobs_url = jobs_url
        self.state = StateDir()
        self.jobs = Jobs(jobs_url)  # the pages' own queries: a page, one job, cancel, follow
        self.sources = {name: Source(name) for name in TOPICS}
        self.history = History(int(HISTORY_S / interval))
        # each viewer's queue, and the loop it is read on (the web server's)
        self.listeners: dict[asyncio.Queue[str], asyncio.AbstractEventLoop] = {}
        self.stopping = threading.Event()
        self.process: subprocess.Popen[bytes] | None = None

    # -- the sampling process -----------------------------------------------------------

    def start(self) -> threading.Thread:
        """Start the sampler and read what it says, in a thread (restarting it if it ends)."""
        thread = threading.Thread(target=self._keep_sampling, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.stopping.set()
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # type: ignore[union-attr]  # it ends at EOF
            try:
                process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _keep_sampling(self) -> None:
        while not self.stopping.is_set():
            argv = [sys.executable, "-m", "tpupod.dashboard.sampler"]
            argv += ["--interval", str(self.interval)]
            argv += ["--db", self.jobs_url] if self.jobs_url else []
            # stdin is its lifeline: when this process dies, the sampler reads EOF and ends
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._read(self.process.stdout)  # type: ignore[arg-type]
            code = self.process.wait()
            if self.stopping.is_set():
                return
            self._failed(f"the sampling process ended (exit {code}); starting it again")
            self.stopping.wait(RESTART_S)

    def _read(self, lines: IO[bytes]) -> None:
        for line in lines:
            with contextlib.suppress(ValueError):  # a torn line as the process died
                self.apply(json.loads(line))

    def _failed(self, why: str) -> None:
        for source in self.sources.values():
            source.error, source.error_at = why, time.time()
            self.publish(source.name)

    def apply(self, message: dict[str, Any]) -> None:
        """One line of the sampler: a source's news, or the end of a round of the workers."""
        if "round" in message:
            self._record_history(message["round"])
            return
        source = self.sources[message["source"]]
        if "error" in message:
            source.error, source.error_at = message["error"], message["error_at"]
        else:
            changed = "data" in message or source.error is not None
            if "data" in message:
                source.data = message["data"]
            source.at, source.error = message["at"], None
            if not changed:
                return
        source.version += 1
        self.publish(source.name)

    def _record_history(self, now: float) -> None:
        for pod in self.sources["pods"].data or ():
            workers: list[dict[str, Any]] = pod["workers"]
            loads = [w["load"] for w in workers if w["load"] is not None]
            memory = [w["memory"] for w in workers if w["memory"] is not None]
            self.history.add(f"reachable:{pod['name']}", now, pod["reachable"])
            self.history.add(f"load:{pod['name']}", now, _mean(loads))
            self.history.add(f"memory:{pod['name']}", now, _mean(memory))
        for status, count in (self.sources["jobs"].data or {"counts": {}})["counts"].items():
            self.history.add(f"jobs:{status}", now, count)
        for fleet in self.sources["serving"].data or ():
            rates = [b["requests_per_s"] or 0.0 for b in fleet["backends"]]
            self.history.add(f"requests_per_s:{fleet['pod']}", now, sum(rates))

    # -- viewers ----------------------------------------------------------------------------

    def publish(self, topic: str) -> None:
        """Tell every viewer (from any thread) that ``topic``'s data changed."""
        for queue, loop in list(self.listeners.items()):
            with contextlib.suppress(RuntimeError):  # its loop closed
                loop.call_soon_threadsafe(_offer, queue, topic)

    def listen(self) -> asyncio.Queue[str]:
        """A queue of changed topics, read on the calling (running) loop."""
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=64)
        self.listeners[queue] = asyncio.get_running_loop()
        return queue

    def forget(self, queue: asyncio.Queue[str]) -> None:
        self.listeners.pop(queue, None)


def _offer(queue: asyncio.Queue[str], topic: str) -> None:
    with contextlib.suppress(asyncio.QueueFull):  # a viewer this far behind refetches anyway
        queue.put_nowait(topic)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# -- event streams that end as the server stops --------------------------------------------

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
RETRY_MS = 2000  # how long a browser waits before it reconnects


class Closing:
    """Set once the server begins to stop: safe to set from a signal handler or a thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None
        self.early = False  # set before the loop ran (a signal during start)

    def bind(self) -> None:
        """Called on the server's loop as it starts (the app's lifespan)."""
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        if self.early:
            self.event.set()

    def set(self) -> None:
        if self.loop is None or self.event is None:
            self.early = True
            return
        with contextlib.suppress(RuntimeError):  # the loop closed already
            self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self) -> None:
        if self.event is None:  # a test's app without a lifespan: never closing
            await asyncio.Future()
        assert self.event is not None
        await self.event.wait()


def sse(stream: AsyncIterator[str], closing: Closing) -> StreamingResponse:
    """``stream``'s events as a response that ends when the server begins to stop."""
    return StreamingResponse(
        until_closing(stream, closing), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def until_closing(stream: AsyncIterator[str], closing: Closing) -> AsyncIterator[str]:
    """``stream``'s items until it ends or ``closing`` is set; ``stream`` is closed either
    way (its ``finally`` runs: a follow's thread stops)."""
    closed = asyncio.ensure_future(closing.wait())
    step: asyncio.Future[str] | None = None
    try:
        yield f"retry: {RETRY_MS}\n\n"
        while True:
            step = asyncio.ensure_future(anext(stream))
            await asyncio.wait({step, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        closed.cancel()
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
