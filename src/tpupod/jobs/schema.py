"""The job store's tables and their migrations (one schema, SQLite and PostgreSQL).

Times are UNIX seconds (floats) so both databases compare them the same way. Log lines
live in their own table, never on the job row: a busy job writes many, and a job row
stays small for the claim query. ``tpupod_jobs_schema`` holds the version; ``migrate``
applies what is missing, under a lock, so runners started together migrate once.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Column,
    Connection,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    inspect,
    select,
    text,
)

from tpupod.jobs.models import JobStatus
from tpupod.jobs.rows import JOBS_TABLE, SCHEMA_VERSION, VERSION_TABLE

metadata = MetaData()

STATUSES = ", ".join(f"'{s.value}'" for s in JobStatus)

version_table = Table(VERSION_TABLE, metadata, Column("version", Integer, nullable=False))

jobs = Table(
    JOBS_TABLE,
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(200), nullable=False, default=""),
    Column("status", String(16), nullable=False),
    Column("code", Text),
    Column("command", Text),
    Column("labels", Text, nullable=False, default="{}"),  # JSON {name: value}
    Column("priority", Integer, nullable=False, default=0),
    Column("timeout_s", Float),
    Column("pod", String(200)),  # None: any runner may take it
    Column("attempt", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False, default=3),
    # program failures run again up to this many times (v2; lost runners: max_attempts)
    Column("retries", Integer, nullable=False, default=0, server_default="0"),
    Column("lease_owner", String(200)),
    Column("lease_expires_at", Float),
    Column("run_after", Float, nullable=False, default=0.0),  # backoff after a lost lease
    Column("cancel_requested", Boolean, nullable=False, default=False),
    Column("created_at", Float, nullable=False),
    Column("scheduled_at", Float),
    Column("started_at", Float),
    Column("completed_at", Float),
    Column("updated_at", Float, nullable=False),
    Column("result", Text),
    Column("error", Text),
    Column("metadata", Text, nullable=False, default="{}"),  # JSON, e.g. submitted_by
    # v3: the runner of the latest attempt (kept when it ends), the attempts before it and
    # how each ended (JSON list, see ``history.py``), and the submitter's idempotency key
    Column("runner", String(200)),
    Column("history", Text),
    Column("submit_key", String(64)),
    CheckConstraint(f"status IN ({STATUSES})", name="tpupod_jobs_status"),
    CheckConstraint("(code IS NULL) <> (command IS NULL)", name="tpupod_jobs_one_body"),
)

# The claim reads only pending rows in priority order; the reaper only leased ones.
Index(
    "tpupod_jobs_pending",
    jobs.c.priority.desc(),
    jobs.c.id,
    postgresql_where=jobs.c.status == "pending",
    sqlite_where=jobs.c.status == "pending",
)
Index(
    "tpupod_jobs_leased",
    jobs.c.lease_expires_at,
    postgresql_where=jobs.c.status.in_(["scheduled", "running"]),
    sqlite_where=jobs.c.status.in_(["scheduled", "running"]),
)
Index("tpupod_jobs_created", jobs.c.created_at)
# a submit sent again (its answer lost) finds its job instead of adding it twice
SUBMIT_KEY = Index("tpupod_jobs_submit_key", jobs.c.submit_key, unique=True)

log_lines = Table(
    "tpupod_job_logs",
    metadata,
    Column("job_id", Integer, ForeignKey("tpupod_jobs.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),  # the line's offset in the job's log, from 1
    Column("attempt", Integer, nullable=False),
    Column("worker", Integer, nullable=False),
    Column("line", Text, nullable=False),
    PrimaryKeyConstraint("job_id", "seq"),
)


def _v1(conn: Connection) -> None:
    metadata.create_all(conn, tables=[jobs, log_lines])  # today's shape: v2's column too


def _v2(conn: Connection) -> None:
    """``retries``; a store made by this tpupod's ``_v1`` has it already."""
    if "retries" not in {c["name"] for c in inspect(conn).get_columns(JOBS_TABLE)}:
        conn.execute(
            text(f"ALTER TABLE {JOBS_TABLE} ADD COLUMN retries INTEGER NOT NULL DEFAULT 0")
        )


def _v3(conn: Connection) -> None:
    """``runner``, ``history``, ``submit_key`` and its unique index (a store made by this
    tpupod's ``_v1`` has them already)."""
    have = {c["name"] for c in inspect(conn).get_columns(JOBS_TABLE)}
    added = (("runner", "VARCHAR(200)"), ("history", "TEXT"), ("submit_key", "VARCHAR(64)"))
    for name, kind in added:
        if name not in have:
            conn.execute(text(f"ALTER TABLE {JOBS_TABLE} ADD COLUMN {name} {kind}"))
    if SUBMIT_KEY.name not in {i["name"] for i in inspect(conn).get_indexes(JOBS_TABLE)}:
        SUBMIT_KEY.create(conn)


# version -> what brings the schema from version - 1 to it
MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _v1, 2: _v2, 3: _v3}
LATEST = max(MIGRATIONS)
if LATEST != SCHEMA_VERSION:  # the fast submit checks a store's version against rows.py's
    raise AssertionError(f"rows.SCHEMA_VERSION is {SCHEMA_VERSION}; the migrations reach {LATEST}")


def current_version(conn: Connection) -> int:
    metadata.create_all(conn, tables=[version_table])
    found = conn.execute(select(version_table.c.version)).scalar()
    return int(found or 0)


def migrate(conn: Connection) -> int:
    """Bring the schema to ``LATEST`` inside the caller's (write-locked) transaction."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(7314001)"))  # runners start together
    version = current_version(conn)
    for step in range(version + 1, LATEST + 1):
        MIGRATIONS[step](conn)
    if version == 0:
        conn.execute(version_table.insert().values(version=LATEST))
    elif version < LATEST:
        conn.execute(version_table.update().values(version=LATEST))
    return version
