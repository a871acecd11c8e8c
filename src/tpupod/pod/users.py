"""Who is using a pod: a process that serves a pod for long (a job runner) or runs a
program on it (``tpupod run``, and what runs through it) says so in the pod's folder, so
that ``tpupod down`` can refuse to pull the pod from under it, or (with ``--force``) ask it
to let go first.

A user holds an exclusive ``flock`` on a file of its own, ``users/PID.N.json`` in the pod's
folder (what it is, since when; a run with --retries, a user from its start to its end,
recoveries included, also its cancel command and the file it reads for who stopped it, so
that ``down --force`` cancels it as ``tpupod cancel`` does). The lock goes with the
process, even on ``kill -9``: a file whose lock can be taken is a leftover, and whoever
finds it removes it. While a pod goes down, ``going-down`` in its folder tells a user that
missed the request that its pod is going (its job fails as the workers are stopped: that
is the pod, not the job).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tpupod.pod.state import RECORD_FILE, StateDir

USERS_DIR = "users"
_USES = itertools.count()
GOING_DOWN = "going-down"
POLL_S = 0.1


@dataclass(frozen=True)
class PodUser:
    pid: int
    what: str
    since: float
    stop: str = ""  # the command that stops it ('tpupod cancel --pod P RUN'), if any
    request: str = ""  # a file it reads, when stopped, for who stopped it

    @property
    def run_id(self) -> str:
        """The run this use is, or "": a --retries run's stop names it ('tpupod cancel --pod
        P RUN'); a plain run's launch is 'tpupod run RUN'."""
        if self.stop.startswith("tpupod cancel "):
            return self.stop.rsplit(" ", 1)[-1]
        if self.what.startswith("tpupod run "):
            return self.what.removeprefix("tpupod run ")
        return ""

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"{self.what} (pid {self.pid}, since {since})"


@contextlib.contextmanager
def using(
    state: StateDir, pod: str, what: str, *, stop: str = "", request: Path | None = None
) -> Iterator[None]:
    """Register this process as a user of ``pod`` for the block; ``stop`` says how to stop
    it, and ``request`` is the file it reads for who stopped it (see :func:`stop`)."""
    folder = state.pod_dir(pod) / USERS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    # one file a use: a job runner's run is a use of its own (users/PID.N.json)
    key = f"{os.getpid()}.{next(_USES)}"
    path = folder / f"{key}.json"
    staged = folder / f".{key}.tmp"
    with open(staged, "w") as handle:
        # locked and written before it has its name: no reader ever sees it unlocked
        fcntl.flock(handle, fcntl.LOCK_EX)
        said = {"pid": os.getpid(), "what": what, "since": time.time(), "stop": stop}
        handle.write(json.dumps({**said, "request": str(request or "")}))
        handle.flush()
        staged.rename(path)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # still locked: no reader takes it for a leftover


def users(state: StateDir, pod: str) -> list[PodUser]:
    """The live users of ``pod``; leftovers of dead ones are removed."""
    found = []
    folder = state.pod_dir(pod) / USERS_DIR
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        user = _live(path)
        if user is not None:
            found.append(user)
    return found


def _live(path: Path) -> PodUser | None:
    try:
        handle = open(path)  # noqa: SIM115 (closed below, whichever way)
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its process is alive
            try:
                data = json.loads(handle.read())
                return PodUser(
                    int(data["pid"]),
                    str(data["what"]),
                    float(data["since"]),
                    str(data.get("stop", "")),
                    str(data.get("request", "")),
                )
            except (ValueError, KeyError, TypeError):  # not ours: someone wrote it by hand
                pid = int(path.stem.split(".")[0])
                return PodUser(pid, "a process", path.stat().st_mtime)
        path.unlink(missing_ok=True)  # a leftover: its process died
        return None


def stop(
    state: StateDir, pod: str, found: list[PodUser], timeout: float, by: str = ""
) -> list[PodUser]:
    """Ask each user to let go (SIGTERM: a job runner gives its job back and exits, a run
    stops) and wait up to ``timeout`` s; returns those still there. ``by`` (who asks) goes
    to each user's request file first, so that it says who stopped it (a run); a user
    with a stop command of its own (a run with --retries: ``tpupod cancel``) is stopped as
    that command does, with SIGINT. A process is signalled once, however many uses it
    has: a second signal would force its stop (a run's workers KILLed without their
    grace)."""
    signals: dict[int, int] = {}
    for user in found:
        if by and user.request:  # a run says who stopped it (a plain run: on its SIGTERM)
            with contextlib.suppress(OSError):
                Path(user.request).write_text(by + "\n")
        if user.stop:
            signals[user.pid] = signal.SIGINT
        signals.setdefault(user.pid, signal.SIGTERM)
    for pid, signum in signals.items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    deadline = time.monotonic() + timeout
    left = users(state, pod)
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        left = users(state, pod)
    return left


def mark_going_down(state: StateDir, pod: str) -> None:
    (state.pod_dir(pod) / GOING_DOWN).touch()


def unmark_going_down(state: StateDir, pod: str) -> None:
    (state.pod_dir(pod) / GOING_DOWN).unlink(missing_ok=True)


class Watch:
    """Tells a user when its pod is gone: taken down (or going), or replaced by another of
    the same name. A ``stat`` or two: cheap enough to ask every second."""

    def __init__(self, state: StateDir, pod: str) -> None:
        self.state, self.pod = state, pod
        self.record = state.pod_dir(pod) / RECORD_FILE
        self.version = _version(self.record)

    def gone(self) -> str | None:
        """Why the pod is gone, or None while it is there."""
        if (self.state.pod_dir(self.pod) / GOING_DOWN).exists():
            return f"pod {self.pod!r} is being taken down"
        version = _version(self.record)
        if version is None:
            return f"pod {self.pod!r} was taken down"
        if version != self.version:
            return f"pod {self.pod!r} was made again (a new pod of that name)"
        return None


def _version(record: Path) -> int | None:
    try:
        return record.stat().st_mtime_ns
    except FileNotFoundError:
        return None
