"""The registry: which backends exist, which are healthy, and how busy each is.

Health comes from two sides:

* active checks: ``GET /health`` every ``interval`` s; ``fall`` failures in a
  row mark a backend down, ``rise`` successes up again. A refused connection
  (nothing listens: the process is gone) marks it down at once. A backend that is
  down or between states is checked every ``FAST_CHECK_S`` (HAProxy's ``fastinter``):
  one that serves again after a restart counts up within a second, not ``rise``
  intervals later (a new user read 'router: down' in ``serve status`` for ~3 s).
* passive ejection: the router reports each request's end. A connect error or
  a 5xx counts as a failure of the backend's circuit breaker; ``eject_after``
  of them in a row open it for ``cooldown`` s (no traffic), after which one
  request may try it (half-open). A 4xx is the client's fault and never counts.

Each backend's requests, failures and completion tokens are counted in a file the router
maps (``router.counts``), so a router killed and started again goes on from them.

The answer of ``/backends`` keeps seed 000's shape
(``{"ok": true, "model": M, "backends": ["host:port", ...]}``, the healthy
ones) and adds each backend's health under ``"health"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import mmap
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tpupod.base.files import FULL_DISK
from tpupod.serve import defaults
from tpupod.serve.eventloop import cancelled


class Health(enum.StrEnum):
    UP = "up"
    DOWN = "down"


# -- counts kept across the router's restarts -------------------------------------------
# serve status' REQUESTS (and the dashboard's requests/s) are these counts. They lived in
# the router's memory, so each restart of the router (a kill -9, the OOM killer) began
# them at 0 again. Each is now a 64-bit integer in ``router.counts``
# (``services.counts_path``), mapped shared: a count is in the page cache the moment it
# is made, so a router killed at any point and started again by its respawn parent goes
# on from every count the killed one made. A file for other backends (another fleet: the
# header holds a digest of their addresses) is begun anew; ctl removes the file when a
# new fleet's router starts.

FAST_CHECK_S = 0.5  # health checks of a backend that is down or between states
MAGIC = b"tpupod router counts 1\n"
FIELDS = ("requests", "failures", "completion_tokens")  # per backend, in this order
WIDTH = 8  # bytes of a count


HEADER = 64  # bytes: the counts after it are aligned


def _header(addresses: list[str]) -> bytes:
    return (MAGIC + hashlib.sha256(",".join(addresses).encode()).digest()).ljust(HEADER, b"\0")


class Counts:
    """``len(FIELDS)`` counts for each backend, in ``path`` (None: in memory only). The
    mapping lasts as long as the process (it is never unmapped: views of it are out)."""

    def __init__(self, addresses: list[str], path: Path | None = None) -> None:
        header = _header(addresses)
        size = len(header) + WIDTH * len(FIELDS) * len(addresses)
        buffer: bytearray | mmap.mmap = bytearray(size)
        if path is not None:
            try:
                buffer = _mapped(path, header, size)
            except OSError as exc:
                if exc.errno not in FULL_DISK:
                    raise
                print(f"[tpupod] request counts kept in memory only: {path}: {exc.strerror}",
                      file=sys.stderr, flush=True)  # fmt: skip
        self._counts = memoryview(buffer)[len(header) :].cast("q")

    def of(self, index: int) -> memoryview:
        """The counts of the backend at ``index`` (in the order given), as a view to write."""
        n = len(FIELDS)
        return self._counts[index * n : (index + 1) * n]


def _mapped(path: Path, header: bytes, size: int) -> mmap.mmap:
    """``path`` mapped, as it is when it holds these backends' counts, else zeroed."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != size or os.pread(fd, len(header), 0) != header:
            os.ftruncate(fd, 0)  # another fleet's, or torn: begin anew
            os.ftruncate(fd, size)
            os.pwrite(fd, header, 0)
        # every block taken now (a sparse file's too, an older router's): a count written
        # into a page with no block behind it, once the disk had filled, was a SIGBUS
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class Counted:
    """A backend's count, kept in its ``counts`` (``counts.py``: a file the router maps, so
    the count outlives a router killed and started again)."""

    def __init__(self, name: str) -> None:
        self.index = FIELDS.index(name)

    def __get__(self, backend: Backend, owner: type[Backend]) -> int:
        return int(backend.counts[self.index])

    def __set__(self, backend: Backend, value: int) -> None:
        backend.counts[self.index] = value


