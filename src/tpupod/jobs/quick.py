"""``tpupod jobs submit`` without the CLI framework or SQLAlchemy: its fast path.

Submitting is the job command people run most, and importing typer, pydantic and
SQLAlchemy cost it about a second before any work. When the arguments are plain and
the store exists at this tpupod's schema version, the console script checks the
request here and inserts the row with the database's own driver (sqlite3, psycopg).
Anything else (``--help``, ``--wait``, a JSON document, anything to explain, a store
to create or migrate, a database that does not answer) gives None, and the typer
command, the reference for what the options mean, does it. Both write ``job_row``;
tests check that both paths store the same row and refuse the same input.
"""

from __future__ import annotations

import getpass
import json
import math
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpupod import settings
from tpupod.base.envargs import parse_pairs
from tpupod.cli.args import OptionTable, scan
from tpupod.errors import JobStoreError, PodNotFound, UsageError
from tpupod.extras import missing
from tpupod.jobs.code import syntax_problem

SCHEMA_VERSION = 2  # schema.py's latest migration (a test checks they agree)
JOBS_TABLE = "tpupod_jobs"
VERSION_TABLE = "tpupod_jobs_schema"
NOTIFY_CHANNEL = "tpupod_jobs"
DB_FILE = "jobs.db"
MAX_ATTEMPTS = 100  # JobRequest's bound

SUBMIT_OPTIONS = OptionTable(
    valued={
        "--db": "db",
        "--pod": "pod",
        "--name": "name",
        "--priority": "priority",
        "--timeout": "timeout",
        "--max-attempts": "max_attempts",
        "--retries": "retries",
    },
    repeated={"--label": "label", "-l": "label"},
    flags={"--remote-pod": "remote_pod"},
)


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


def fast_submit(argv: list[str]) -> int | None:
    """Submit and print the id (exit 0); None when the typer command should do it."""
    if missing("jobs"):
        return None  # the typer command checks the extra and says what is missing
    scanned = scan(argv, SUBMIT_OPTIONS)
    if scanned is None:
        return None
    fields = _fields(scanned.values, scanned.lists, scanned.rest, dashed="--" in argv)
    if fields is None:
        return None
    try:
        check_pod(fields["pod"], "remote_pod" in scanned.flags)
    except PodNotFound:
        return None  # the typer command says why
    try:
        job_id = insert(scanned.values.get("db") or default_url(), job_row(fields, time.time()))
    except JobStoreError as exc:
        from tpupod.fanout.report import report_failure

        return report_failure(exc)
    if job_id is None:
        return None
    print(job_id, flush=True)
    return 0


def _fields(
    values: dict[str, str], lists: dict[str, list[str]], rest: list[str], *, dashed: bool
) -> dict[str, Any] | None:
    """A plain request's fields, or None for anything the typer command must explain."""
    try:
        labels = parse_pairs(lists.get("label"), option="--label", example="team=ml")
    except UsageError:
        return None  # the typer command says what is wrong
    try:
        priority = int(values.get("priority", "0"))
        retries = int(values.get("retries", "0"))
        attempts = int(values.get("max_attempts", str(attempts_for(retries))))
        timeout = float(values["timeout"]) if "timeout" in values else None
    except ValueError:
        return None
    if not 0 <= retries < attempts <= MAX_ATTEMPTS:
        return None
    if timeout is not None and not 0 < timeout < math.inf:
        return None
    code = command = None
    if dashed or len(rest) > 1 or (rest and not rest[0].endswith((".py", ".json"))):
        if not rest or (not dashed and any(arg.startswith("-") for arg in rest)):
            return None  # an option after the arguments: typer reads those
        if not any(arg.strip() for arg in rest):
            return None
        import shlex

        command = rest[0] if len(rest) == 1 else shlex.join(rest)
    elif rest and rest[0].endswith(".py") and Path(rest[0]).is_file():
        code = Path(rest[0]).read_text()
        if not code.strip() or syntax_problem(code) is not None:
            return None
    else:
        return None  # a JSON document (pydantic reads it), or no such file
    return {
        "name": values.get("name", ""),
        "code": code,
        "command": command,
        "labels": labels,
        "priority": priority,
        "timeout": timeout,
        "pod": values.get("pod"),
        "max_attempts": attempts,
        "retries": retries,
        "metadata": {},
    }


def insert(url: str, row: dict[str, Any]) -> int | None:
    """Insert ``row`` into an existing store at this schema version; its id, or None
    (nothing written) when the typer command should do it."""
    if url.startswith("sqlite:///"):
        return _insert_sqlite(url.split("sqlite:///", 1)[1], row)
    if url.startswith(("postgresql://", "postgres://")):
        return _insert_postgres(url, row)
    return None


def _insert_sql(row: dict[str, Any], mark: str) -> str:
    names = ", ".join(row)
    marks = ", ".join(mark for _ in row)
    return f"INSERT INTO {JOBS_TABLE} ({names}) VALUES ({marks})"


def _insert_sqlite(path: str, row: dict[str, Any]) -> int | None:
    import sqlite3

    if path in ("", ":memory:") or not Path(path).is_file():
        return None
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=NORMAL")  # as the store's connections
        conn.execute("BEGIN IMMEDIATE")
        if conn.execute(f"SELECT version FROM {VERSION_TABLE}").fetchone() != (SCHEMA_VERSION,):
            return None  # closing rolls back
        job_id = conn.execute(_insert_sql(row, "?"), list(row.values())).lastrowid
        conn.execute("COMMIT")
    except sqlite3.Error:
        return None  # not committed: the typer command tries, and explains
    finally:
        conn.close()
    return job_id


def _insert_postgres(url: str, row: dict[str, Any]) -> int | None:
    try:
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
            added = conn.execute(_insert_sql(row, "%s") + " RETURNING id", list(row.values()))
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
