"""The job store for the dashboard, through the job service's calls (jobs/service.py): counts,
a filtered page (keyset: ids below the last one shown), one job with its attempts, its log
followed, cancel."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from typing import Any

from tpupod.errors import JobStoreError
from tpupod.jobs import service
from tpupod.jobs.models import Job, JobStatus
from tpupod.jobs.store import Store
from tpupod.jobs.wakeup import file_state

PAGE = 50
RECOUNT_S = 5.0  # count again at least this often (a change a file's stat cannot show)
TAIL_LINES = 500  # a job page opens with the log's last lines (the download has all)
FAILED_SHOWN = 10  # the newest failed jobs the overview lists (and says how many more)


class Jobs:
    """The store at ``url``, opened on first use; the default store not made yet has no
    jobs (one named with ``--db`` that is not there is an error, as ``jobs ls`` says)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.store: Store | None = None
        self.seen: tuple[tuple[int, int, int] | None, ...] | None = None
        self.counted_at = 0.0
        self.last_counts: dict[str, int] = {}
        self.last_failed: list[dict[str, Any]] = []
        self.opening = threading.Lock()  # the pages (threads of the web server) open it

    def open(self) -> Store | None:
        with self.opening:
            return self._open()

    def _open(self) -> Store | None:
        if self.store is None:
            try:
                self.store = service.open_store(self.url)
            except JobStoreError as exc:
                if "no job store at" in exc.message and self.url is None:
                    return None  # the default store, made by the first job: none yet
                raise  # one named with --db that is not there: a typo, as 'jobs ls' says
        return self.store

    def need(self) -> Store:
        store = self.open()
        if store is None:
            raise JobStoreError("there is no job store yet", hint="submit a job first")
        return store

    def summary(self) -> dict[str, Any]:
        """What the sampler sends: ``{"counts": jobs per status, "failed": the newest
        failed jobs}``."""
        counts = self.counts()
        return {"counts": counts, "failed": self.last_failed}

    def counts(self) -> dict[str, int]:
        """Jobs per status (and the newest failed jobs, kept for ``summary``). On SQLite
        the store is read again only when the database's files changed (any commit changes
        one) or ``RECOUNT_S`` passed: the sampler asks four times a second, and a grouped
        count of 10,000 jobs costs milliseconds."""
        store = self.open()
        if store is None:
            return {s.value: 0 for s in JobStatus}
        files = _files(store)  # before the count: a commit during it is seen next time
        now = time.monotonic()
        if files is None or files != self.seen or now - self.counted_at > RECOUNT_S:
            self.last_counts = {s.value: n for s, n in service.status_counts(store).items()}
            if self.last_counts.get(JobStatus.FAILED.value):
                failed = service.list_jobs(store, statuses=[JobStatus.FAILED], limit=FAILED_SHOWN)
                self.last_failed = [_row(job) for job in failed.jobs]
            else:
                self.last_failed = []
            self.seen, self.counted_at = files, now
        return self.last_counts

    def page(self, status: str | None, before: int | None, size: int = PAGE) -> dict[str, Any]:
        """Jobs newest first, ``size`` a page, ids below ``before``; ``status`` filters."""
        store = self.open()
        if store is None:
            return {"jobs": [], "next_before": None, "status": status, "before": before}
        statuses = service.statuses([status] if status else [])
        found = service.list_jobs(store, statuses=statuses, before=before, limit=size)
        return {
            "jobs": [_row(job) for job in found.jobs],
            "next_before": found.next_before,
            "status": status,
            "before": before,
        }

    def one(self, job_id: int, runs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """The job, its attempts, and the runs it was launched as (``runs``: run summaries
        whose ``job`` is this one): each attempt's run, start and end where known (a
        pod's job from its run; the last attempt from the job's own times)."""
        detail = service.job_detail(self.need(), job_id)
        job = detail.job
        row = {**_row(job), "attempts": [asdict(a) for a in detail.attempts]}
        row["result_text"] = None if job.result is None else service.result_text(job.result)
        by_attempt = {r["job"]["attempt"]: r for r in runs}
        attempts = []
        for a in detail.attempts:
            run = by_attempt.get(a.attempt)
            times = (run["started"], run["finished"]) if run else (None, None)
            if run is None and a.attempt == job.attempt:
                times = (job.started_at, job.completed_at)
            attempts.append({
                **asdict(a), "run": run["id"] if run else None,
                "state": run["state"] if run else None,
                "started": times[0], "finished": times[1],
            })  # fmt: skip
        row["attempt_rows"] = attempts
        row["runs"] = [r["id"] for r in runs]
        return row

    def cancel(self, job_id: int) -> dict[str, Any]:
        return _row(self.need().cancel(job_id))

    async def follow(self, job_id: int, after: int | None) -> AsyncIterator[str]:
        """The job's lines after offset ``after`` (None: its last ``TAIL_LINES``) as
        server-sent events, a page an event whose id is its last offset (as the job API's),
        then ``end`` with its status. The lines read as ``tpupod jobs logs`` shows them
        (``service.LogView``: ``[wN]`` on a pod, each attempt's beginning marked)."""
        store = self.need()
        view = service.LogView(store.get(job_id))
        if after is None:
            last = max((a.last_seq or 0 for a in store.attempts(job_id)), default=0)
            after = max(0, last - TAIL_LINES)
        async for lines in service.follow(store, job_id, after=after):
            shown = [list(pair) for pair in view.lines(lines)]
            data = json.dumps({"lines": shown, "reset": []})
            yield f"id: {lines[-1].seq}\nevent: lines\ndata: {data}\n\n"
        status = store.get(job_id).status.value
        yield f"event: end\ndata: {json.dumps({'status': status})}\n\n"

    async def text(self, job_id: int) -> AsyncIterator[str]:
        """The job's whole log as text, a page at a time."""
        store = self.need()
        view = service.LogView(store.get(job_id))
        async for lines in service.follow(store, job_id, until_end=False):
            yield "".join(text + "\n" for _, text in view.lines(lines))


def _files(store: Store) -> tuple[tuple[int, int, int] | None, ...] | None:
    """A SQLite database's files as (inode, size, mtime): the same after no commit; None
    for PostgreSQL (nothing here to watch: count every time)."""
    database = store.engine.url.database
    if store.postgres or not database or database == ":memory:":
        return None
    return tuple(file_state(database + suffix) for suffix in ("", "-wal"))


def _row(job: Job) -> dict[str, Any]:
    data = job.to_dict()
    keep = ("id", "name", "status", "command", "code", "pod", "attempt", "max_attempts", "error")
    row = {k: data[k] for k in (*keep, "created_at", "started_at", "completed_at")}
    row.update(labels=job.labels, cancel_requested=job.cancel_requested)
    row["status_text"] = service.status_text(job)
    row["counted_attempts"] = job.counted_attempts  # of max_attempts: given back ones not
    return row
