"""A worker's serving services (the agent, the router) as files in its state folder: each
records ``NAME.json`` (pid, host, port) once it listens and keeps its bearer token in
``NAME.token`` (mode 0600); the process ctl started for it is in ``NAME.spawned`` from
its first moment; the router counts its restarts in ``router.restarts`` and its requests
in ``router.counts``. Log
lines start with their UTC time (``stamp``). What the services write and ``ctl`` reads,
shared by every process of the fleet on a worker, so none reaches into another's module."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tpupod.base import procfs
from tpupod.base.files import FULL_DISK, write_atomic

STATE_DIR = ".tpupod/serve"  # relative: each worker's home (SSH) or work folder (local)


def read_info(state: Path, service: str) -> dict[str, Any] | None:
    """The service's record, when it exists and its process is alive."""
    try:
        info: dict[str, Any] = json.loads((state / f"{service}.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info.get("pid"), int) and procfs.alive(info["pid"]) else None


def write_info(state: Path, service: str, host: str, port: int, **extra: object) -> None:
    """Called by the service itself once it listens."""
    record = {"pid": os.getpid(), "parent": os.getppid(), "host": host, "port": port}
    record.update(started=time.time(), **extra)
    write_atomic(state / f"{service}.json", json.dumps(record) + "\n")


_WAITING: set[str] = set()  # the writes when_room tries again, by what they write


def _to_stderr(text: str) -> None:
    print(f"[tpupod] {text}", file=sys.stderr, flush=True)


def when_room(
    write: Callable[[], None],
    what: str,
    every: float = 1.0,
    say: Callable[[str], None] = _to_stderr,
) -> None:
    """``write()`` now; where the disk is full, again every ``every`` s in a thread until
    it fits, said (``say``) once it fails and once it fits. A service goes on serving
    meanwhile: its record, or the agent's record of its servers, is written late, not the
    service lost to a full disk (its keeper's restart backing off while it lasts).
    A second call for ``what`` while one waits is dropped: the waiting thread calls its
    own ``write``, which is to write what is current then (not what was at its call)."""
    try:
        write()
        return
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise
        if what in _WAITING:
            return  # a thread tries already (and writes what is current then)
        _WAITING.add(what)
        say(f"cannot write {what} ({exc.strerror}); trying again every {every:g}s")
    began = time.monotonic()

    def again() -> None:
        while True:
            time.sleep(every)
            try:
                write()
            except OSError as exc:
                if exc.errno in FULL_DISK:
                    continue
                say(f"gave up writing {what}: {exc.strerror or exc}")
            else:
                say(f"wrote {what} after {time.monotonic() - began:.0f}s (the disk had room again)")
            _WAITING.discard(what)
            return

    threading.Thread(target=again, name=f"write {what}", daemon=True).start()


def remove_info(state: Path, service: str) -> None:
    path = state / f"{service}.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def spawned_path(state: Path, service: str) -> Path:
    """Where ctl's ``ensure`` notes the process it started for the service (``pid ticks``),
    written by that process itself before it runs the service: a service being started
    is found from the moment it exists, before it records itself (``NAME.json``)."""
    return state / f"{service}.spawned"


def note_spawned(state: Path, service: str) -> None:
    """Called in the started process (its pid, its start time) before it runs the service."""
    me = procfs.stat(os.getpid())
    noted = f"{os.getpid()} {me.started if me else 0}\n"
    write_atomic(spawned_path(state, service), noted, mode=0o644, sync=False)


def spawned(state: Path, service: str) -> int | None:
    """The pid of the process ensure last started for the service, while that process runs
    (a pid on file that is now another process's is not it)."""
    try:
        pid, started = map(int, spawned_path(state, service).read_text().split())
    except (OSError, ValueError):
        return None
    st = procfs.stat(pid)
    return pid if st is not None and st.alive and st.started == started else None


def token(state: Path, service: str, given: str | None = None) -> str:
    """The service's token: ``given`` (written down), else the one on file, else a new one."""
    path = state / f"{service}.token"
    if given is None:
        with contextlib.suppress(OSError):
            existing = path.read_text().strip()
            if existing:
                return existing
        given = secrets.token_urlsafe(24)
    write_atomic(path, given + "\n")
    return given


def stamp() -> bytes:
    """The time a log line is written, as it starts the line: UTC, milliseconds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3].encode() + b"Z "


def unstamped(line: str) -> str:
    """A log line without the time it starts with."""
    head, sep, rest = line.partition("Z ")
    return rest if sep and len(head) == 23 and head[10:11] == "T" else line


def counts_path(state: Path) -> Path:
    """The router's request counts per backend (``router/counts.py``): kept across its
    restarts, begun anew with a new fleet's router."""
    return state / "router.counts"


def restarts(state: Path, service: str) -> int:
    """How many times the service was started again since its fleet first started it."""
    try:
        return int((state / f"{service}.restarts").read_text())
    except (OSError, ValueError):
        return 0


def write_restarts(state: Path, service: str, count: int) -> None:
    """Set the count (0: a fleet's first start; one more at each start after it died)."""
    write_atomic(state / f"{service}.restarts", f"{count}\n")


def count_restarts(state: Path, service: str, count: int) -> None:
    """``write_restarts``, where a count is a view: on a full disk it is left as it was,
    never worth the restart itself (the router's keeper died of it, and no router ran
    until the next `serve up`). The keeper writes its count late (``when_room``)."""
    with contextlib.suppress(OSError):
        write_restarts(state, service, count)


# Which restart of its service a run is (0: the first run), in the environment its keeper
# (``respawn``) starts it with: ``serve status`` reads it from the running service where the
# count on file is behind (a full disk: the keeper writes it once there is room).
RESTART_ENV = "TPUPOD_SERVE_RESTART"


def run_restart(pid: int) -> int | None:
    """The restart the process ``pid`` is (its ``RESTART_ENV``), None when it has none."""
    for item in procfs.environ(pid):
        name, _, value = item.partition(b"=")
        if name == RESTART_ENV.encode() and value.isdigit():
            return int(value)
    return None


# Where a server's own keeper (the builtin server's: it restarts its engine and front end
# itself) counts those restarts, by process: the agent names the file in this variable and
# shows the counts beside its own restarts of the server (``serve status``); the keeper
# reads it with ``settings.child_restarts_file``.
CHILD_RESTARTS_ENV = "TPUPOD_SERVE_CHILD_RESTARTS"


def child_restarts(path: Path) -> dict[str, int]:
    """The restarts on file, by process (``{"engine": 2, "front end": 1}``)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {str(k): v for k, v in found.items() if isinstance(v, int)}


def restarting_path(counted: Path) -> Path:
    """Beside ``NAME.restarts``: the processes of the server being restarted now."""
    return counted.with_suffix(".restarting")


def child_restarting(counted: Path) -> list[str]:
    """The processes of a server that its keeper is restarting now (``["engine"]``): each
    from its death until the server answers its health check again."""
    try:
        found = json.loads(restarting_path(counted).read_text())
    except (OSError, ValueError):
        return []
    return [str(p) for p in found] if isinstance(found, list) else []


def set_child_restarting(counted: Path, processes: list[str]) -> None:
    path = restarting_path(counted)
    if processes:
        write_atomic(path, json.dumps(sorted(processes)) + "\n", mode=0o644, sync=False)
    else:
        path.unlink(missing_ok=True)


def count_child_restart(path: Path, process: str) -> int:
    """One more restart of ``process`` on file; its count now."""
    found = child_restarts(path)
    found[process] = found.get(process, 0) + 1
    write_atomic(path, json.dumps(found) + "\n", mode=0o644, sync=False)
    return found[process]
