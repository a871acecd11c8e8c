"""A runner's side of the store: claim a job, hold the lease, write fenced, and reap.

A claim takes one pending job and starts its next attempt; every later write of that
runner names (job id, attempt, owner) and changes nothing once the lease is gone, so a
runner that was presumed dead can never overwrite a newer attempt (``LeaseLost``).
PostgreSQL claims with ``FOR UPDATE SKIP LOCKED`` (runners never wait on each other's
rows); SQLite's ``BEGIN IMMEDIATE`` serializes claims on the database lock instead.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    Integer,
    String,
    Text,
    and_,
    bindparam,
    false,
    func,
    insert,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.sql.dml import UpdateBase

from tpupod.errors import LeaseLost
from tpupod.jobs.history import (
    GIVEN_BACK,
    LOST,
    RECOVERED,
    RETRIED,
    Entry,
    add_entry,
    counted,
    load_history,
    lost_cause,
)
from tpupod.jobs.models import LEASED, Claim, Job, JobStatus
from tpupod.jobs.schema import jobs, log_lines
from tpupod.jobs.store import Store

Attempt = tuple[int, int]  # (job id, attempt): what every write is fenced by

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0


def backoff_s(attempt: int) -> float:
    """How long a job whose ``attempt`` lost its runner waits before the next one."""
    return float(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** max(0, attempt - 1)))


def _fence(claim: Claim) -> ColumnElement[bool]:
    return and_(
        jobs.c.id == claim.job.id,
        jobs.c.attempt == claim.attempt,
        jobs.c.lease_owner == claim.owner,
        jobs.c.status.in_([s.value for s in LEASED]),
    )


def _status_is(*statuses: JobStatus) -> ColumnElement[bool]:
    """``status = 'x'`` (or ``IN (...)``) with the values written in the SQL, as the partial
    indexes' conditions are (same order): only then can SQLite (and PostgreSQL's generic
    plans) use those indexes; with a parameter the claim scanned and sorted the table."""
    values: list[ColumnElement[str]] = [literal_column(f"'{status.value}'") for status in statuses]
    return jobs.c.status == values[0] if len(values) == 1 else jobs.c.status.in_(values)


# ``_fence`` for several claims of one runner, built once: parameters ``held`` (the
# (job id, attempt) pairs) and ``owner``
_FENCE_MANY = and_(
    tuple_(jobs.c.id, jobs.c.attempt).in_(bindparam("held", expanding=True)),
    jobs.c.lease_owner == bindparam("owner", type_=String),
    _status_is(JobStatus.SCHEDULED, JobStatus.RUNNING),  # leased: the partial index's rows
)
_FINISH = (
    update(jobs)
    .where(_FENCE_MANY)
    .values(
        status=bindparam("new_status", type_=String),
        result=bindparam("new_result", type_=Text),
        error=bindparam("new_error", type_=Text),
        completed_at=bindparam("ended", type_=Float),
        updated_at=bindparam("now", type_=Float),
        lease_owner=None,
        lease_expires_at=None,
    )
    .returning(jobs.c.id, jobs.c.attempt)
)
_RENEW = (
    update(jobs)
    .where(_FENCE_MANY)
    .values(
        lease_expires_at=bindparam("expires", type_=Float),
        updated_at=bindparam("now", type_=Float),
    )
    .returning(jobs.c.id, jobs.c.attempt, jobs.c.cancel_requested)
)


def _held(owner: str, held: Sequence[Claim]) -> dict[str, object]:
    return {"owner": owner, "held": [(c.job.id, c.attempt) for c in held]}


def _mine(pod: str | None) -> ColumnElement[bool]:
    """The jobs a runner for ``pod`` (None: a local runner) may take."""
    return jobs.c.pod.is_(None) if pod is None else or_(jobs.c.pod.is_(None), jobs.c.pod == pod)


def remaining(store: Store, pod: str | None) -> int:
    """Jobs a runner for ``pod`` may still take or see end (pending, or leased)."""
    live = [JobStatus.PENDING.value, *(s.value for s in LEASED)]
    query = select(func.count()).where(jobs.c.status.in_(live), _mine(pod))
    with store.read() as conn:
        return int(conn.execute(query).scalar_one())


def claim(store: Store, owner: str, *, pod: str | None, lease_s: float) -> Claim | None:
    """Lease the most urgent pending job this runner may take, or None."""
    taken = claim_many(store, owner, pod=pod, lease_s=lease_s, limit=1)
    return taken[0] if taken else None


@functools.cache
def _claim_statement(postgres: bool, running: bool, for_pod: bool) -> UpdateBase:
    """The claim, built once (building a statement cost more than running it): values
    come as parameters ``now``, ``expires``, ``owner``, ``limit`` and ``for_pod``."""
    now = bindparam("now", type_=Float)
    mine: ColumnElement[bool] = jobs.c.pod.is_(None)
    if for_pod:
        mine = or_(mine, jobs.c.pod == bindparam("for_pod", type_=String))
    pick = (
        select(jobs.c.id)
        .where(_status_is(JobStatus.PENDING), jobs.c.run_after <= now, mine)
        .order_by(jobs.c.priority.desc(), jobs.c.id)
        .limit(bindparam("limit", type_=Integer))
    )
    if postgres:  # other runners skip these rows instead of waiting for them
        pick = pick.with_for_update(skip_locked=True)
    status = JobStatus.RUNNING if running else JobStatus.SCHEDULED
    values: dict[str, object] = {
        "status": status.value,
        "attempt": jobs.c.attempt + 1,
        "lease_owner": bindparam("owner", type_=String),
        "runner": bindparam("owner", type_=String),  # kept when the attempt ends
        "lease_expires_at": bindparam("expires", type_=Float),
        "scheduled_at": now,
        "updated_at": now,
    }
    if running:
        values["started_at"] = now
    take = update(jobs).where(jobs.c.id.in_(pick.scalar_subquery())).values(**values)
    return take.returning(*jobs.c)


def claim_many(
    store: Store,
    owner: str,
    *,
    pod: str | None,
    lease_s: float,
    limit: int,
    running: bool = False,
) -> list[Claim]:
    """Lease up to ``limit`` pending jobs, most urgent first, in one statement and one commit.

    ``running``: the runner starts them the moment it has them (a local runner), so the
    claim marks them running too and no separate "running" commit follows; a pod runner
    marks a job running only once every worker started (``started``)."""
    with store.write() as conn:
        return _claim(
            conn, store.postgres, owner, pod=pod, lease_s=lease_s, limit=limit, running=running
        )


def _claim(
    conn: Connection,
    postgres: bool,
    owner: str,
    *,
    pod: str | None,
    lease_s: float,
    limit: int,
    running: bool,
) -> list[Claim]:
    now = time.time()
    take = _claim_statement(postgres, running, pod is not None)
    params = {"now": now, "expires": now + lease_s, "owner": owner, "limit": limit, "for_pod": pod}
    rows = conn.execute(take, params).all()
    again = [row.id for row in rows if row.attempt > 1]  # a first attempt has no lines yet
    last: dict[int, int] = {}
    if again:
        found = conn.execute(
            select(log_lines.c.job_id, func.max(log_lines.c.seq))
            .where(log_lines.c.job_id.in_(again))
            .group_by(log_lines.c.job_id)
        )
        last = {int(job_id): int(seq) for job_id, seq in found}
    taken = sorted((Job.from_row(row) for row in rows), key=lambda j: (-j.priority, j.id))
    return [
        Claim(job=job, attempt=job.attempt, owner=owner, next_seq=last.get(job.id, 0) + 1)
        for job in taken
    ]


def _fenced_update(conn: Connection, claim: Claim, **values: object) -> bool:
    """Update the claimed attempt; True when this runner still held it."""
    done = conn.execute(update(jobs).where(_fence(claim)).values(updated_at=time.time(), **values))
    return done.rowcount == 1


def started(store: Store, claim: Claim) -> None:
    """Every worker started: the job is running."""
    with store.write() as conn:
        if not _fenced_update(conn, claim, status=JobStatus.RUNNING.value, started_at=time.time()):
            raise _lost(claim)


def heartbeat(store: Store, claim: Claim, lease_s: float) -> bool:
    """Renew the lease; returns whether a cancel was asked for. Raises ``LeaseLost``."""
    cancel, lost = heartbeat_many(store, [claim], lease_s)
    if lost:
        raise _lost(claim)
    return bool(cancel)


def heartbeat_many(
    store: Store, held: Sequence[Claim], lease_s: float
) -> tuple[set[Attempt], set[Attempt]]:
    """Renew every lease in ``held`` in one statement: the (job id, attempt) pairs asked to
    cancel, and those this runner no longer holds.

    On PostgreSQL the commit does not wait for its WAL flush (``synchronous_commit =
    off``): a renewal lost in a server crash (at most ~0.6 s of commits) leaves the
    previous expiry, at least ``lease_s`` minus one beat away, and the next beat renews
    it again; were the lease to expire anyway, the reaper requeues the job and this
    runner's next fenced write finds it lost: no attempt is ever recorded twice.
    Claims and endings always wait for their flush."""
    if not held:
        return set(), set()
    now = time.time()
    params = {**_held(held[0].owner, held), "now": now, "expires": now + lease_s}
    with store.write() as conn:
        if store.postgres:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        rows = conn.execute(_RENEW, params).all()
    renewed = {(int(row.id), int(row.attempt)) for row in rows}
    cancel = {(int(row.id), int(row.attempt)) for row in rows if row.cancel_requested}
    return cancel, {(c.job.id, c.attempt) for c in held} - renewed


def append_logs(
    store: Store,
    claim: Claim,
    first: int,
    lines: Sequence[tuple[int, str]],
    *,
    resume: bool = False,
) -> int:
    """Add (worker, line) pairs at offsets ``first``, ``first + 1``...; returns the next.

    Fenced like every write: the lease is checked and the rows inserted in one transaction
    (PostgreSQL locks the job row for share, so the reaper cannot slip in between). Unlike
    a heartbeat, the commit waits for its flush: the lines are what a user reads, and
    ``seq`` offsets handed out for lines a server crash then lost would leave holes.

    ``resume``: the previous write of these lines failed, perhaps after its commit (the
    connection broke before the answer came): the lines the store already has from
    ``first`` on are skipped, so each line is written exactly once."""
    if not lines:
        return first
    rows = [
        {"job_id": claim.job.id, "seq": first + i, "attempt": claim.attempt, "worker": w, "line": t}
        for i, (w, t) in enumerate(lines)
    ]
    check = select(jobs.c.id).where(_fence(claim))
    if store.postgres:
        check = check.with_for_update(read=True)
    with store.write() as conn:
        if conn.execute(check).first() is None:
            raise _lost(claim)
        if resume:
            last = select(func.max(log_lines.c.seq)).where(log_lines.c.job_id == claim.job.id)
            have = conn.execute(last).scalar() or 0
            rows = rows[max(0, have - first + 1) :]
        if rows:
            conn.execute(insert(log_lines), rows)
    return first + len(lines)


def finish(
    store: Store,
    claim: Claim,
    status: JobStatus,
    *,
    result: str | None = None,
    error: str | None = None,
) -> None:
    """End the attempt (completed, failed or cancelled); fenced."""
    if finish_many(store, [Ending(claim, status, result, error)]):
        raise _lost(claim)


@dataclass(frozen=True)
class Ending:
    """How one attempt ended, for ``finish_many``."""

    claim: Claim
    status: JobStatus
    result: str | None = None
    error: str | None = None
    ended: float | None = None  # when it ended, if not now (a gone runner's, kept)


def finish_many(store: Store, endings: Sequence[Ending]) -> set[Attempt]:
    """End several attempts in one transaction, each row fenced by its own claim.

    Returns the (job id, attempt) pairs this runner no longer held: those rows
    are left as they are (a newer attempt owns them), the others are written. Endings
    alike (the same status, result and error: no-op jobs) share one statement."""
    with store.write() as conn:
        return _finish(conn, endings)


def finish_and_claim(
    store: Store,
    endings: Sequence[Ending],
    owner: str,
    *,
    pod: str | None,
    lease_s: float,
    limit: int,
    running: bool = False,
) -> tuple[set[Attempt], list[Claim]]:
    """``finish_many`` and ``claim_many`` in one transaction: a busy runner ends the jobs it
    ran and takes the next ones in one commit. Returns (lost attempts, new claims)."""
    with store.write() as conn:
        lost = _finish(conn, endings) if endings else set()
        taken = (
            _claim(
                conn, store.postgres, owner, pod=pod, lease_s=lease_s, limit=limit, running=running
            )
            if limit
            else []
        )
    return lost, taken


def _finish(conn: Connection, endings: Sequence[Ending]) -> set[Attempt]:
    now = time.time()
    alike: dict[tuple[str, JobStatus, str | None, str | None, float], list[Claim]] = {}
    for end in endings:
        key = (end.claim.owner, end.status, end.result, end.error, end.ended or now)
        alike.setdefault(key, []).append(end.claim)
    written: set[Attempt] = set()
    for (owner, status, result, error, ended), held in alike.items():
        values: dict[str, object] = {"new_status": status.value, "now": now, "ended": ended}
        values |= {"new_result": result, "new_error": error}
        rows = conn.execute(_FINISH, {**_held(owner, held), **values})
        written |= {(int(r.id), int(r.attempt)) for r in rows}
    return {(e.claim.job.id, e.claim.attempt) for e in endings} - written


def retry(store: Store, claim: Claim, reason: str) -> JobStatus:
    """End an attempt that failed but may run again (a pod evicted or preempted, a program
    failure ``--retries`` covers): the job runs again after the backoff, or fails with the
    reason once it had max_attempts."""
    now = time.time()
    common: dict[str, object] = {"lease_owner": None, "lease_expires_at": None}
    with store.write() as conn:
        why = f"failed on runner {claim.owner}: {reason}"
        common["history"] = history = _with_entry(conn, store.postgres, claim, RETRIED, why)
        if counted(claim.attempt, load_history(history)) >= claim.job.max_attempts:
            status = JobStatus.FAILED
            failed = f"{reason}; gave up after {claim.job.max_attempts} attempts"
            done = _fenced_update(
                conn, claim, status=status.value, error=failed, completed_at=now, **common
            )
        else:
            status = JobStatus.PENDING
            again = now + backoff_s(claim.attempt)
            done = _fenced_update(
                conn, claim, status=status.value, error=reason, run_after=again, **common
            )
            store.notify(conn)
        if not done:
            raise _lost(claim)
    return status


def release(store: Store, claim: Claim, reason: str) -> None:
    """Give the job back at once (a runner told to stop while holding it)."""
    with store.write() as conn:
        why = f"runner {claim.owner} stopped and gave it back"
        given = _fenced_update(
            conn,
            claim,
            status=JobStatus.PENDING.value,
            lease_owner=None,
            lease_expires_at=None,
            run_after=0.0,
            error=reason,
            history=_with_entry(conn, store.postgres, claim, GIVEN_BACK, why),
        )
        if given:
            store.notify(conn)


def _with_entry(conn: Connection, postgres: bool, claim: Claim, how: str, why: str) -> str:
    """The claimed job's history with an entry for this attempt (ending now)."""
    query = select(jobs.c.history, jobs.c.scheduled_at).where(jobs.c.id == claim.job.id)
    if postgres:
        query = query.with_for_update()
    row = conn.execute(query).first()
    stored, began = (row.history, row.scheduled_at) if row is not None else (None, None)
    entry = Entry(claim.attempt, claim.owner, began, time.time(), how, why)
    return add_entry(stored, entry)


