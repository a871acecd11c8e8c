"""A runner's journal of outcomes the store does not have yet: how each attempt it ran
ended, kept on this machine's disk from the moment the attempt ends until the store has
its ending, so that a runner killed in between (a ``kill -9`` while the database was
away) does not take the outcome with it, and the job does not run again.

One file per runner, ``<state>/jobs/outcomes/<store>/<runner>.journal``: JSON lines,
appended with one ``write`` each (a process killed mid-way leaves at most a torn last
line, skipped when read). A runner holds an exclusive ``flock`` on its own journal for
as long as it lives: a journal nobody holds belongs to a runner that is gone (the lock
dies with its process, even by ``kill -9``; no pid to be reused), and every runner of
this store on this state directory looks for such journals before it reaps. The one that
locks a journal records its outcomes (``claims.adopt``), reaps what that runner still
held at once (its process is known gone: no lease to wait out) and removes the file.

The records: ``{"lines": [job, attempt, first, [[worker, text], ...]]}`` (lines the store
did not have when the attempt ended, from offset ``first``), ``{"end": {...}}`` (the
ending to write: ``action`` "end" or "retry", status, result, error) and ``{"done": [job,
attempt]}`` once the store has it (or another runner took the job).

Written at once (the kernel has it: a killed process loses nothing); ``fsync``-ed as soon
as the store fails to take a write, so that an outcome waiting through an outage also
survives the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tpupod import settings
from tpupod.jobs.store import store_label

Key = tuple[int, int]  # (job id, attempt)
Line = tuple[int, str]
COMPACT_BYTES = 1 << 20  # a journal with nothing pending is emptied past this size


def journal_folder(store_url: str) -> Path:
    """Where the runners of the store at ``store_url`` keep their journals here."""
    return settings.state_home() / "jobs" / "outcomes" / store_label(store_url)


def _file_name(owner: str) -> str:
    return re.sub(r"[^\w.:-]", "_", owner) + ".journal"


@dataclass(frozen=True)
class Kept:
    """An attempt's outcome as a journal kept it."""

    job_id: int
    attempt: int
    owner: str
    action: str  # "end": the ending below; "retry": run it again (or fail at max_attempts)
    status: str
    result: str | None
    error: str | None
    ended: float

    @property
    def key(self) -> Key:
        return (self.job_id, self.attempt)

    def record(self) -> dict[str, Any]:
        return {
            "end": {
                "job": self.job_id,
                "attempt": self.attempt,
                "owner": self.owner,
                "action": self.action,
                "status": self.status,
                "result": self.result,
                "error": self.error,
                "ended": self.ended,
            }
        }


class Journal:
    """This runner's journal: created and locked on open, removed on close when nothing in
    it waits for the store (kept for the next runner otherwise)."""

    def __init__(self, folder: Path, owner: str) -> None:
        self.path = folder / _file_name(owner)
        self.owner = owner
        for tries_left in range(3, 0, -1):  # another runner may remove the folder meanwhile
            folder.mkdir(parents=True, exist_ok=True)
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                break
            except FileNotFoundError:
                if tries_left == 1:
                    raise
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody has it
        self.pending: set[Key] = set()
        self._dirty = False  # written since the last fsync
        self._write({"owner": owner})

    def keep(self, kept: Kept, first: int, lines: Iterable[list[Line]]) -> None:
        """The attempt's lines from offset ``first`` the store may not have, then its ending."""
        at = first
        for batch in lines:
            self._write({"lines": [kept.job_id, kept.attempt, at, batch]})
            at += len(batch)
        self._write(kept.record())
        self.pending.add(kept.key)

    def done(self, key: Key) -> None:
        """The store has the attempt's ending (or another runner has the job)."""
        if key not in self.pending:
            return
        self.pending.discard(key)
        self._write({"done": list(key)})
        if not self.pending and os.fstat(self._fd).st_size > COMPACT_BYTES:
            os.ftruncate(self._fd, 0)  # appends go on from the start
            self._write({"owner": self.owner})

    def sync(self) -> None:
        """To the disk, if anything was written since the last time."""
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False

    def close(self) -> None:
        """Removed when nothing waits in it (and its folder, if no other runner's is
        there); else left (synced) for the next runner."""
        if not self.pending:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            with contextlib.suppress(OSError):  # not empty: another runner's journal
                self.path.parent.rmdir()
        else:
            self.sync()
        os.close(self._fd)

    def _write(self, record: dict[str, Any]) -> None:
        data = memoryview((json.dumps(record) + "\n").encode())
        while data:
            data = data[os.write(self._fd, data) :]
        self._dirty = True


@dataclass
class Orphan:
    """The journal of a runner that is gone, locked by this one while it records it."""

    path: Path
    owner: str
    file: IO[bytes]
    pending: dict[Key, Kept] = field(default_factory=dict)
    line_at: dict[Key, list[int]] = field(default_factory=dict)  # offsets of its lines records

    def lines(self, kept: Kept) -> Iterator[tuple[int, list[Line]]]:
        """(first offset, lines) for each batch the journal kept of ``kept``'s attempt."""
        for offset in self.line_at.get(kept.key, []):
            self.file.seek(offset)
            _, _, first, batch = json.loads(self.file.readline())["lines"]
            yield first, [(int(worker), str(text)) for worker, text in batch]

    def remove(self) -> None:
        """Everything in it is recorded: the file goes, then the lock."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.file.close()


def orphans(folder: Path, *, skip: Iterable[Path] = ()) -> list[Orphan]:
    """The journals in ``folder`` that no live runner holds (``skip``: paths this runner
    has already, its own among them), each locked now by this runner."""
    found: list[Orphan] = []
    if not folder.is_dir():
        return found
    passed = set(skip)
    for path in sorted(folder.glob("*.journal")):
        if path in passed:
            continue
        orphan = _lock(path)
        if orphan is not None:
            found.append(orphan)
    return found


def _lock(path: Path) -> Orphan | None:
    try:
        file = path.open("rb")
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(file.fileno()).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError(path)  # removed (by another runner) before we locked it
    except (BlockingIOError, FileNotFoundError):  # its runner lives, or it is gone already
        file.close()
        return None
    return _read(path, file)


def _read(path: Path, file: IO[bytes]) -> Orphan:
    orphan = Orphan(path, owner="", file=file)
    while True:
        offset = file.tell()
        raw = file.readline()
        if not raw:
            break
        try:
            record = json.loads(raw)
        except ValueError:  # a torn last line: its runner died writing it
            continue
        if "owner" in record:
            orphan.owner = str(record["owner"])
        elif "lines" in record:
            job_id, attempt = record["lines"][:2]
            orphan.line_at.setdefault((job_id, attempt), []).append(offset)
        elif "end" in record:
            end = record["end"]
            kept = Kept(
                end["job"],
                end["attempt"],
                end["owner"],
                end["action"],
                end["status"],
                end["result"],
                end["error"],
                end["ended"],
            )
            orphan.pending[kept.key] = kept
        elif "done" in record:
            key = (record["done"][0], record["done"][1])
            orphan.pending.pop(key, None)
            orphan.line_at.pop(key, None)
    return orphan