@dataclass
class Backend:
    address: str  # host:port
    counts: memoryview = field(default_factory=lambda: Counts([""]).of(0), repr=False)
    health: Health = Health.UP
    outstanding: int = 0
    checks_failed: int = 0  # in a row
    checks_ok: int = 0  # in a row
    errors_in_row: int = 0  # passive: connect errors and 5xx in a row
    open_until: float = 0.0  # circuit breaker open until this monotonic time
    half_open_trial: bool = False
    last_error: str | None = None
    silent: bool = False  # its last health check timed out (a stopped process, a cut link)
    changed_at: float = field(default_factory=time.time)
    next_check: float = 0.0  # monotonic: when its next health check is due
    token_window: list[tuple[float, int]] = field(default_factory=list)

    requests = Counted("requests")
    failures = Counted("failures")
    completion_tokens = Counted("completion_tokens")

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        self.token_window = [(t, n) for t, n in self.token_window if now - t < window]
        return sum(n for _, n in self.token_window) / window


@dataclass(frozen=True)
class HealthPolicy:
    interval: float = defaults.HEALTH_INTERVAL_S
    timeout: float = defaults.HEALTH_TIMEOUT_S
    fall: int = defaults.FALL
    rise: int = defaults.RISE
    eject_after: int = defaults.EJECT_AFTER
    cooldown: float = defaults.COOLDOWN_S


