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
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpupod import settings
from tpupod.errors import JobStoreError, PodNotFound

SCHEMA_VERSION = 2  # schema.py's latest migration: it checks they agree
JOBS_TABLE = "tpupod_jobs"
VERSION_TABLE = "tpupod_jobs_schema"
NOTIFY_CHANNEL = "tpupod_jobs"
DB_FILE = "jobs.db"
MAX_ATTEMPTS = 100  # what a job may ask for (JobRequest's bound)


def default_url() -> str:
    """``TPUPOD_JOBS_DB``, else ``jobs.db`` (SQLite) in the state directory."""
    return settings.jobs_db() or f"sqlite:///{settings.state_home() / DB_FILE}"


def job_row(fields: Mapping[str, Any], now: float) -> dict[str, Any]:
    """The row a new job is stored as (``fields``: a ``JobRequest``'s)."""
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
    }


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


def insert(url: str, row: dict[str, Any]) -> int | None:
    """Insert ``row`` into an existing store at this schema version; its id, or None
    (nothing written) when the typer command should do it."""
    if url.startswith("sqlite:///"):
        return _insert_sqlite(url.split("sqlite:///", 1)[1], row)
    if url.startswith(("postgresql://", "postgres://")):
        return _insert_postgres(url, row)
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
        job_id = int(conn.execute(insert_sql(list(row), "?"), list(row.values())).fetchone()[0])
        conn.execute("COMMIT")
    except sqlite3.Error:
        return None  # not committed: the typer command tries, and explains
    finally:
        conn.close()
    return job_id


def _insert_postgres(url: str, row: dict[str, Any]) -> int | None:
    try:
        # the jobs extra's: a PostgreSQL store only
        import psycopg
    except ImportError:
        return None
    try:
        conn = psycopg.connect(url, connect_timeout=10)
    except psycopg.Error:
        return None
    with conn:
        try:
            found = conn.execute(f"SELECT version FROM {VERSION_TABLE}").fetchone()
            if found != (SCHEMA_VERSION,):
                conn.rollback()
                return None
            added = conn.execute(insert_sql(list(row), "%s"), list(row.values()))
            job_id = int(added.fetchone()[0])  # type: ignore[index]
            conn.execute(f"NOTIFY {NOTIFY_CHANNEL}")  # wakes idle runners at the commit
        except psycopg.Error:
            conn.rollback()
            return None
        try:
            conn.commit()
        except psycopg.Error as exc:  # written or not, we cannot tell: never submit twice
            raise JobStoreError(
                f"the job store did not confirm the submit: {str(exc).strip()}",
                hint="'tpupod jobs ls' shows whether the job is there",
            ) from exc
    return job_id
