"""How each attempt of a job ended, when it did not simply end the job: kept on the job's
row (``history``, JSON), written by whoever ended the attempt (the reaper, a runner giving
it back or retrying it, a runner recording a gone runner's outcome), read by ``jobs show``
(one line per attempt) and ``jobs logs`` (a header where each attempt's lines begin).

The last attempt of a job that ended the ordinary way has no entry: the row itself says
how it ended and on which runner (``runner``, ``scheduled_at``). Plain Python: no
SQLAlchemy, so the readers pay nothing for it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from tpupod.base import procfs

LOST = "lost"  # its runner died or stopped answering: the job runs again (or fails)
GIVEN_BACK = "given back"  # its runner was told to stop
RETRIED = "retried"  # the program failed and --retries (or the cluster) runs it again
RECOVERED = "recovered"  # it ended on a runner that died before recording it; recorded after
LATE = "late"  # as RECOVERED, but another attempt had begun meanwhile


@dataclass(frozen=True)
class Entry:
    """One attempt that ended without (or before) its ending being the job's."""

    attempt: int
    runner: str | None
    started: float | None
    ended: float
    how: str
    why: str  # in a person's words: "runner h:12:ab lost (its process is gone) while running"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_history(text: str | None) -> tuple[Entry, ...]:
    """The entries stored as ``text`` (None: a job without any)."""
    if not text:
        return ()
    return tuple(Entry(**item) for item in json.loads(text))


def counted(attempt: int, entries: tuple[Entry, ...]) -> int:
    """Of a job's ``attempt`` attempts so far, those that count against its max_attempts:
    not those a runner gave back (it was told to stop: neither the program's failure nor a
    lost runner's, and a user stopping runners must not use up the job's attempts)."""
    return attempt - sum(1 for e in entries if e.how == GIVEN_BACK and e.attempt <= attempt)


def add_entry(text: str | None, entry: Entry) -> str:
    """``text`` with ``entry`` in it, in place of an earlier entry of the same attempt."""
    kept = [e for e in load_history(text) if e.attempt != entry.attempt]
    return json.dumps([e.to_dict() for e in sorted([*kept, entry], key=lambda e: e.attempt)])


def lost_cause(owner: str, dead: frozenset[str] = frozenset()) -> str:
    """Why a runner is taken for lost, as far as this machine can tell: its process is gone
    (it held a journal here that nobody holds now, or it ran here and its pid is free), or
    only its lease expired (it is elsewhere, or still here but silent: stopped, hung)."""
    if owner in dead:
        return "its process is gone"
    here = _pid_here(owner)
    if here is None:
        return "its lease expired"
    if process_gone(owner):
        return "its process is gone"
    return f"its lease expired; process {here} is still there (stopped? hung?)"


def process_gone(owner: str) -> bool:
    """Whether the runner ``owner`` (``host:pid:token``) provably ended: it ran on this
    machine and its pid is free, or a zombie's. Never wrongly: a pid since reused by
    another process reads as still there, and a runner elsewhere is never known gone."""
    pid = _pid_here(owner)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    found = procfs.stat(pid)  # killed, but its parent has not reaped it yet
    return found is not None and not found.alive


def _pid_here(owner: str) -> int | None:
    """The pid of the runner ``owner`` if it ran on this machine."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    return int(pid_text)


def when(stamp: float | None) -> str:
    """A time as the headers and ``show`` print it (UTC)."""
    if stamp is None:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))
