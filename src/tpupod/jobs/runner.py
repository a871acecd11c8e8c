"""A runner: claim jobs, run their attempts (here or on a pod), keep the leases, write fenced.

A runner runs up to ``concurrency`` attempts at once (a pod runner one: a pod runs one
gang job at a time). Its writes are batched where the fencing allows: one statement
claims as many jobs as it has free slots, one heartbeat renews every lease it holds,
and attempts that end while another ending is being committed are written together,
one commit, each row still fenced by its own (job id, attempt). Every runner also reaps
expired leases, so a runner killed with ``kill -9`` costs its jobs one lease period,
never the jobs.

While the store is away (a database restart, an outage) the runner keeps its jobs running
and holds what they print (``LineBuffer``: memory, then its disk), retries quietly and says
two lines: when the outage starts and when it ends, with its length. When the store is
back, the held lines are written in order, exactly once, before each attempt's ending.

An attempt's outcome is kept in the runner's journal (``outcomes.py``) the moment the
attempt ends, with the lines the store does not have yet, until the store has its ending:
a runner killed in between (say, while the database was away) leaves it there, and the
next runner on this state directory records it instead of running the job again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tpupod.errors import JobError, JobStoreError, LeaseLost
from tpupod.jobs import claims
from tpupod.jobs.attempt import Executor, Hooks, Outcome
from tpupod.jobs.claims import Ending
from tpupod.jobs.history import LATE, LOST, Entry
from tpupod.jobs.linebuffer import LineBuffer
from tpupod.jobs.models import Claim, Job, JobStatus
from tpupod.jobs.outcomes import Journal, Kept, Orphan, journal_folder, orphans
from tpupod.jobs.rows import RETRY_S, Outage
from tpupod.jobs.store import Store
from tpupod.jobs.wakeup import Wakeup

DEFAULT_LEASE_S = 15.0
FLUSH_S = 0.2
HEARTBEAT_MAX_S = 1.0
UNTIL_EMPTY_POLL_S = 0.2
END_TRIES = 30  # the database may be restarting: the lease covers a while
WATCH_S = 1.0  # a pod runner checks that its pod is there
WRITE_BATCH = 5000  # log lines per transaction


def _retried(claim: Claim, outcome: Outcome) -> bool:
    """A program failure the job's ``retries`` cover (the retry fails it at max_attempts)."""
    return outcome.status is JobStatus.FAILED and claim.attempt <= claim.job.retries


def _recorded(job: Job, kept: Kept) -> bool:
    """Whether the store has the ending ``kept`` already (found as ``job``)."""
    if job.attempt == kept.attempt and job.status.finished and job.runner == kept.owner:
        return True
    return any(
        entry.attempt == kept.attempt and entry.runner == kept.owner and entry.how != LOST
        for entry in job.history
    )


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class _Attempt:
    """What one attempt gathers while it runs."""

    claim: Claim
    next_seq: int
    lines: LineBuffer = field(default_factory=LineBuffer)  # printed, not yet in the store
    unsure: bool = False  # a write of lines failed: it may have committed all the same
    started: bool = False
    marked_started: bool = False
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)
    why: str | None = None  # "cancel", "lost", "shutdown"
    freed: bool = False  # its runner slot is free again

    @property
    def key(self) -> claims.Attempt:
        return (self.claim.job.id, self.claim.attempt)

    def line(self, worker: int, text: str) -> None:
        self.lines.add(worker, text)

    def mark_started(self) -> None:
        self.started = True

    def stop_for(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.stop.set()


@dataclass(frozen=True)
class _Plan:
    """What an ended attempt's runner writes: its ending (``end``), a retry (``retry``: run
    again, or fail at max_attempts), the job given back (``release``: the runner stops),
    or nothing (``lost``: its lease is gone)."""

    action: str
    ending: Ending | None = None
    reason: str = ""

    @property
    def kept(self) -> bool:
        """An outcome the journal keeps until the store has it: the program ran to an end."""
        return self.action in ("end", "retry")


class Runner:
    def __init__(
        self,
        store: Store,
        executor: Executor,
        *,
        pod: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        owner: str | None = None,
        on_event: Callable[[str], None] | None = None,
        concurrency: int = 1,
        buffer: Callable[[], LineBuffer] = LineBuffer,
        journal: Path | None = None,
    ) -> None:
        self.store, self.executor, self.pod = store, executor, pod
        self.lease_s = lease_s
        # a heartbeat also brings a cancel back: often enough that a cancel is felt quickly
        self.beat_s = min(lease_s / 3, HEARTBEAT_MAX_S)
        self.owner = owner or new_owner()
        self.say = on_event or (lambda text: None)
        self.concurrency = max(1, concurrency)
        self.buffer = buffer  # holds an attempt's lines until the store has them
        # a local executor starts a job the moment it has it: the claim marks it running
        self.starts_at_once = bool(getattr(executor, "starts_at_once", False))
        self.shutdown = asyncio.Event()
        self.done = 0
        self.held: dict[claims.Attempt, _Attempt] = {}
        self._endings: list[tuple[Ending, asyncio.Future[str]]] = []
        self._active = 0  # attempts claimed and not yet ended
        self._changed = asyncio.Event()  # an attempt ended: a slot is free, an ending queued
        self._failures = 0  # store errors in a row
        self.gone: str | None = None  # why the pod this runner serves is gone
        self.outage = Outage(self.say, prefix=f"runner {self.owner}: ")
        # where it keeps outcomes the store does not have yet (the state directory's)
        self.journal_folder = journal or journal_folder(store.url)
        self.journal: Journal | None = None
        self._orphans: list[Orphan] = []  # gone runners' journals, locked, not yet reaped
        self._announced: set[str] = set()  # gone runners whose journal it said it records

    async def serve(self, *, until_empty: bool = False, max_jobs: int | None = None) -> int:
        """Run jobs until ``shutdown`` is set (or the queue is empty, or ``max_jobs``).

        A pod runner is its pod's registered user while it serves (``tpupod down`` can
        tell); if the pod goes, it gives its job back and stops (``JobError``)."""
        serving = getattr(self.executor, "serving", None)
        self._open_journal()
        try:
            with serving() if serving is not None else contextlib.nullcontext():
                done = await self._serve(until_empty=until_empty, max_jobs=max_jobs)
        finally:
            self._close_journal()
        if self.gone is not None:
            raise JobError(
                f"{self.gone}: this runner stopped",
                hint="its job went back to the queue; bring the pod up again and start a "
                "runner for it",
            )
        return done

    async def _serve(self, *, until_empty: bool, max_jobs: int | None) -> int:
        """The loop.

        Each round is one transaction: the endings queued since the last round and a claim
        for the free slots (``claims.finish_and_claim``); the busier the runner, the more
        jobs each commit ends and takes."""
        wakeup = Wakeup(self.store)
        beating = asyncio.create_task(self._beat_forever())
        flushing = asyncio.create_task(self._flush_forever())
        watching = asyncio.create_task(self._watch_pod())
        tasks: set[asyncio.Task[None]] = set()
        claimed = 0
        reaped_at = 0.0
        try:
            while not self.shutdown.is_set():
                self._changed.clear()
                if time.monotonic() - reaped_at > self.lease_s / 3:
                    await self._recover_and_reap()
                    reaped_at = time.monotonic()
                free = self.concurrency - self._active
                if max_jobs is not None:
                    free = min(free, max_jobs - claimed)
                got = await self._round(free)
                for claim in got:
                    task = asyncio.create_task(self.run_one(claim))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                claimed += len(got)
                self._active += len(got)
                if not self._active and not self._endings and not got:
                    if max_jobs is not None and claimed >= max_jobs:
                        break
                    if until_empty and not await self._anything_left():
                        break
                if self._endings or (got and len(got) == free):
                    continue  # more to write, or there may be more jobs to take
                # --until-empty: others' last jobs end without a notice, so look again soon
                timeout = UNTIL_EMPTY_POLL_S if until_empty else self.lease_s / 3
                await self._idle(wakeup, timeout, listen=free > len(got))
        finally:
            self.shutdown.set()  # also when an error ends the loop
            for attempt in self.held.values():
                attempt.stop_for("shutdown")
            if tasks:  # they give their jobs back (or record how they ended)
                await self._drain(tasks)
            beating.cancel()
            flushing.cancel()
            watching.cancel()
            await wakeup.close()
        return self.done

    async def _drain(self, tasks: set[asyncio.Task[None]]) -> None:
        """Write the endings of the attempts still running, until every one is told."""
        while tasks:
            await self._round(0)
            waiting = asyncio.ensure_future(self._changed.wait())
            await asyncio.wait({waiting, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            self._changed.clear()

    async def _idle(self, wakeup: Wakeup, timeout: float, *, listen: bool) -> None:
        """Until an attempt ends, there may be work (``listen``), ``timeout``, or shutdown."""
        waits = {
            asyncio.ensure_future(self.shutdown.wait()),
            asyncio.ensure_future(self._changed.wait()),
            asyncio.ensure_future(wakeup.wait(timeout) if listen else asyncio.sleep(timeout)),
        }
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()

    async def _round(self, free: int) -> list[Claim]:
        """Write the queued endings and claim up to ``free`` jobs, in one transaction."""
        endings, self._endings = self._endings, []
        if not endings and free <= 0:
            return []
        try:
            lost, got = await asyncio.to_thread(
                claims.finish_and_claim,
                self.store,
                [end for end, _ in endings],
                self.owner,
                pod=self.pod,
                lease_s=self.lease_s,
                limit=max(0, free),
                running=self.starts_at_once,
            )
        except JobStoreError as exc:
            self._failures += 1
            if endings and (self.shutdown.is_set() and self._failures >= END_TRIES):
                for _, told in endings:  # the leases expire and the reaper requeues them
                    told.set_result("not recorded: the job store stayed away")
            else:
                self._endings = endings + self._endings
            self._store_away(exc)
            await asyncio.sleep(RETRY_S)
            return []
        self._failures = 0
        self._store_back()
        for end, told in endings:
            lost_it = (end.claim.job.id, end.claim.attempt) in lost
            told.set_result("lease lost, not recorded" if lost_it else "")
        return got

    async def _recover_and_reap(self) -> None:
        """Record what gone runners' journals kept, then reap: those runners' attempts at
        once (their processes are gone), and others' whose lease expired (not in the lease
        after an outage: see ``_just_back``)."""
        try:
            recorded = await self._recover()
            dead = frozenset(orphan.owner for orphan in self._orphans)
            expired = not self._just_back()
            if not (recorded or dead or expired):
                return  # nothing asked of the store: it may still be away
            if dead or expired:
                reaped = await asyncio.to_thread(
                    # never its own: after an outage longer than a lease, this runner's
                    # jobs are still running here, and its next heartbeat renews them
                    functools.partial(
                        claims.reap, self.store, spare=self.owner, dead=dead, expired=expired
                    )
                )
                self._say_reaped(reaped)
                for orphan in self._orphans:
                    orphan.remove()
                self._orphans = []
            self._store_back()
            tidy = getattr(self.executor, "tidy", None)  # what a lost runner left running
            if tidy is not None and expired:
                await tidy(self.store)
        except JobStoreError as exc:  # the next round retries
            # the gone runners' journals are let go: whichever runner of this state
            # directory reaps next records them first (held, they would look alive, and
            # another runner could requeue their jobs once their leases expired)
            self._release_orphans()
            self._store_away(exc)
        except JobError as exc:  # the cluster is away: the next round retries
            self.say(f"runner {self.owner}: {exc.message}")

    def _release_orphans(self) -> None:
        for orphan in self._orphans:
            orphan.file.close()
        self._orphans = []

    def _say_reaped(self, reaped: list[claims.Reaped]) -> None:
        """One line per lost runner: why it is taken for lost, what became of each job."""
        by_runner: dict[tuple[str, str], list[str]] = {}
        for one in reaped:
            by_runner.setdefault((one.owner, one.cause), []).append(one.what)
        for (owner, cause), what in by_runner.items():
            self.say(f"runner {self.owner}: runner {owner} lost ({cause}): {'; '.join(what)}")

    async def _recover(self) -> int:
        """Lock the journals of this store's runners that are gone (on this state
        directory) and record the outcomes they kept; how many. Raises ``JobStoreError``."""
        if self.journal is None:
            return 0
        recorded = 0
        held = [orphan.path for orphan in self._orphans] + [self.journal.path]
        found = await asyncio.to_thread(orphans, self.journal_folder, skip=held)
        for orphan in found:
            if orphan.pending and orphan.owner not in self._announced:
                self._announced.add(orphan.owner)
                self.say(
                    f"runner {self.owner}: runner {orphan.owner} is gone; recording the "
                    f"{len(orphan.pending)} ending(s) its journal {orphan.path} kept"
                )
        self._orphans += found
        for orphan in self._orphans:
            for kept in list(orphan.pending.values()):
                try:
                    said = await asyncio.to_thread(self._record_kept, orphan, kept)
                except LeaseLost as exc:  # the job went (deleted), or was taken meanwhile
                    said = exc.message
                del orphan.pending[kept.key]
                recorded += 1
                if said:
                    self.say(f"runner {self.owner}: {said}")
        return recorded

    def _record_kept(self, orphan: Orphan, kept: Kept) -> str | None:
        """Write a gone runner's kept outcome as it would have (its lines, then its ending),
        unless the job went on without it; what to say (None: the store had it already)."""
        gone = kept.owner
        named = f"job {kept.job_id} attempt {kept.attempt} ({kept.status})"
        note = (
            f"{kept.status} on runner {gone}; recorded by runner {self.owner}: "
            f"{gone} was gone before the job store took it"
        )
        claim, job = claims.adopt(self.store, kept.key, gone, lease_s=self.lease_s, note=note)
        if claim is None:
            if _recorded(job, kept):
                return None  # by its runner, which died before noting so, or by another
            late = (
                f"{kept.status} on runner {gone}, but the job store learned it only after "
                f"the job had gone on without it ({job.status.value}, attempt {job.attempt}): "
                f"{gone} was gone before the job store took it"
            )
            entry = Entry(kept.attempt, gone, None, kept.ended, LATE, late)
            claims.add_note(self.store, kept.job_id, entry)
            return f"{named} ended on runner {gone}, which is gone; too late: {late}"
        for first, batch in orphan.lines(kept):
            claims.append_logs(self.store, claim, first, batch, resume=True)
        if kept.action == "retry":
            claims.retry(self.store, claim, kept.error or "the attempt failed")
        else:
            status = JobStatus(kept.status)
            ending = Ending(claim, status, result=kept.result, error=kept.error, ended=kept.ended)
            if claims.finish_many(self.store, [ending]):
                return f"{named}: lost again while recording it"
        return f"recorded {named} for runner {gone}, which is gone (kept in {orphan.path})"

    def _open_journal(self) -> None:
        try:
            self.journal = Journal(self.journal_folder, self.owner)
        except OSError as exc:  # a read-only state directory: run without one
            self.say(
                f"runner {self.owner}: cannot keep a journal in {self.journal_folder} "
                f"({exc.strerror or exc}): an outcome the job store does not take at once "
                "is lost with this runner"
            )

    def _close_journal(self) -> None:
        self._release_orphans()  # not recorded yet: the next runner does it
        if self.journal is not None:
            with contextlib.suppress(OSError):
                self.journal.close()
            self.journal = None

    def _sync_journal(self) -> None:
        if self.journal is not None:
            try:
                self.journal.sync()
            except OSError as exc:
                self.say(f"runner {self.owner}: cannot sync {self.journal.path}: {exc}")

    def _store_away(self, exc: JobStoreError) -> None:
        """Say that the store is away once, when the outage starts; retry quietly. What
        the journal keeps goes to the disk now: it may wait there a while."""
        self.outage.away(exc)
        self._sync_journal()

    def _just_back(self) -> bool:
        """The store is away, or came back less than a lease ago: leases that expired
        meanwhile are no sign of lost runners (none could renew), so reaping waits until
        they had a lease's time to renew (a reap must not be the first write to succeed)."""
        away = self.outage.since is not None
        return away or time.monotonic() - self.outage.back_at < self.lease_s

    def _store_back(self) -> None:
        self.outage.back()

    async def _anything_left(self) -> bool:
        try:
            return await asyncio.to_thread(claims.remaining, self.store, self.pod) > 0
        except JobStoreError:  # cannot tell: keep going, the claim will report it
            return True

    async def _beat_forever(self) -> None:
        """Renew every lease this runner holds in one statement, each ``beat_s``; a cancel
        or a lost lease stops its attempt."""
        while True:
            await asyncio.sleep(self.beat_s)
            held = [a for a in self.held.values() if a.why != "lost"]
            if not held:
                continue
            try:
                cancel, lost = await asyncio.to_thread(
                    claims.heartbeat_many, self.store, [a.claim for a in held], self.lease_s
                )
            except JobStoreError as exc:
                self._store_away(exc)
                continue
            self._store_back()
            for attempt in held:
                if attempt.key in lost:
                    attempt.stop_for("lost")
                elif attempt.key in cancel:
                    attempt.stop_for("cancel")

    async def _watch_pod(self) -> None:
        """A pod runner whose pod is gone stops leasing and gives its job back."""
        if getattr(self.executor, "gone", None) is None:
            return
        while True:
            if self._pod_gone():
                return
            await asyncio.sleep(WATCH_S)

    def _pod_gone(self) -> bool:
        gone = getattr(self.executor, "gone", None)
        if self.gone is None and gone is not None and (why := gone()) is not None:
            self.gone = why
            self.say(f"runner {self.owner}: {why}: giving its job back and stopping")
            for attempt in self.held.values():
                attempt.stop_for("shutdown")
            self.shutdown.set()
        return self.gone is not None

    async def run_one(self, claim: Claim) -> None:
        job = claim.job
        attempt = _Attempt(
            claim, claim.next_seq, lines=self.buffer(), marked_started=self.starts_at_once
        )
        self.held[attempt.key] = attempt
        named = f" ({job.name})" if job.name else ""
        self.say(f"job {job.id} attempt {claim.attempt}: started{named}")
        began = time.monotonic()
        hooks = Hooks(on_line=attempt.line, on_started=attempt.mark_started)
        if self.shutdown.is_set():
            attempt.stop_for("shutdown")
        try:
            try:  # its lines and its start are written meanwhile by _flush_forever
                outcome = await self.executor.execute(job, claim.attempt, hooks, attempt.stop)
            except Exception as exc:  # a bug in running it: recorded on the job, not hidden
                error = f"runner error: {type(exc).__name__}: {exc}"
                outcome = Outcome(JobStatus.FAILED, error=error)
            plan = self._plan(attempt, outcome)
            if plan.kept:
                self._keep(attempt, plan, outcome)
            await self._write_rest(attempt)
            ended = await self._end(attempt, plan)
            if plan.kept:
                self._settle(attempt, outcome, ended)
        finally:
            del self.held[attempt.key]
            attempt.lines.close()
            self._free_slot(attempt)  # if it failed before its end
        self.done += 1
        self.say(
            f"job {job.id} attempt {claim.attempt}: {ended} in {time.monotonic() - began:.2f}s"
        )

    async def _flush_forever(self) -> None:
        """Every ``FLUSH_S``, write what the running attempts printed (and a pod job's start);
        while the store is away, try every ``RETRY_S``."""
        while True:
            await asyncio.sleep(FLUSH_S if self.outage.since is None else RETRY_S)
            for attempt in list(self.held.values()):
                if not await self._write_progress(attempt):
                    break  # the store is away: the others wait for the next try

    async def _write_rest(self, attempt: _Attempt) -> None:
        """Before its ending, everything the attempt printed: if the store is away, wait for
        it, as the ending itself does (a runner stopping gives up after ``END_TRIES``)."""
        tries = 0
        while not await self._write_progress(attempt):
            tries += 1
            if self.shutdown.is_set() and tries >= END_TRIES:
                return
            await asyncio.sleep(RETRY_S)

    async def _write_progress(self, attempt: _Attempt) -> bool:
        """Write what the attempt printed so far; False when the store is away."""
        if attempt.why == "lost" or (attempt.marked_started and not attempt.lines):
            return True
        async with attempt.writing:  # the flusher and the attempt's own last flush
            return await self._write_progress_now(attempt)

    async def _write_progress_now(self, attempt: _Attempt) -> bool:
        try:
            if attempt.why != "lost" and attempt.started and not attempt.marked_started:
                await asyncio.to_thread(claims.started, self.store, attempt.claim)
                attempt.marked_started = True
            while attempt.why != "lost" and attempt.lines:
                batch = attempt.lines.peek(WRITE_BATCH)
                resume, attempt.unsure = attempt.unsure, True
                attempt.next_seq = await asyncio.to_thread(
                    functools.partial(claims.append_logs, resume=resume),
                    self.store,
                    attempt.claim,
                    attempt.next_seq,
                    batch,
                )
                attempt.unsure = False
                attempt.lines.consume(len(batch))  # kept until the store had them
        except LeaseLost:
            attempt.stop_for("lost")
        except JobStoreError as exc:  # the database is away: keep running, retry later
            self._store_away(exc)
            return False
        self._store_back()
        return True

    def _plan(self, attempt: _Attempt, outcome: Outcome) -> _Plan:
        """What to write for an ended attempt."""
        claim = attempt.claim
        if attempt.why == "lost":
            return _Plan("lost")
        # a job that failed as its pod went away (its workers stopped) did not fail itself
        if outcome.status is JobStatus.FAILED and self._pod_gone():
            attempt.stop_for("shutdown")
        # nor one whose program had not started as this runner was told to stop: a Ctrl-C
        # reaches the processes a pod job is starting (forked in the terminal's process
        # group, before each has a session of its own), and its ending may come first
        unstarted = outcome.status is JobStatus.FAILED and not attempt.started
        if unstarted and self.shutdown.is_set():
            attempt.stop_for("shutdown")
        # a job that ran to its end as its runner was stopping is recorded, not run again
        stopped = outcome.status is JobStatus.CANCELLED or (
            outcome.status is JobStatus.FAILED and (self.gone is not None or unstarted)
        )
        if attempt.why == "cancel":
            return _Plan("end", Ending(claim, JobStatus.CANCELLED, error="cancelled by request"))
        given_back = attempt.why == "shutdown" and stopped
        if not given_back and not outcome.retry and not _retried(claim, outcome):
            ending = Ending(claim, outcome.status, result=outcome.result, error=outcome.error)
            return _Plan("end", ending)
        if attempt.why == "shutdown":
            return _Plan("release", reason=f"attempt {claim.attempt}: its runner stopped")
        return _Plan("retry", reason=outcome.error or "the attempt was lost")

    def _keep(self, attempt: _Attempt, plan: _Plan, outcome: Outcome) -> None:
        """Put the attempt's outcome in the journal, with every line the store may not have,
        before the first try to write it: from now on it survives this runner."""
        if self.journal is None:
            return
        claim = attempt.claim
        status = plan.ending.status.value if plan.ending is not None else outcome.status.value
        kept = Kept(
            claim.job.id,
            claim.attempt,
            claim.owner,
            plan.action,
            status,
            plan.ending.result if plan.ending is not None else None,
            plan.ending.error if plan.ending is not None else plan.reason,
            time.time(),
        )
        # no await from here to the write: the buffer's first line is at next_seq, even
        # while a write of its lines is under way (those stay in the buffer until it
        # returns; the journal has them too, and a recovery's resume skips what the store
        # took). Not waiting for that write keeps the window where a kill loses the
        # outcome to the microseconds since the executor returned.
        try:
            self.journal.keep(kept, attempt.next_seq, attempt.lines.snapshot(WRITE_BATCH))
            if self.outage.since is not None:  # it may wait there a while
                self.journal.sync()
        except OSError as exc:  # a full disk: the store may take it all the same
            self.say(
                f"runner {self.owner}: cannot keep job {claim.job.id}'s outcome in "
                f"{self.journal.path}: {exc.strerror or exc}"
            )
            return
        if self.outage.since is not None:
            self.say(
                f"job {claim.job.id} attempt {claim.attempt}: {status}; kept in "
                f"{self.journal.path} until the job store takes it"
            )

    def _settle(self, attempt: _Attempt, outcome: Outcome, ended: str) -> None:
        """The journal's part once the attempt's end was written, or could not be."""
        if self.journal is None or ended.startswith("not recorded"):
            return  # left in the journal: this runner's next start, or another, records it
        if ended.startswith("lease lost"):  # another attempt began: say so on the job
            claim = attempt.claim
            late = (
                f"{outcome.status.value} on runner {self.owner}, after its lease was lost "
                f"(the job had gone on without it)"
            )
            entry = Entry(claim.attempt, self.owner, None, time.time(), LATE, late)
            with contextlib.suppress(JobStoreError):
                claims.add_note(self.store, claim.job.id, entry)
        with contextlib.suppress(OSError):
            self.journal.done(attempt.key)

    async def _end(self, attempt: _Attempt, plan: _Plan) -> str:
        """Record how the attempt ended (its slot is free from now); returns what to say."""
        if plan.action == "lost":
            self._free_slot(attempt)
            return "lease lost, not recorded"
        if plan.action in ("retry", "release"):
            try:
                said = await self._give_back(attempt, plan)
            finally:
                self._free_slot(attempt)
            return said or ("given back" if plan.action == "release" else "retried")
        assert plan.ending is not None
        told: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._endings.append((plan.ending, told))
        self._free_slot(attempt)
        return await told or plan.ending.status.value

    def _free_slot(self, attempt: _Attempt) -> None:
        if not attempt.freed:
            attempt.freed = True
            self._active -= 1
            self._changed.set()

    async def _give_back(self, attempt: _Attempt, plan: _Plan) -> str | None:
        """A runner stopping releases the job; a broken attempt is retried (one at a time:
        both are rare)."""
        claim = attempt.claim
        for _ in range(END_TRIES):
            try:
                if plan.action == "release":
                    await asyncio.to_thread(claims.release, self.store, claim, plan.reason)
                else:
                    await asyncio.to_thread(claims.retry, self.store, claim, plan.reason)
                self._store_back()
                return None
            except LeaseLost:
                return "lease lost, not recorded"
            except JobStoreError as exc:
                self._store_away(exc)
                await asyncio.sleep(RETRY_S)
        return "not recorded: the job store stayed away"
