"""The background sampler: every source sampled at a fixed interval, shared by every viewer
(the workers and the fleets every ``interval``; the job store and the run records, one query
and a folder listing, every second).

Each source (pods, runs, jobs, serving) keeps its last good data, when it was taken and its
last error, so a page whose source died still shows its data, how old it is and what failed;
a source never sampled yet is *loading*, never "empty". A round asks at most ``concurrency``
pods at once; history is a bounded ring (24 h at the interval), so memory does not grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tpupod.dashboard.jobs import Jobs
from tpupod.dashboard.probe import sample_pod
from tpupod.dashboard.runs import RunCache
from tpupod.dashboard.serving import Serving
from tpupod.providers import Connector, connect
from tpupod.state import StateDir

HISTORY_S = 24 * 3600
TICK_S = 1.0  # how often the cheap sources are read
TOPICS = ("pods", "runs", "jobs", "serving")


@dataclass
class Source:
    """One source's last data and last failure."""

    name: str
    data: Any = None
    at: float | None = None  # when the data was taken (None: never yet)
    error: str | None = None
    error_at: float | None = None

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


class Sampler:
    def __init__(self, interval: float, jobs_url: str | None, concurrency: int = 8) -> None:
        self.interval = interval
        self.state = StateDir()
        self.jobs = Jobs(jobs_url)
        self.sources = {name: Source(name) for name in TOPICS}
        self.history = History(int(HISTORY_S / interval))
        self.limit = asyncio.Semaphore(concurrency)
        self.connectors: dict[str, Connector] = {}
        self.run_cache = RunCache()
        self.serving = Serving()
        # each viewer's queue, and the loop it is read on (the web server's)
        self.listeners: dict[asyncio.Queue[str], asyncio.AbstractEventLoop] = {}
        self.stopping = threading.Event()
        self.rounds = 0

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Sample in a thread of its own, on its own event loop: probing hundreds of workers
        costs the loop CPU, and pages must not wait for it."""
        thread = threading.Thread(target=asyncio.run, args=(self.run(),), daemon=True)
        thread.start()
        return thread

    async def run(self) -> None:
        """Until stopped: the store and the run records (cheap: one query, a folder listing)
        every ``TICK_S``, the workers and the fleets (commands on every host) every
        ``interval``, each on its own clock (a slow probe does not hold the cheap ones)."""
        cheap, costly = ("runs", "jobs"), ("pods", "serving")
        await asyncio.gather(
            self._every(min(self.interval, TICK_S), cheap), self._every(self.interval, costly)
        )
        await self.close()

    async def _every(self, period: float, names: tuple[str, ...]) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            await self.round(names)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def round(self, names: tuple[str, ...] = TOPICS) -> None:
        """Take the named sources once (a round of the workers also adds to the history)."""
        steps: dict[str, Callable[[], Awaitable[Any]]] = {
            "runs": lambda: asyncio.to_thread(self._runs),
            "jobs": lambda: asyncio.to_thread(self.jobs.counts),
            "pods": self._pods,
            "serving": lambda: self.serving.sample(self.state),
        }
        await asyncio.gather(*(self._take(name, steps[name]) for name in names))
        if "pods" in names:
            self.rounds += 1
            self._record_history()

    async def _take(self, name: str, step: Callable[[], Awaitable[Any]]) -> None:
        source = self.sources[name]
        try:
            data = await asyncio.wait_for(step(), timeout=max(self.interval * 4, 10))
        except Exception as exc:  # a source's failure is shown, not raised
            source.error, source.error_at = _describe(exc), time.time()
            self.publish(name)
            return
        changed = data != source.data or source.error is not None
        source.data, source.at, source.error = data, time.time(), None
        if changed:
            self.publish(name)

    async def _pods(self) -> list[dict[str, Any]]:
        names = await asyncio.to_thread(self.state.names)
        for gone in set(self.connectors) - set(names):
            await self.connectors.pop(gone).close()
        return list(await asyncio.gather(*(self._pod(name) for name in names)))

    async def _pod(self, name: str) -> dict[str, Any]:
        pod = await asyncio.to_thread(self.state.load, name)
        connector = self.connectors.get(name)
        if connector is None:
            connector = self.connectors[name] = connect(pod, self.state)
        async with self.limit:
            samples = await sample_pod(pod, connector, timeout=max(self.interval * 0.8, 0.5))
        return {
            "name": name,
            "provider": pod.provider,
            "workers": [s.to_json() for s in samples],
            "reachable": sum(s.reachable for s in samples),
        }

    def _runs(self) -> list[dict[str, Any]]:
        return self.run_cache.summaries(self.state)

    def _record_history(self) -> None:
        now = time.time()
        for pod in self.sources["pods"].data or ():
            workers: list[dict[str, Any]] = pod["workers"]
            loads = [w["load"] for w in workers if w["load"] is not None]
            memory = [w["memory"] for w in workers if w["memory"] is not None]
            self.history.add(f"reachable:{pod['name']}", now, pod["reachable"])
            self.history.add(f"load:{pod['name']}", now, _mean(loads))
            self.history.add(f"memory:{pod['name']}", now, _mean(memory))
        for status, count in (self.sources["jobs"].data or {}).items():
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

    async def close(self) -> None:
        for connector in self.connectors.values():
            with contextlib.suppress(Exception):
                await connector.close()


def _offer(queue: asyncio.Queue[str], topic: str) -> None:
    with contextlib.suppress(asyncio.QueueFull):  # a viewer this far behind refetches anyway
        queue.put_nowait(topic)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return str(message).splitlines()[0]
