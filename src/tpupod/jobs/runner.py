"""A runner: claim jobs, run their attempts (here or on a pod), keep the leases, write fenced.

A runner runs up to ``concurrency`` attempts at once (a pod runner one: a pod runs one
gang job at a time). Its writes are batched where the fencing allows: one statement
claims as many jobs as it has free slots, one heartbeat renews every lease it holds,
and attempts that end while another ending is being committed are written together,
one commit, each row still fenced by its own (job id, attempt). Every runner also reaps
expired leases, so a runner killed with ``kill -9`` costs its jobs one lease period,
never the jobs.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tpupod.errors import JobError, JobStoreError, LeaseLost
from tpupod.jobs import claims
from tpupod.jobs.claims import Ending
from tpupod.jobs.execute import Executor, Hooks, Outcome
from tpupod.jobs.models import Claim, JobStatus
from tpupod.jobs.store import Store
from tpupod.jobs.wakeup import Wakeup

DEFAULT_LEASE_S = 15.0
FLUSH_S = 0.2
HEARTBEAT_MAX_S = 1.0
ENDINGS = {"cancel": "cancelled", "lost": "lease lost", "shutdown": "given back"}
UNTIL_EMPTY_POLL_S = 0.2
END_TRIES = 30  # the database may be restarting: the lease covers a while


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class _Attempt:
    """What one attempt gathers while it runs."""

    claim: Claim
    next_seq: int
    pending: list[tuple[int, str]] = field(default_factory=list)
    started: bool = False
    marked_started: bool = False
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    why: str | None = None  # "cancel", "lost", "shutdown"

    @property
    def key(self) -> claims.Attempt:
        return (self.claim.job.id, self.claim.attempt)

    def line(self, worker: int, text: str) -> None:
        self.pending.append((worker, text))

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
    ) -> None:
        self.store, self.executor, self.pod = store, executor, pod
        self.lease_s = lease_s
        # a heartbeat also brings a cancel back: often enough that a cancel is felt quickly
        self.beat_s = min(lease_s / 3, HEARTBEAT_MAX_S)
        self.owner = owner or new_owner()
        self.say = on_event or (lambda text: None)
        self.concurrency = max(1, concurrency)
        # a local executor starts a job the moment it has it: the claim marks it running
        self.starts_at_once = bool(getattr(executor, "starts_at_once", False))
        self.shutdown = asyncio.Event()
        self.done = 0
        self.held: dict[claims.Attempt, _Attempt] = {}
        self._endings: list[tuple[Ending, asyncio.Future[str]]] = []
        self._flushing: asyncio.Task[None] | None = None

    async def serve(self, *, until_empty: bool = False, max_jobs: int | None = None) -> int:
        """Run jobs until ``shutdown`` is set (or the queue is empty, or ``max_jobs``)."""
        wakeup = Wakeup(self.store)
        beating = asyncio.create_task(self._beat_forever())
        running: set[asyncio.Task[None]] = set()
        claimed = 0
        reaped_at = 0.0
        try:
            while not self.shutdown.is_set():
                if time.monotonic() - reaped_at > self.lease_s / 3:
                    await self._reap()
                    reaped_at = time.monotonic()
                free = self.concurrency - len(running)
                if max_jobs is not None:
                    free = min(free, max_jobs - claimed)
                got = await self._claim(free) if free > 0 else []
                for claim in got:
                    task = asyncio.create_task(self.run_one(claim))
                    running.add(task)
                    task.add_done_callback(running.discard)
                claimed += len(got)
                if got and len(got) == free and len(running) < self.concurrency:
                    continue  # there may be more, and room for them
                if not running:
                    if max_jobs is not None and claimed >= max_jobs:
                        break
                    if until_empty and not await self._anything_left():
                        break
                # --until-empty: others' last jobs end without a notice, so look again soon
                timeout = UNTIL_EMPTY_POLL_S if until_empty else self.lease_s / 3
                full = len(running) >= self.concurrency or (
                    max_jobs is not None and claimed >= max_jobs
                )
                await self._idle(wakeup, timeout, running, listen=not full)
        finally:
            for attempt in self.held.values():
                attempt.stop_for("shutdown")
            if running:
                await asyncio.wait(running)
            beating.cancel()
            await wakeup.close()
        return self.done

    async def _idle(
        self,
        wakeup: Wakeup,
        timeout: float,
        running: set[asyncio.Task[None]],
        *,
        listen: bool,
    ) -> None:
        """Until there may be work or a free slot (or ``timeout`` has passed), or shutdown."""
        waits: set[asyncio.Future[object]] = {asyncio.ensure_future(self.shutdown.wait())}
        if listen:
            waits.add(asyncio.ensure_future(wakeup.wait(timeout)))
        else:
            waits.add(asyncio.ensure_future(asyncio.sleep(timeout)))
        await asyncio.wait(waits | set(running), return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()

    async def _claim(self, limit: int) -> list[Claim]:
        try:
            return await asyncio.to_thread(
                claims.claim_many,
                self.store,
                self.owner,
                pod=self.pod,
                lease_s=self.lease_s,
                limit=limit,
                running=self.starts_at_once,
            )
        except JobStoreError as exc:
            self.say(f"runner {self.owner}: {exc.message}; retrying")
            await asyncio.sleep(1.0)
            return []

    async def _reap(self) -> None:
        try:
            if reaped := await asyncio.to_thread(claims.reap, self.store):
                self.say(f"requeued or failed {reaped} job(s) whose runner was lost")
            tidy = getattr(self.executor, "tidy", None)  # what a lost runner left running
            if tidy is not None:
                await tidy(self.store)
        except JobError as exc:  # the store or the cluster is away: the next round retries
            self.say(f"runner {self.owner}: {exc.message}")

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
                self.say(f"runner {self.owner}: heartbeat failed: {exc.message}")
                continue
            for attempt in held:
                if attempt.key in lost:
                    attempt.stop_for("lost")
                elif attempt.key in cancel:
                    attempt.stop_for("cancel")

    async def run_one(self, claim: Claim) -> None:
        job = claim.job
        attempt = _Attempt(claim, claim.next_seq, marked_started=self.starts_at_once)
        self.held[attempt.key] = attempt
        named = f" ({job.name})" if job.name else ""
        self.say(f"job {job.id} attempt {claim.attempt}: started{named}")
        began = time.monotonic()
        hooks = Hooks(on_line=attempt.line, on_started=attempt.mark_started)
        if self.shutdown.is_set():
            attempt.stop_for("shutdown")
        running = asyncio.create_task(
            self.executor.execute(job, claim.attempt, hooks, attempt.stop)
        )
        try:
            while not running.done():
                await asyncio.wait({running}, timeout=FLUSH_S)
                if self.shutdown.is_set():
                    attempt.stop_for("shutdown")
                await self._write_progress(attempt)
            outcome = _outcome_of(running)
            await self._write_progress(attempt)
            ended = await self._end(attempt, outcome)
        finally:
            del self.held[attempt.key]
        self.done += 1
        ending = "retried" if outcome.retry else outcome.status.value
        self.say(
            f"job {job.id} attempt {claim.attempt}: "
            f"{ENDINGS.get(attempt.why or '', ended or ending)} "
            f"in {time.monotonic() - began:.2f}s"
        )

    async def _write_progress(self, attempt: _Attempt) -> None:
        if attempt.why == "lost" or (attempt.marked_started and not attempt.pending):
            return
        try:
            if attempt.started and not attempt.marked_started:
                await asyncio.to_thread(claims.started, self.store, attempt.claim)
                attempt.marked_started = True
            if attempt.pending:
                lines, attempt.pending = attempt.pending, []
                attempt.next_seq = await asyncio.to_thread(
                    claims.append_logs, self.store, attempt.claim, attempt.next_seq, lines
                )
        except LeaseLost:
            attempt.stop_for("lost")
        except JobStoreError as exc:  # the database is away: keep running, retry later
            self.say(f"job {attempt.claim.job.id}: {exc.message}")

    async def _end(self, attempt: _Attempt, outcome: Outcome) -> str | None:
        """Record how the attempt ended; returns what to say instead of its status, if any."""
        claim = attempt.claim
        if attempt.why == "lost":
            return "lease lost, not recorded"
        if attempt.why == "cancel":
            ending = Ending(claim, JobStatus.CANCELLED, error="cancelled by request")
        elif attempt.why != "shutdown" and not outcome.retry:
            ending = Ending(claim, outcome.status, result=outcome.result, error=outcome.error)
        else:
            return await self._give_back(attempt, outcome)
        told: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._endings.append((ending, told))
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush_endings())
        return await told or None

    async def _flush_endings(self) -> None:
        """Write every ending queued so far in one transaction; those that end meanwhile
        wait for the next one (group commit: the busier the runner, the bigger the batch)."""
        while self._endings:
            batch, self._endings = self._endings, []
            said = "not recorded: the job store stayed away"
            for tries in range(END_TRIES):
                try:
                    lost = await asyncio.to_thread(
                        claims.finish_many, self.store, [end for end, _ in batch]
                    )
                    said = ""
                    break
                except JobStoreError as exc:
                    self.say(f"runner {self.owner}: {exc.message}; retrying ({tries + 1})")
                    await asyncio.sleep(0.5)
            for end, told in batch:
                if not said and (end.claim.job.id, end.claim.attempt) in lost:
                    told.set_result("lease lost, not recorded")
                else:
                    told.set_result(said)
        self._flushing = None

    async def _give_back(self, attempt: _Attempt, outcome: Outcome) -> str | None:
        """A runner stopping releases the job; a broken attempt is retried (one at a time:
        both are rare)."""
        claim = attempt.claim
        for tries in range(END_TRIES):
            try:
                if attempt.why == "shutdown":
                    reason = f"attempt {claim.attempt}: its runner stopped"
                    await asyncio.to_thread(claims.release, self.store, claim, reason)
                else:
                    reason = outcome.error or "the attempt was lost"
                    await asyncio.to_thread(claims.retry, self.store, claim, reason)
                return None
            except LeaseLost:
                return "lease lost, not recorded"
            except JobStoreError as exc:
                self.say(f"job {claim.job.id}: {exc.message}; retrying ({tries + 1})")
                await asyncio.sleep(0.5)
        return "not recorded: the job store stayed away"


def _outcome_of(running: asyncio.Task[Outcome]) -> Outcome:
    """The attempt's outcome; a bug in running it fails the attempt with its cause, instead
    of ending the runner with the job still leased (it would wait out its lease)."""
    try:
        return running.result()
    except Exception as exc:  # recorded on the job, not hidden
        return Outcome(JobStatus.FAILED, error=f"runner error: {type(exc).__name__}: {exc}")
