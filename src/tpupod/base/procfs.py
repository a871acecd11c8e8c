"""Reading this machine's process table from /proc (Linux), for local pods."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    state: str
    pgrp: int
    started: int  # clock ticks after boot: with the pid, one process (a pid is reused)

    @property
    def alive(self) -> bool:
        """Running or sleeping; a zombie waiting to be reaped is not alive."""
        return self.state not in ("Z", "X")


def pids() -> Iterator[int]:
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    yield from (int(e) for e in entries if e.isdigit())


def stat(pid: int) -> ProcStat | None:
    """The process's state and process group, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return ProcStat(pid=pid, state=fields[0].decode(), pgrp=int(fields[2]), started=int(fields[19]))


def alive(pid: int) -> bool:
    """The process exists and is not a zombie: one killed under a parent that never reaps it
    (PID 1 of a container or a simulated host) is gone too."""
    st = stat(pid)
    return st is not None and st.alive


def environ(pid: int) -> list[bytes]:
    """The process's environment as ``NAME=value`` items; empty when unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def cwd(pid: int) -> str:
    """The process's working directory ("" if it is gone or not ours to read)."""
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def cmdline(pid: int) -> list[str]:
    """The process's command line; empty when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []
