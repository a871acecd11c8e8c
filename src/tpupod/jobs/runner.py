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

from tpupod.errors import JobError, JobStoreError, LeaseLost
from tpupod.jobs import claims
from tpupod.jobs.attempt import Executor, Hooks, Outcome
from tpupod.jobs.claims import Ending
from tpupod.jobs.linebuffer import LineBuffer
from tpupod.jobs.models import Claim, JobStatus
from tpupod.jobs.store import RETRY_S, Outage, Store
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

    async def serve(self, *, until_empty: bool = False, max_jobs: int | None = None) -> int:
        """Run jobs until ``shutdown`` is set (or the queue is empty, or ``max_jobs``).

        A pod runner is its pod's registered user while it serves (``tpupod down`` can
        tell); if the pod goes, it gives its job back and stops (``JobError``)."""
        serving = getattr(self.executor, "serving", None)
        with serving() if serving is not None else contextlib.nullcontext():
            done = await self._serve(until_empty=until_empty, max_jobs=max_jobs)
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
                if time.monotonic() - reaped_at > self.lease_s / 3 and not self._just_back():
                    await self._reap()
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

    async def _reap(self) -> None:
        try:
            # never its own: after an outage longer than a lease, this runner's jobs are
            # still running here, and its next heartbeat renews them
            if reaped := await asyncio.to_thread(claims.reap, self.store, spare=self.owner):
                self.say(f"requeued or failed {reaped} job(s) whose runner was lost")
            self._store_back()
            tidy = getattr(self.executor, "tidy", None)  # what a lost runner left running
            if tidy is not None:
                await tidy(self.store)
        except JobStoreError as exc:  # the next round retries
            self._store_away(exc)
        except JobError as exc:  # the cluster is away: the next round retries
            self.say(f"runner {self.owner}: {exc.message}")

    def _store_away(self, exc: JobStoreError) -> None:
        """Say that the store is away once, when the outage starts; retry quietly."""
        self.outage.away(exc)

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
            await self._write_rest(attempt)
            ended = await self._end(attempt, outcome)
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

    async def _end(self, attempt: _Attempt, outcome: Outcome) -> str:
        """Record how the attempt ended (its slot is free from now); returns what to say."""
        claim = attempt.claim
        if attempt.why == "lost":
            self._free_slot(attempt)
            return "lease lost, not recorded"
        # a job that failed as its pod went away (its workers stopped) did not fail itself
        if outcome.status is JobStatus.FAILED and self._pod_gone():
            attempt.stop_for("shutdown")
        # a job that ran to its end as its runner was stopping is recorded, not run again
        stopped = outcome.status is JobStatus.CANCELLED or (
            self.gone is not None and outcome.status is JobStatus.FAILED
        )
        given_back = attempt.why == "shutdown" and stopped
        if attempt.why == "cancel":
            ending = Ending(claim, JobStatus.CANCELLED, error="cancelled by request")
        elif not given_back and not outcome.retry and not _retried(claim, outcome):
            ending = Ending(claim, outcome.status, result=outcome.result, error=outcome.error)
        else:
            try:
                said = await self._give_back(attempt, outcome)
            finally:
                self._free_slot(attempt)
            return said or ("given back" if given_back else "retried")
        told: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._endings.append((ending, told))
        self._free_slot(attempt)
        return await told or ending.status.value

    def _free_slot(self, attempt: _Attempt) -> None:
        if not attempt.freed:
            attempt.freed = True
            self._active -= 1
            self._changed.set()

    async def _give_back(self, attempt: _Attempt, outcome: Outcome) -> str | None:
        """A runner stopping releases the job; a broken attempt is retried (one at a time:
        both are rare)."""
        claim = attempt.claim
        for _ in range(END_TRIES):
            try:
                if attempt.why == "shutdown":
                    reason = f"attempt {claim.attempt}: its runner stopped"
                    await asyncio.to_thread(claims.release, self.store, claim, reason)
                else:
                    reason = outcome.error or "the attempt was lost"
                    await asyncio.to_thread(claims.retry, self.store, claim, reason)
                self._store_back()
                return None
            except LeaseLost:
                return "lease lost, not recorded"
            except JobStoreError as exc:
                self._store_away(exc)
                await asyncio.sleep(RETRY_S)
        return "not recorded: the job store stayed away"
