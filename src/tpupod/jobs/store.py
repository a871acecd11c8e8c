"""The connection to the job store: SQLite (default, WAL, in the state directory) or
PostgreSQL by URL, and the queries people make (submit, read, list, logs, cancel).

SQLite writes take the database lock at ``BEGIN IMMEDIATE``, so a claim's read and its
update cannot interleave with another runner's; reads begin deferred and, under WAL,
never wait for writers. Database errors are translated into ``JobStoreError`` here.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, func, select, update
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError

from tpupod.errors import JobNotFound, JobStoreAway, JobStoreError, UsageError
from tpupod.jobs import schema
from tpupod.jobs.models import FINISHED, AttemptLines, Job, JobRequest, JobStatus, LogLine
from tpupod.jobs.rows import (
    NOTIFY_CHANNEL,
    RETRY_S,
    Outage,
    away_words,
    default_url,
    find_sql,
    insert_sql,
    job_row,
    key_taken,
    redact,
    same_submit,
)
from tpupod.jobs.schema import jobs, log_lines


def _engine_url(url: str) -> str:
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _sqlite_engine(url: str, *, create: bool) -> Engine:
    path = url.split("sqlite:///", 1)[-1]
    if path and path != ":memory:":
        if not create and not Path(path).is_file():
            raise JobStoreError(
                f"no job store at {path} (no jobs were submitted to it)",
                hint=f"check the path, or submit a job first; {URL_HINT}",
            )
        folder = Path(path).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JobStoreError(
                f"cannot make the job store's folder {folder}: {exc.strerror or exc}",
                hint="set TPUPOD_HOME to a writable directory, or --db to another store",
            ) from exc
    engine = create_engine(url, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        read = conn.get_execution_options().get("tpupod_read", False)
        conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")

    return engine


CONNECT_TIMEOUT_S = 10
URL_HINT = "sqlite:///PATH or postgresql://USER@HOST:PORT/DB (--db or TPUPOD_JOBS_DB)"
SCHEMES = ("sqlite", "postgresql", "postgres", "postgresql+psycopg")


def open_engine(url: str, *, create: bool = True) -> Engine:
    """An engine for ``url``; an unusable URL is a ``UsageError`` with a hint. Without
    ``create``, a SQLite file that is not there is an error (nothing is made for a read)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme.lower() not in SCHEMES:
        what = f"not {scheme}" if scheme else "give a URL"
        raise UsageError(
            f"cannot use the job store URL {redact(url)!r}: "
            f"jobs are kept in SQLite or PostgreSQL ({what})",
            hint=URL_HINT,
        )
    try:
        if url.startswith("sqlite:"):
            return _sqlite_engine(url, create=create)
        # a host that drops packets (unplugged, firewalled) fails a connect in seconds, not
        # after the kernel's two minutes of retries; a URL's own connect_timeout wins
        timeout = {} if "connect_timeout=" in url else {"connect_timeout": CONNECT_TIMEOUT_S}
        return create_engine(
            _engine_url(url), pool_pre_ping=True, pool_size=2, connect_args=timeout
        )
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise UsageError(
            f"cannot use the job store URL {redact(url)!r}: {exc}", hint=URL_HINT
        ) from exc


def _away(exc: DBAPIError) -> bool:
    """The server is not answering now (``JobStoreAway``): a connection it broke, or one
    that failed without the server's word (refused, reset, timed out) or with its word
    that it cannot take one now. libpq gives a failed connect no SQLSTATE; a query the
    server rejected has one."""
    if exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    return away_words(str(exc.orig), getattr(exc.orig, "sqlstate", None))


def store_label(store_url: str) -> str:
    """A short name for a job store (a hash of its URL, password left out): on the objects a
    runner makes (Kubernetes JobSets, the outcome journals in the state directory) so that
    runners of another store never take them for theirs."""
    return hashlib.sha256(redact(store_url).encode()).hexdigest()[:12]


