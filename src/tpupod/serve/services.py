"""A worker's serving services (the agent, the router) as files in its state folder: each
records ``NAME.json`` (pid, host, port) once it listens and keeps its bearer token in
``NAME.token`` (mode 0600); the router counts its restarts in ``router.restarts``. Log
lines start with their UTC time (``stamp``). What the services write and ``ctl`` reads,
shared by every process of the fleet on a worker, so none reaches into another's module."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tpupod.base import procfs
from tpupod.base.files import write_atomic

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


def remove_info(state: Path, service: str) -> None:
    path = state / f"{service}.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


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


def restarts(state: Path, service: str) -> int:
    """How many times the service was started again since its fleet first started it."""
    try:
        return int((state / f"{service}.restarts").read_text())
    except (OSError, ValueError):
        return 0


def count_restarts(state: Path, service: str, count: int) -> None:
    """Set the count (0: a fleet's first start; one more at each start after it died)."""
    write_atomic(state / f"{service}.restarts", f"{count}\n")
