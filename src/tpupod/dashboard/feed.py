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
import fcntl
import json
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fastapi.responses import StreamingResponse

from tpupod.base.files import write_atomic
from tpupod.dashboard.jobs import Jobs
from tpupod.pod.state import StateDir

HISTORY_S = 24 * 3600
HISTORY_FILE = "dashboard/history.jsonl"  # in the state directory
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


class History:
    """Per-pod and overall series: (time, value) rings of a fixed length, kept in the state
    directory (``dashboard/history.jsonl``, a line per round) so that a restarted dashboard
    still has its charts. One dashboard of a state directory writes it (a lock); others
    only read it at start. The file is written again, with only what the rings hold, once
    it has grown by a ring's length."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.series: dict[str, deque[tuple[float, float]]] = {}
        self.guard = threading.Lock()  # pages read while the feed's thread adds
        self.file: IO[str] | None = None
        self.path: Path | None = None
        self.lock: IO[bytes] | None = None
        self.written = 0

    def keep(self, path: Path, since: float) -> None:
        """Load the rounds at ``path`` from ``since`` on, and add each new one there (if
        no other dashboard of this state directory does)."""
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = path.with_name(path.name + ".lock").open("ab")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                self._load(path, since)
                return
            self.lock, self.path = lock, path
            self._load(path, since)
            self._rewrite()

    def add_round(self, at: float, values: dict[str, float | None]) -> None:
        kept = {k: v for k, v in values.items() if v is not None}
        with self.guard:
            for key, value in kept.items():
                self.series.setdefault(key, deque(maxlen=self.length)).append((at, value))
        if self.file is None:
            return
        try:
            self.file.write(json.dumps({"t": at, "v": kept}) + "\n")
            self.file.flush()
        except OSError:  # a full disk: the charts go on in memory
            self.file = None
            return
        self.written += 1
        if self.written >= self.length:
            self._rewrite()

    def keys(self) -> list[str]:
        with self.guard:
            return list(self.series)

    def since(self, key: str, start: float) -> list[tuple[float, float]]:
        with self.guard:
            return [p for p in self.series.get(key, ()) if p[0] >= start]

    def _load(self, path: Path, since: float) -> None:
        with contextlib.suppress(FileNotFoundError), path.open(encoding="utf-8") as file:
            for line in file:
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    found = json.loads(line)
                    if found["t"] >= since:
                        for key, value in found["v"].items():
                            ring = self.series.setdefault(key, deque(maxlen=self.length))
                            ring.append((float(found["t"]), float(value)))

    def _rewrite(self) -> None:
        """The file again with only what the rings hold (atomically), then appended to."""
        assert self.path is not None
        rounds: dict[float, dict[str, float]] = {}
        with self.guard:
            for key, ring in self.series.items():
                for at, value in ring:
                    rounds.setdefault(at, {})[key] = value
        text = "".join(json.dumps({"t": t, "v": v}) + "\n" for t, v in sorted(rounds.items()))
        if self.file is not None:
            self.file.close()
        try:
            write_atomic(self.path, text)
            self.file = self.path.open("a", encoding="utf-8")
        except OSError:
            self.file = None
        self.written = 0

    def close(self) -> None:
        for handle in (self.file, self.lock):
            if handle is not None:
                handle.close()
        self.file = self.lock = None


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
        # the charts' history first (this thread adds to it: no round is lost or doubled)
        self.history.keep(self.state.root / HISTORY_FILE, time.time() - HISTORY_S)
        try:
            self._sample()
        finally:
            self.history.close()

    def _sample(self) -> None:
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
        values: dict[str, float | None] = {}
        for pod in self.sources["pods"].data or ():
            workers: list[dict[str, Any]] = pod["workers"]
            loads = [w["load"] for w in workers if w["load"] is not None]
            memory = [w["memory"] for w in workers if w["memory"] is not None]
            values[f"reachable:{pod['name']}"] = pod["reachable"]
            values[f"load:{pod['name']}"] = _mean(loads)
            values[f"memory:{pod['name']}"] = _mean(memory)
        for status, count in (self.sources["jobs"].data or {"counts": {}})["counts"].items():
            values[f"jobs:{status}"] = count
        for fleet in self.sources["serving"].data or ():
            rates = [b["requests_per_s"] or 0.0 for b in fleet["backends"]]
            values[f"requests_per_s:{fleet['pod']}"] = sum(rates)
        self.history.add_round(now, values)

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