@dataclass(frozen=True)
class Reaped:
    """An attempt the reaper took from its lost runner: the job runs again (``requeued``,
    as attempt ``attempt + 1``) or failed, having had ``max_attempts``."""

    job_id: int
    attempt: int
    owner: str
    cause: str  # why the runner is taken for lost: "its process is gone", "its lease expired"
    requeued: bool
    max_attempts: int

    @property
    def what(self) -> str:
        """What happened to the job, in a person's words."""
        if self.requeued:
            return f"job {self.job_id} requeued for attempt {self.attempt + 1}"
        many = "s" if self.max_attempts != 1 else ""
        return f"job {self.job_id} failed after {self.max_attempts} attempt{many}"


def reap(
    store: Store,
    *,
    spare: str | None = None,
    dead: frozenset[str] = frozenset(),
    expired: bool = True,
) -> list[Reaped]:
    """Requeue attempts whose runner is lost (with backoff), or fail them after max_attempts:
    those whose lease expired (``expired``), and any of the runners in ``dead`` (known gone:
    their lease need not run out); not those of the runner ``spare`` (the one reaping: it
    knows its own are alive). Each attempt gets an entry in its job's history saying why,
    ending when its runner was last heard from (the row's ``updated_at``)."""
    now = time.time()
    lost_runner: ColumnElement[bool] = jobs.c.lease_expires_at < now if expired else false()
    if dead:
        lost_runner = or_(lost_runner, jobs.c.lease_owner.in_(sorted(dead)))
    expired_rows = (
        select(
            jobs.c.id,
            jobs.c.attempt,
            jobs.c.max_attempts,
            jobs.c.lease_owner,
            jobs.c.status,
            jobs.c.scheduled_at,
            jobs.c.updated_at,
            jobs.c.history,
        )
        .where(_status_is(JobStatus.SCHEDULED, JobStatus.RUNNING), lost_runner)
        .order_by(jobs.c.id)
        .limit(100)
    )
    if spare is not None:
        expired_rows = expired_rows.where(jobs.c.lease_owner != spare)
    if store.postgres:
        expired_rows = expired_rows.with_for_update(skip_locked=True)
    reaped: list[Reaped] = []
    with store.write() as conn:
        for row in conn.execute(expired_rows).all():
            owner = str(row.lease_owner)
            cause = lost_cause(owner, dead)
            lost = f"runner {owner} lost ({cause}) while {row.status}"
            # it ended when its runner was last heard from (its last heartbeat, at most 1 s
            # apart, or write), not now: the next runner may come hours later
            entry = Entry(row.attempt, owner, row.scheduled_at, row.updated_at, LOST, lost)
            base = update(jobs).where(jobs.c.id == row.id, jobs.c.attempt == row.attempt)
            common = {
                "lease_owner": None,
                "lease_expires_at": None,
                "updated_at": now,
                "history": add_entry(row.history, entry),
            }
            requeued = counted(row.attempt, load_history(row.history)) < row.max_attempts
            if requeued:
                again = now + backoff_s(row.attempt)
                pending = JobStatus.PENDING.value
                error = f"attempt {row.attempt}: {lost}"
                conn.execute(base.values(status=pending, error=error, run_after=again, **common))
            else:
                failed = f"attempt {row.attempt}: {lost}; gave up after {row.max_attempts} attempts"
                conn.execute(
                    base.values(
                        status=JobStatus.FAILED.value,
                        error=failed,
                        completed_at=row.updated_at,  # its last attempt ended then
                        **common,
                    )
                )
            reaped.append(Reaped(row.id, row.attempt, owner, cause, requeued, row.max_attempts))
        if reaped:
            store.notify(conn)
    return reaped


