"""The job service as library calls: what ``tpupod jobs`` does, for the CLI, a Python user
and the dashboard. List jobs (filters, pages), read one with its attempts, follow its log
(the one follower: the CLI's ``logs``, the API's SSE stream), wait for it, count jobs per
status. Submitting is ``Store.submit`` (``jobs.request`` builds the request from a file),
cancelling ``Store.cancel``; running jobs is ``jobs.runnerflow``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpupod import settings
from tpupod.base.durations import spoken
from tpupod.errors import JobError, JobStoreAway, UsageError
from tpupod.jobs.history import LOST, Entry, process_gone, when
from tpupod.jobs.models import LEASED, AttemptLines, Job, JobRequest, JobStatus, LogLine
from tpupod.jobs.rows import DB_FILE, RETRY_S, START_WAIT_S, Outage, check_pod
from tpupod.jobs.store import Store

POLL_S = 0.2  # a follower and a waiter read the store again after this long
LOG_PAGE = 5000  # lines per read while following


def open_store(db: str | None, *, create: bool = False) -> Store:
    """The job store at ``db`` (default: ``$TPUPOD_JOBS_DB``, else the state directory's);
    only what adds jobs or serves (``create``) makes one where none is."""
    return Store.open(db, create=create)


def unmade_default_store(db: str | None) -> Path | None:
    """The default store's file (no --db, no ``TPUPOD_JOBS_DB``) when no submit has made it
    yet, else None: a listing of it is empty, where a --db that names no store is an error
    (most likely a typo)."""
    if db is not None or settings.jobs_db() is not None:
        return None
    path = settings.state_home() / DB_FILE
    return None if path.exists() else path


def job_id(text: str) -> int:
    """A job id as a person types it."""
    if not text.isdigit():
        raise UsageError(f"job id {text!r} is not a number", hint="'tpupod jobs ls' lists the ids")
    return int(text)


def statuses(names: Sequence[str]) -> list[JobStatus]:
    """Status filters by name (``--status running``)."""
    try:
        return [JobStatus(name) for name in names]
    except ValueError as exc:
        choices = ", ".join(s.value for s in JobStatus)
        raise UsageError(f"--status {exc.args[0].split()[0]}", hint=f"one of {choices}") from exc


@dataclass(frozen=True)
class JobPage:
    """A page of jobs, newest first; ``next_before`` (None: that was all) asks for the next."""

    jobs: list[Job]
    next_before: int | None


def list_jobs(
    store: Store,
    *,
    statuses: Sequence[JobStatus] = (),
    labels: dict[str, str] | None = None,
    since: float | None = None,
    before: int | None = None,
    limit: int = 50,
) -> JobPage:
    """Jobs with any of ``statuses`` and all of ``labels``, created at or after ``since``,
    with ids below ``before``: up to ``limit`` of them, newest first."""
    found = store.find(
        statuses=statuses, labels=labels, since=since, before=before, limit=limit + 1
    )
    more = len(found) > limit
    return JobPage(found[:limit], found[limit - 1].id if more else None)


@dataclass(frozen=True)
class JobDetail:
    """One job and its attempts (one entry per attempt it has had, with what it printed)."""

    job: Job
    attempts: list[AttemptLines]


def job_detail(store: Store, ident: int) -> JobDetail:
    job = store.get(ident)
    printed = {a.attempt: a for a in store.attempts(ident)}
    numbers = range(1, max(job.attempt, max(printed, default=0)) + 1)
    return JobDetail(job, [printed.get(n, AttemptLines(n, 0, None, None, 0)) for n in numbers])


def status_counts(store: Store) -> dict[JobStatus, int]:
    """How many jobs have each status (every status, 0 where none)."""
    found = store.counts()
    return {status: found.get(status, 0) for status in JobStatus}


def status_text(job: Job) -> str:
    """The status, the attempts only where another one can still happen, and for a leased
    job whose runner is known gone (``gone_runner``) what becomes of it."""
    if job.status.finished:
        return job.status.value + (f" after {job.attempt} attempts" if job.attempt > 1 else "")
    notes = []
    if job.counted_attempts and job.max_attempts > 1:
        notes.append(f"attempt {job.counted_attempts} of {job.max_attempts}")
    if (gone := gone_runner(job)) is not None:
        notes.append(gone)
    return job.status.value + (f" ({'; '.join(notes)})" if notes else "")


def gone_runner(job: Job) -> str | None:
    """For a leased job whose runner ran on this machine and whose process provably ended
    (``kill -9``, a crash), what becomes of it: the store still says it is leased until
    the next runner reaps it. A view only: nothing is written. None otherwise."""
    owner = job.lease_owner
    if job.status not in LEASED or owner is None or not process_gone(owner):
        return None
    last = job.counted_attempts >= job.max_attempts
    then = "fails it (its last attempt)" if last else "requeues it"
    return f"runner {owner} is gone: its process ended; the next runner {then}"


def times(job: Job) -> list[tuple[str, str]]:
    """(label, UTC time) of when the job was created, its latest attempt started and the
    job ended (with how long it ran), for ``show``."""
    found = [("created", when(job.created_at))]
    if job.started_at is not None and job.status is not JobStatus.PENDING:
        found.append(("started", when(job.started_at)))
    if job.status.finished and job.completed_at is not None:
        if job.started_at is not None:
            how_long = f"ran {spoken(job.completed_at - job.started_at)}"
        else:
            how_long = f"{spoken(job.completed_at - job.created_at)} after it was created"
        found.append(("ended", f"{when(job.completed_at)} ({how_long})"))
    return found


def attempt_texts(job: Job) -> list[str]:
    """One line per attempt (``jobs show``): how each ended, on which runner and when, for a
    job that ran more than once or whose ending another runner recorded; none otherwise."""
    entries = {entry.attempt: entry for entry in job.history}
    if job.attempt <= 1 and not entries:
        return []
    texts = []
    for number in range(1, job.attempt + 1):
        entry = entries.get(number)
        if entry is not None:
            texts.append(f"{number}: {entry.why} ({_entry_span(entry)})")
        elif number == job.attempt:
            texts.append(f"{number}: {_last_attempt(job)}")
        else:  # a job from before attempts were kept (schema version 3)
            texts.append(f"{number}: not recorded")
    return texts


def _last_attempt(job: Job) -> str:
    """The latest attempt, from the row: how it ended (or that it goes on), and when."""
    on = f" on runner {job.runner}" if job.runner else ""
    began = job.scheduled_at
    if job.status.finished and job.completed_at is not None and began is not None:
        return f"{job.status.value}{on} ({_span(began, job.completed_at)})"
    return f"{job.status.value}{on} (started {when(began)})"


def _entry_span(entry: Entry) -> str:
    """When an attempt of the history ran; a lost one's end is its runner's last sign of
    life (it died some time after)."""
    if entry.how != LOST or entry.started is None:
        return _span(entry.started, entry.ended)
    first, last = when(entry.started), when(entry.ended)
    length = spoken(entry.ended - entry.started)
    return f"from {first}, lost after {_same_day(first, last)}, {length} in"


def _span(started: float | None, ended: float) -> str:
    if started is None:
        return f"ended {when(ended)}"
    first, last = when(started), when(ended)
    return f"{first[:-4]} to {_same_day(first, last)} UTC, {spoken(ended - started)}"


def _same_day(first: str, last: str) -> str:
    """``last`` (a ``when`` text) without its date where ``first`` has the same, and
    without " UTC"."""
    return last[11:-4] if first[:10] == last[:10] else last[:-4]


def check_attempt(job: Job, attempt: int | None) -> None:
    """``logs --attempt N`` of a job that had fewer attempts is a usage error."""
    if attempt is not None and not 1 <= attempt <= max(job.attempt, 1):
        had = f"had {job.attempt} attempt{'s' if job.attempt != 1 else ''}"
        raise UsageError(
            f"job {job.id} {had}, not {attempt}", hint=f"'tpupod jobs show {job.id}' lists them"
        )


def result_text(value: object) -> str:
    """A result as a person (or ``$(...)``) reads it: a string as is, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


async def follow(
    store: Store,
    ident: int,
    *,
    after: int = 0,
    until_end: bool = True,
    page: int = LOG_PAGE,
    poll_s: float = POLL_S,
    say: Callable[[str], None] | None = None,
    attempt: int | None = None,
) -> AsyncIterator[list[LogLine]]:
    """The job's lines after offset ``after`` (of one ``attempt``, or all), in pages as they
    are written; it ends when the job has ended and every line is read (``until_end=False``:
    when every line written so far is read). Pages already written are read back to back,
    without waiting. While the store is away it waits (``say`` hears when that starts and
    ends), as runners do."""
    outage = Outage(say)
    while True:
        try:
            ended = not until_end or (await asyncio.to_thread(store.get, ident)).status.finished
            lines = await asyncio.to_thread(
                store.logs, ident, after=after, limit=page, attempt=attempt
            )
        except JobStoreAway as exc:
            outage.away(exc)
            await asyncio.sleep(RETRY_S)
            continue
        outage.back()
        if lines:
            after = lines[-1].seq
            yield lines
        if len(lines) == page:
            continue
        if ended:
            return
        await asyncio.sleep(poll_s)


class LogView:
    """A job's log lines as people read them, in ``tpupod jobs logs`` and on the dashboard:
    ``[wN]`` before a pod job's lines, and a mark where an attempt begins (a lost runner
    or a retry ran the program again: its lines would follow the last attempt's unseen).
    An attempt is marked where its lines follow another's, and at the first line shown
    when the job has had more than one attempt (or that line is not the first's); a job
    of one attempt reads as its program printed it."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.labelled = job.pod is not None
        self.several = job.attempt > 1
        self.last: int | None = None  # the attempt of the line shown last

    def lines(self, page: Sequence[LogLine]) -> Iterator[tuple[int | None, str]]:
        """(worker, text) of each line of ``page``, an attempt's mark (worker None) first
        where one begins; pages in order, as ``follow`` reads them."""
        for line in page:
            if line.attempt != self.last and (
                self.last is not None or self.several or line.attempt > 1
            ):
                yield None, attempt_mark(line.attempt, *_attempt_runner(self.job, line.attempt))
            self.last = line.attempt
            yield line.worker, f"[w{line.worker}] {line.line}" if self.labelled else line.line


def attempt_mark(attempt: int, runner: str | None = None, started: float | None = None) -> str:
    """The line that says attempt ``attempt``'s lines begin (on ``runner``, from ``started``)."""
    if runner is None:
        return f"--- attempt {attempt} ---"
    return f"--- attempt {attempt} (runner {runner}, started {when(started)}) ---"


def _attempt_runner(job: Job, attempt: int) -> tuple[str | None, float | None]:
    """The runner of one of the job's attempts and when it took it, where known."""
    for entry in job.history:
        if entry.attempt == attempt:
            return entry.runner, entry.started
    if attempt == job.attempt:
        return job.runner, job.scheduled_at
    return None, None


def log_pages(
    store: Store,
    ident: int,
    *,
    after: int = 0,
    until_end: bool = False,
    say: Callable[[str], None] | None = None,
    attempt: int | None = None,
) -> Iterator[list[LogLine]]:
    """``follow`` for a caller without an event loop (the CLI)."""
    pages = follow(store, ident, after=after, until_end=until_end, say=say, attempt=attempt)

    async def step() -> list[LogLine] | None:
        return await anext(pages, None)

    with asyncio.Runner() as runner:
        while (lines := runner.run(step())) is not None:
            yield lines


def wait(
    store: Store,
    ident: int,
    *,
    timeout: float | None = None,
    say: Callable[[str], None] | None = None,
) -> Job:
    """The job once it has ended; a ``JobError`` when it did not complete, or when it is
    still going after ``timeout`` seconds. While the store is away it waits, as ``follow``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    outage = Outage(say)
    job = store.get(ident)
    while not job.status.finished:
        if deadline is not None and time.monotonic() > deadline:
            raise JobError(
                f"job {ident} is still {job.status.value} after {timeout:g} s",
                hint=f"'tpupod jobs logs -f {ident}' follows it",
            )
        time.sleep(POLL_S if outage.since is None else RETRY_S)
        try:
            job = store.get(ident)
        except JobStoreAway as exc:
            outage.away(exc)
            continue
        outage.back()
    if job.status is not JobStatus.COMPLETED:
        raise JobError(
            f"job {job.id} {job.status.value}: {job.error}",
            hint=f"'tpupod jobs logs {job.id}' shows its output",
        )
    return job


def submit(
    request: JobRequest,
    *,
    db: str | None = None,
    remote_pod: bool = False,
    key: str | None = None,
    say: Callable[[str], None] | None = None,
) -> int:
    """Queue ``request`` in the store at ``db`` (made if none is there); its id. A job for a
    pod this machine does not know is refused unless its runner is elsewhere (``remote_pod``).

    A store that is away is waited for, up to ``START_WAIT_S`` in all (``say`` hears when
    that starts and ends), as runners wait; the id comes only once the job is stored. With
    ``key``, a try sent again (the connection dropped, perhaps after the commit) finds the
    job the first one added instead of adding it twice."""
    check_pod(request.pod, remote_pod)
    began = time.monotonic()
    store = Store.open_waiting(db, create=True, wait_s=START_WAIT_S, say=say)
    outage = Outage(say)
    try:
        while True:
            try:
                job_id = store.submit(request, key=key)
            except JobStoreAway as exc:
                if key is None or time.monotonic() - began >= START_WAIT_S:
                    raise  # without a key, another try could add it twice
                outage.away(exc, f"waiting up to {START_WAIT_S:.0f} s for it")
                time.sleep(RETRY_S)
                continue
            outage.back()
            return job_id
    finally:
        store.close()
