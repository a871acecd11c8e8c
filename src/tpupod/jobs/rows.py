"""The job store's names and a new job's row, in plain Python (no SQLAlchemy): what the
store (``store.py``, ``schema.py``, ``wakeup.py``) and ``jobs submit``'s fast path share.

A new job is one row made by :func:`job_row` and added by the one INSERT statement
:func:`insert_sql` spells: the store runs it through SQLAlchemy's connection, the fast path
(:func:`insert`) through the database's own driver (sqlite3, psycopg), which spares it
importing SQLAlchemy (about half a second of a plain submit).
"""

from __future__ import annotations

import getpass
import json
import re
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tpupod import settings
from tpupod.errors import JobStoreAway, JobStoreError, PodNotFound, UsageError

SCHEMA_VERSION = 3  # schema.py's latest migration: it checks they agree
JOBS_TABLE = "tpupod_jobs"
VERSION_TABLE = "tpupod_jobs_schema"
NOTIFY_CHANNEL = "tpupod_jobs"
DB_FILE = "jobs.db"
MAX_ATTEMPTS = 100  # what a job may ask for (JobRequest's bound)


RETRY_S = 0.5  # while the store is away
START_WAIT_S = 60.0  # a service (runner, API) starting waits this long for a store away
# what PostgreSQL answers a connection it cannot take now (SQLSTATE 57P03, 53300)
_NOT_NOW = re.compile(
    r"FATAL:\s+(the database system is|sorry, too many clients|remaining connection slots)"
)


def away_words(text: str, sqlstate: str | None) -> bool:
    """libpq's words (``text``) for a server that is not answering now: a connection that
    failed without the server's word (refused, reset, timed out) or with its word that it
    cannot take one now. libpq gives a failed connect no SQLSTATE; a query the server
    rejected has one."""
    if sqlstate:
        return False
    return "FATAL:" not in text or _NOT_NOW.search(text) is not None


class Outage:
    """The store's absence as a person hears of it: one line when it starts (``away``),
    one when it ends with its length (``back``), nothing between the retries."""

    def __init__(self, say: Callable[[str], None] | None, prefix: str = "") -> None:
        self.say = say or (lambda text: None)
        self.prefix = prefix
        self.since: float | None = None  # away since (monotonic)
        self.back_at = float("-inf")  # when it last came back (monotonic)

    def away(self, exc: JobStoreError, then: str = "retrying until it is back") -> None:
        if self.since is None:
            self.since = time.monotonic()
            self.say(f"{self.prefix}{exc.message}; {then}")

    def back(self) -> None:
        if self.since is not None:
            took = time.monotonic() - self.since
            self.since, self.back_at = None, time.monotonic()
            self.say(f"{self.prefix}the job store is back after {took:.1f} s")


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}" if ":" in creds else url


def default_url() -> str:
    """``TPUPOD_JOBS_DB``, else ``jobs.db`` (SQLite) in the state directory."""
    return settings.jobs_db() or f"sqlite:///{settings.state_home() / DB_FILE}"


def job_row(fields: Mapping[str, Any], now: float, key: str | None = None) -> dict[str, Any]:
    """The row a new job is stored as (``fields``: a ``JobRequest``'s; ``key``: the
    submitter's idempotency key, if any)."""
    who = {"submitted_by": f"{getpass.getuser()}@{socket.gethostname()}"}
    return {
        "name": fields["name"],
        "status": "pending",
        "code": fields["code"],
        "command": fields["command"],
        "labels": json.dumps(fields["labels"], sort_keys=True),
        "priority": fields["priority"],
        "timeout_s": fields["timeout"],
        "pod": fields["pod"],
        "attempt": 0,
        "max_attempts": fields["max_attempts"],
        "retries": fields["retries"],
        "cancel_requested": False,
        "created_at": now,
        "updated_at": now,
        "run_after": 0.0,
        "metadata": json.dumps(who | dict(fields["metadata"]), sort_keys=True, default=str),
        "submit_key": key,
    }


KEY_CHARS = 64  # the column's width


def new_submit_key() -> str:
    """A key for one submit: the same submit sent again (its answer lost: a connection
    dropped at the commit) finds the job it added instead of adding another."""
    return secrets.token_hex(16)


def check_key(key: str) -> str:
    """A submitter's own key (``--key``, the API's ``Idempotency-Key``), checked."""
    if not 1 <= len(key) <= KEY_CHARS or not key.isprintable() or not key.isascii():
        raise UsageError(
            f"the submit key {key[:80]!r} is not 1 to {KEY_CHARS} printable ASCII characters",
            hint="e.g. --key nightly-2026-01-05 (the same key again adds no second job)",
        )
    return key


def find_sql(mark: str) -> str:
    """The job a submit key already added: id, code, command."""
    return f"SELECT id, code, command FROM {JOBS_TABLE} WHERE submit_key = {mark}"


def same_submit(found: Sequence[Any], row: Mapping[str, Any]) -> bool:
    """Whether the job ``found`` (``find_sql``'s row) is the one ``row`` would add."""
    return (found[1], found[2]) == (row["code"], row["command"])


def key_taken(key: str, job_id: int) -> UsageError:
    return UsageError(
        f"the submit key {key!r} is job {job_id}'s, which runs something else",
        hint="a key stands for one job: give a new key for a new job",
    )


