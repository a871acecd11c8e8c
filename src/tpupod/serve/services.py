"""A worker's serving services (the agent, the router) as files in its state folder: each
records ``NAME.json`` (pid, host, port) once it listens and keeps its bearer token in
``NAME.token`` (mode 0600). What the services write and ``ctl`` reads, shared by every
process of the fleet on a worker, so none reaches into another's module."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from tpupod import procfs
from tpupod.files import write_atomic

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
