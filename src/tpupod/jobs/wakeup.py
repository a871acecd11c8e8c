"""How an idle runner waits for work: PostgreSQL's LISTEN/NOTIFY (woken by a submit, a
requeue or a released job, no busy polling); on SQLite (one machine, no server to tell
us) it watches the database's write-ahead log: any commit changes the file's size or
time, which a ``stat`` every few milliseconds sees at almost no cost, and only then does
the runner query. It claims at least every ``SQLITE_POLL_S`` anyway (a change the stat
cannot see: the log rewritten in place after a checkpoint within one clock tick)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from tpupod.jobs.rows import NOTIFY_CHANNEL
from tpupod.jobs.store import Store

SQLITE_POLL_S = 0.1
SQLITE_WATCH_S = 0.004


class Wakeup:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.conn: Any = None

    async def wait(self, timeout: float) -> None:
        """Return at the next notification, or after ``timeout`` seconds (cancellable)."""
        if not self.store.postgres:
            await self._watch(min(timeout, SQLITE_POLL_S))
            return
        try:
            await self._listen(timeout)
        except Exception:  # psycopg.Error: the server went away; the next claim says so
            await self.close()
            await asyncio.sleep(min(timeout, 0.5))

    async def _watch(self, timeout: float) -> None:
        database = self.store.engine.url.database
        if not database or database == ":memory:":
            await asyncio.sleep(timeout)
            return
        wal = f"{database}-wal"
        seen = file_state(wal)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            await asyncio.sleep(SQLITE_WATCH_S)
            if file_state(wal) != seen:
                return

    async def _listen(self, timeout: float) -> None:
        # the jobs extra's: a PostgreSQL store only
        import psycopg

        if self.conn is None or self.conn.closed:
            url = self.store.engine.url.set(drivername="postgresql")
            self.conn = await psycopg.AsyncConnection.connect(
                url.render_as_string(hide_password=False), autocommit=True
            )
            await self.conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        async for _ in self.conn.notifies(timeout=timeout, stop_after=1):
            pass

    async def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
            self.conn = None


def file_state(path: str) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of ``path``, None if it is missing: a commit changes one of a
    SQLite database's files (the runner's wakeup and the dashboard's job counts watch them)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_ino, found.st_size, found.st_mtime_ns)