def adopt(
    store: Store, key: Attempt, owner: str, *, lease_s: float, note: str
) -> tuple[Claim | None, Job]:
    """Hold again, in the name of a runner that is gone, an attempt it ran to its end and
    could not record (the journal it left says how it ended), so that its ending is
    written fenced, as that runner would have written it; ``note`` (why another runner
    records it) goes into the job's history.

    The attempt is taken when the job is still leased by that runner at that attempt (the
    lease is renewed), or when the reaper took it for lost and nobody has taken the job
    since: pending at that attempt, or failed having had max_attempts (it is leased by that
    runner again). Otherwise (another attempt began, or its ending was recorded after all)
    the claim is None; the job is returned as found."""
    job_id, attempt = key
    query = select(jobs).where(jobs.c.id == job_id)
    if store.postgres:
        query = query.with_for_update()
    now = time.time()
    with store.write() as conn:
        row = conn.execute(query).first()
        if row is None:
            raise LeaseLost(f"job {job_id} is no longer in the store", hint="it was deleted")
        job = Job.from_row(row)
        reaped = [e for e in job.history if e.attempt == attempt and e.how == LOST]
        ours = job.attempt == attempt and (
            (job.status in LEASED and job.lease_owner == owner)
            or (job.status in (JobStatus.PENDING, JobStatus.FAILED) and bool(reaped))
        )
        if not ours:
            return None, job
        began = reaped[0].started if reaped else job.scheduled_at
        entry = Entry(attempt, owner, began, now, RECOVERED, note)
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.attempt == attempt)
            .values(
                status=JobStatus.RUNNING.value,
                lease_owner=owner,
                lease_expires_at=now + lease_s,
                completed_at=None,
                updated_at=now,
                history=add_entry(row.history, entry),
            )
        )
        last = select(func.max(log_lines.c.seq)).where(log_lines.c.job_id == job_id)
        next_seq = (conn.execute(last).scalar() or 0) + 1
    return Claim(job=job, attempt=attempt, owner=owner, next_seq=next_seq), job


def add_note(store: Store, job_id: int, entry: Entry) -> None:
    """Put ``entry`` in the job's history (in place of one of the same attempt's)."""
    with store.write() as conn:
        stored = conn.execute(select(jobs.c.history).where(jobs.c.id == job_id)).scalar()
        conn.execute(
            update(jobs).where(jobs.c.id == job_id).values(history=add_entry(stored, entry))
        )


def _lost(claim: Claim) -> LeaseLost:
    return LeaseLost(
        f"job {claim.job.id} attempt {claim.attempt}: runner {claim.owner} no longer holds it",
        hint="its lease expired and the job was requeued or taken by another runner",
    )