def attempts_for(retries: int) -> int:
    """``--max-attempts`` when not given: 3, or enough for ``--retries``."""
    return max(3, retries + 1)


def check_pod(pod: str | None, remote: bool, how: str = "add --remote-pod") -> None:
    """A job for a pod this machine does not know would wait for a runner that never
    comes: refused, unless its runner is elsewhere (``--remote-pod``; ``how`` says so)."""
    if pod is None or remote:
        return
    # a job for a pod only: jobs submit's fast path imports this module
    from tpupod.pod.state import StateDir

    state = StateDir()
    if state.exists(pod):
        return
    known = ", ".join(state.names())
    where = f"the pods here: {known}" if known else "no pods here yet ('tpupod up')"
    raise PodNotFound(
        f"no pod named {pod!r}: no runner would take the job",
        hint=f"{where}; a pod whose runner is on another machine: {how}",
    )


def insert(url: str, row: dict[str, Any], say: Callable[[str], None] | None = None) -> int | None:
    """Insert ``row`` into an existing store at this schema version; its id, or None
    (nothing written) when the typer command should do it. A PostgreSQL server that is
    away is waited for (up to ``START_WAIT_S``; ``say`` hears when that starts and ends);
    the row's ``submit_key`` makes a try sent again after a dropped connection find the
    job the first one added, if it did."""
    if url.startswith("sqlite:///"):
        return _insert_sqlite(url.split("sqlite:///", 1)[1], row)
    if url.startswith(("postgresql://", "postgres://")):
        return _insert_postgres(url, row, say)
    return None


def insert_sql(columns: list[str], mark: str) -> str:
    """The INSERT that adds a job's row (``columns``: ``job_row``'s keys), its id returned;
    ``mark`` is the driver's placeholder (``?`` for sqlite3, ``%s`` for psycopg)."""
    names = ", ".join(columns)
    marks = ", ".join(mark for _ in columns)
    return f"INSERT INTO {JOBS_TABLE} ({names}) VALUES ({marks}) RETURNING id"


def _insert_sqlite(path: str, row: dict[str, Any]) -> int | None:
    # a SQLite store only: --help imports this module too
    import sqlite3

    if path in ("", ":memory:") or not Path(path).is_file():
        return None
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=NORMAL")  # as the store's connections
        conn.execute("BEGIN IMMEDIATE")
        if conn.execute(f"SELECT version FROM {VERSION_TABLE}").fetchone() != (SCHEMA_VERSION,):
            return None  # closing rolls back
        found = conn.execute(find_sql("?"), [row["submit_key"]]).fetchone()
        if found is not None:  # a key given again (--key)
            return int(found[0]) if same_submit(found, row) else None
        job_id = int(conn.execute(insert_sql(list(row), "?"), list(row.values())).fetchone()[0])
        conn.execute("COMMIT")
    except sqlite3.Error:
        return None  # not committed: the typer command tries, and explains
    finally:
        conn.close()
    return job_id


class _Away(Exception):
    """The PostgreSQL server is not answering now, or the connection broke."""


def _insert_postgres(
    url: str, row: dict[str, Any], say: Callable[[str], None] | None
) -> int | None:
    try:
        # the jobs extra's: a PostgreSQL store only
        import psycopg
    except ImportError:
        return None
    outage = Outage(say)
    began = time.monotonic()
    while True:
        try:
            job_id = _postgres_once(psycopg, url, row)
        except _Away as exc:
            away = JobStoreAway(
                f"job store {redact(url)}: {exc}",
                hint="check that the database is up and reachable (--db or TPUPOD_JOBS_DB)",
            )
            if time.monotonic() - began >= START_WAIT_S:
                raise away from exc
            outage.away(away, f"waiting up to {START_WAIT_S:.0f} s for it")
            time.sleep(RETRY_S)
            continue
        outage.back()
        return job_id


def _postgres_once(psycopg: Any, url: str, row: dict[str, Any]) -> int | None:
    """One try: the job's id (added now, or found by its key: an earlier try's commit
    whose answer was lost), or None (nothing written: the typer command explains).
    ``_Away`` when the server is away or the connection broke, even at the commit: the
    next try finds by the key whether that commit happened."""
    try:
        conn = psycopg.connect(url, connect_timeout=10)
    except psycopg.OperationalError as exc:
        if away_words(str(exc), exc.sqlstate):
            raise _Away(_first_line(exc)) from exc
        return None
    except psycopg.Error:
        return None
    with conn:
        try:
            if conn.execute(f"SELECT version FROM {VERSION_TABLE}").fetchone() != (SCHEMA_VERSION,):
                conn.rollback()
                return None
            found = conn.execute(find_sql("%s"), [row["submit_key"]]).fetchone()
            if found is not None:
                conn.rollback()
                return int(found[0]) if same_submit(found, row) else None
            added = conn.execute(insert_sql(list(row), "%s"), list(row.values()))
            job_id = int(added.fetchone()[0])
            conn.execute(f"NOTIFY {NOTIFY_CHANNEL}")  # wakes idle runners at the commit
            conn.commit()
        except psycopg.OperationalError as exc:
            if conn.broken or away_words(str(exc), exc.sqlstate):
                raise _Away(_first_line(exc)) from exc
            conn.rollback()
            return None
        except psycopg.Error:  # refused before its commit: nothing written
            conn.rollback()
            return None
    return job_id


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