class Registry:
    def __init__(
        self, addresses: list[str], model: str, policy: HealthPolicy, counts: Counts | None = None
    ) -> None:
        """``counts``: where the backends' counts are kept (in this order); else in memory."""
        counts = counts or Counts(addresses)
        self.backends = {a: Backend(a, counts.of(i)) for i, a in enumerate(addresses)}
        self.model = model
        self.policy = policy
        self._task: asyncio.Task[None] | None = None
        # called at each change of a backend's health, with why it went down (None: it is
        # up again) and how long it was as it was: the router says it in its log and, where
        # it went down, breaks what waits on it there
        self.on_change: Callable[[Backend, str | None, float], None] | None = None
        self._answered = asyncio.Event()  # replaced each time it is set (see answered)

    async def answered(self, timeout: float) -> None:
        """Return when a backend that was down answers its health check (or is up again),
        or after ``timeout`` seconds: requests held for want of a backend try again then."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answered.wait(), timeout)

    def wake(self) -> None:
        """Wake every request waiting in :meth:`answered`."""
        self._answered.set()
        self._answered = asyncio.Event()

    def available(self) -> list[Backend]:
        """Backends a request may go to: up, with the circuit closed (or a half-open trial)."""
        now = time.monotonic()
        found = []
        for b in self.backends.values():
            if b.health is not Health.UP:
                continue
            if b.open_until > now:
                continue
            if b.open_until and b.half_open_trial:
                continue  # one trial at a time while half-open
            found.append(b)
        return found

    def untried(self) -> list[Backend]:
        """With none available, the backends a request may still try: those down or
        ejected that answer when asked (refused or with an error at once), not the silent
        ones, where a request would hang (Envoy's panic mode, minus those)."""
        return [b for b in self.backends.values() if not b.silent]

    def begin(self, backend: Backend) -> None:
        backend.outstanding += 1
        backend.requests += 1
        if backend.open_until:
            backend.half_open_trial = True

    def end(self, backend: Backend, ok: bool, error: str | None = None, tokens: int = 0) -> None:
        """A request's end as the router saw it; ``ok`` False only for connect errors and 5xx."""
        backend.outstanding -= 1
        backend.half_open_trial = False
        if tokens:
            backend.completion_tokens += tokens
            backend.token_window.append((time.monotonic(), tokens))
        if ok:
            backend.errors_in_row = 0
            backend.open_until = 0.0
            return
        backend.failures += 1
        backend.errors_in_row += 1
        backend.last_error = error
        if backend.errors_in_row >= self.policy.eject_after or backend.open_until:
            backend.open_until = time.monotonic() + self.policy.cooldown

    def refused(self, backend: Backend, error: str) -> None:
        """Nothing listens there: the process is gone, so the backend is down until checks pass."""
        self._set(backend, Health.DOWN, error)
        backend.checks_ok = 0

    def _set(self, backend: Backend, health: Health, error: str | None = None) -> None:
        if backend.health is not health:
            lasted = time.time() - backend.changed_at
            backend.health = health
            backend.changed_at = time.time()
            if self.on_change is not None:
                self.on_change(backend, (error or "") if health is Health.DOWN else None, lasted)
        if error:
            backend.last_error = error

    async def check(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=self.policy.timeout)
        try:
            async with session.get(f"{backend.url}/health", timeout=timeout) as r:
                ok, error = r.status == 200, f"/health answered {r.status}"
            backend.silent = False
        except aiohttp.ClientConnectorError as exc:
            backend.silent = isinstance(exc, TimeoutError)
            self.refused(backend, f"cannot connect: {exc.os_error or exc}")
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, error = False, f"/health failed: {type(exc).__name__} {exc}".strip()
            backend.silent = isinstance(exc, TimeoutError)
        if ok and not self.model:
            await self.discover_model(session, backend)
        if ok:
            backend.checks_failed = 0
            backend.checks_ok += 1
            if backend.health is Health.DOWN:
                self.wake()  # it answers again: held requests try it (Router.forward)
            if backend.health is Health.DOWN and backend.checks_ok >= self.policy.rise:
                backend.errors_in_row, backend.open_until = 0, 0.0
                self._set(backend, Health.UP)
                backend.last_error = None
        else:
            backend.checks_ok = 0
            backend.checks_failed += 1
            if backend.checks_failed >= self.policy.fall:
                self._set(backend, Health.DOWN, error)

    async def discover_model(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        """The served model's name, as the first backend that answers ``/v1/models`` says."""
        timeout = aiohttp.ClientTimeout(total=self.policy.timeout)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            async with session.get(f"{backend.url}/v1/models", timeout=timeout) as r:
                if r.status == 200:
                    self.model = str((await r.json())["data"][0]["id"])

    async def run_checks(self, session: aiohttp.ClientSession) -> None:
        while True:
            started = time.monotonic()
            due = [b for b in self.backends.values() if b.next_check <= started]
            await asyncio.gather(*(self.check_due(session, b, started) for b in due))
            soonest = min((b.next_check for b in self.backends.values()), default=0.0)
            soonest = soonest or started + self.policy.interval
            await asyncio.sleep(max(0.0, soonest - time.monotonic()))

    async def check_due(
        self, session: aiohttp.ClientSession, backend: Backend, started: float
    ) -> None:
        """One check, and when the next is due: sooner while the backend is down or
        between states."""
        await self.check(session, backend)
        changing = backend.health is Health.DOWN or backend.checks_failed > 0
        every = min(self.policy.interval, FAST_CHECK_S) if changing else self.policy.interval
        backend.next_check = started + every

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self.run_checks(session))

    async def stop(self) -> None:
        """End the health checks; a cancel of our caller meanwhile is raised after."""
        if self._task is not None:
            await cancelled(self._task)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        healthy = [b.address for b in self.available()]
        return {
            "ok": bool(healthy),
            "model": self.model,
            "at": time.time(),  # when these counts were read: a rate's clock (the dashboard's)
            "backends": healthy,
            "health": {
                b.address: {
                    "state": b.health.value,
                    "circuit": "open" if b.open_until > now else "closed",
                    "outstanding": b.outstanding,
                    "requests": b.requests,
                    "failures": b.failures,
                    "completion_tokens": b.completion_tokens,
                    "tokens_per_s": round(b.tokens_per_s(), 1),
                    "last_error": b.last_error,
                    "since": b.changed_at,
                }
                for b in self.backends.values()
            },
        }