class Store:
    """One job store. Open with ``Store.open(url)``; it migrates the schema on open."""

    def __init__(self, url: str, engine: Engine) -> None:
        self.url = url
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True) -> Store:
        """The store at ``url``; ``create=False`` (reads) makes no SQLite file or folder."""
        url = url or default_url()
        store = cls(url, open_engine(url, create=create))
        with store.write() as conn:
            found = schema.current_version(conn)
            if found > schema.LATEST:
                raise JobStoreError(
                    f"the job store {redact(url)} has schema version {found}, "
                    f"this tpupod knows up to {schema.LATEST}",
                    hint="upgrade tpupod on this machine",
                )
            schema.migrate(conn)
        return store

    def close(self) -> None:
        self.engine.dispose()

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """A transaction that may write (SQLite: BEGIN IMMEDIATE)."""
        with self._translated(), self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        with (
            self._translated(),
            self.engine.connect().execution_options(tpupod_read=True) as conn,
            conn.begin(),
        ):
            yield conn

    @classmethod
    def open_waiting(
        cls,
        url: str | None,
        *,
        create: bool,
        wait_s: float,
        say: Callable[[str], None] | None = None,
    ) -> Store:
        """``open``, waiting up to ``wait_s`` for a server that is away (``JobStoreAway``:
        a restart, a server started after its runners), saying so once and when it is
        back. A server that refuses (no such database, a password) fails at once."""
        began = time.monotonic()
        outage = Outage(say)
        while True:
            try:
                store = cls.open(url, create=create)
            except JobStoreAway as exc:
                if time.monotonic() - began >= wait_s:
                    raise
                outage.away(exc, f"waiting up to {wait_s:.0f} s for it")
                time.sleep(RETRY_S)
                continue
            outage.back()
            return store

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except DBAPIError as exc:
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
            kind = JobStoreAway if self.postgres and _away(exc) else JobStoreError
            raise kind(f"job store {redact(self.url)}: {reason}", hint=self._hint()) from exc

    def _hint(self) -> str:
        if self.postgres:
            return "check that the database is up and reachable (--db or TPUPOD_JOBS_DB)"
        return (  # a file here: no server to be down, but a disk that is full or read-only
            f"it is the file {self.engine.url.database}: check the disk it is on ('df -h' "
            "names it; full? read-only?), or use another store (--db or TPUPOD_JOBS_DB)"
        )

    # -- the queries people make --------------------------------------------------

    def submit(self, request: JobRequest, *, key: str | None = None) -> int:
        """Queue one job; with ``key`` (the submitter's idempotency key), a key the store
        has already gives that job's id and adds nothing (``UsageError`` when that job
        runs something else)."""
        return self.submit_many([request], keys=[key])[0]

    def submit_many(
        self, requests: Sequence[JobRequest], keys: Sequence[str | None] = ()
    ) -> list[int]:
        """Queue jobs in one transaction (one commit, one notice); their ids, in order."""
        now = time.time()
        given = list(keys) or [None] * len(requests)
        rows = [
            job_row(request.model_dump(), now, key)
            for request, key in zip(requests, given, strict=True)
        ]
        # the one INSERT the fast submit runs too (rows.insert_sql), through this connection
        mark = "%s" if self.postgres else "?"
        add = insert_sql(list(rows[0]), mark) if rows else ""
        with self.write() as conn:
            ids = [self._add(conn, add, mark, row) for row in rows]
            self.notify(conn)
        return ids

    def _add(self, conn: Connection, add: str, mark: str, row: dict[str, Any]) -> int:
        key = row["submit_key"]
        if key is not None:
            found = conn.exec_driver_sql(find_sql(mark), (key,)).first()
            if found is not None:
                if not same_submit(found, row):
                    raise key_taken(key, int(found[0]))
                return int(found[0])
        return int(conn.exec_driver_sql(add, tuple(row.values())).scalar_one())

    def notify(self, conn: Connection) -> None:
        """Wake idle runners (PostgreSQL; sent when the transaction commits)."""
        if self.postgres:
            conn.exec_driver_sql(f"NOTIFY {NOTIFY_CHANNEL}")

    def get(self, job_id: int) -> Job:
        with self.read() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        if row is None:
            raise JobNotFound(f"no job {job_id}", hint="'tpupod jobs ls' lists the jobs")
        return Job.from_row(row)

    def find(
        self,
        *,
        statuses: Sequence[JobStatus] = (),
        labels: dict[str, str] | None = None,
        since: float | None = None,
        before: int | None = None,
        limit: int = 100,
    ) -> list[Job]:
        """Newest first; ``before``: only ids below it (the next page)."""
        query = select(jobs).order_by(jobs.c.id.desc())
        if before is not None:
            query = query.where(jobs.c.id < before)
        if statuses:
            query = query.where(jobs.c.status.in_([s.value for s in statuses]))
        if since is not None:
            query = query.where(jobs.c.created_at >= since)
        wanted = (labels or {}).items()
        if not wanted:
            query = query.limit(limit)
        with self.read() as conn:
            rows = conn.execute(query).all()
        found = [Job.from_row(row) for row in rows]
        return [job for job in found if wanted <= job.labels.items()][:limit]

    def logs(
        self, job_id: int, *, after: int = 0, limit: int = 1000, attempt: int | None = None
    ) -> list[LogLine]:
        """Lines with offset (``seq``) greater than ``after`` (of ``attempt`` only, if given),
        in order."""
        query = (
            select(log_lines)
            .where(log_lines.c.job_id == job_id, log_lines.c.seq > after)
            .order_by(log_lines.c.seq)
            .limit(limit)
        )
        if attempt is not None:
            query = query.where(log_lines.c.attempt == attempt)
        with self.read() as conn:
            rows = conn.execute(query).all()
        return [LogLine(r.seq, r.attempt, r.worker, r.line) for r in rows]

    def attempts(self, job_id: int) -> list[AttemptLines]:
        """What each attempt that printed anything printed, in attempt order."""
        query = (
            select(
                log_lines.c.attempt,
                func.count(),
                func.min(log_lines.c.seq),
                func.max(log_lines.c.seq),
                func.count(func.distinct(log_lines.c.worker)),
            )
            .where(log_lines.c.job_id == job_id)
            .group_by(log_lines.c.attempt)
            .order_by(log_lines.c.attempt)
        )
        with self.read() as conn:
            rows = conn.execute(query).all()
        return [AttemptLines(int(a), int(n), first, last, int(w)) for a, n, first, last, w in rows]

    def cancel(self, job_id: int) -> Job:
        """A pending job ends now; a leased one is asked to stop (its runner kills it)."""
        now = time.time()
        with self.write() as conn:
            conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.status == JobStatus.PENDING.value)
                .values(
                    status=JobStatus.CANCELLED.value,
                    completed_at=now,
                    updated_at=now,
                    error="cancelled before it started",
                )
            )
            conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.status.not_in([s.value for s in FINISHED]))
                .values(cancel_requested=True, updated_at=now)
            )
        return self.get(job_id)

    def counts(self) -> dict[JobStatus, int]:
        query = select(jobs.c.status, func.count()).group_by(jobs.c.status)
        with self.read() as conn:
            return {JobStatus(s): int(n) for s, n in conn.execute(query).all()}
