"""How an idle runner waits for work: PostgreSQL's LISTEN/NOTIFY (woken by a submit, a
requeue or a released job, no busy polling), or a short sleep on SQLite (one machine,
no server to tell us)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from tpupod.jobs.store import NOTIFY_CHANNEL, Store

SQLITE_POLL_S = 0.1


class Wakeup:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.conn: Any = None

    async def wait(self, timeout: float) -> None:
        """Return at the next notification, or after ``timeout`` seconds (cancellable)."""
        if not self.store.postgres:
            await asyncio.sleep(min(timeout, SQLITE_POLL_S))
            return
        try:
            await self._listen(timeout)
        except Exception:  # psycopg.Error: the server went away; the next claim says so
            await self.close()
            await asyncio.sleep(min(timeout, 0.5))

    async def _listen(self, timeout: float) -> None:
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
