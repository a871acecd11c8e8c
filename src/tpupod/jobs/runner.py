"""A runner: claim a job, run its attempt (here or on a pod), keep the lease, write fenced.

One job at a time per runner (a pod runs one gang job at a time anyway); start more
runner processes for more throughput. Every runner also reaps expired leases, so a
runner killed with ``kill -9`` costs its job one lease period, never the job.
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
from tpupod.jobs.execute import Executor, Hooks, Outcome
from tpupod.jobs.models import Claim, JobStatus
from tpupod.jobs.store import Store
from tpupod.jobs.wakeup import Wakeup

DEFAULT_LEASE_S = 15.0
FLUSH_S = 0.2
HEARTBEAT_MAX_S = 1.0
ENDINGS = {"cancel": "cancelled", "lost": "lease lost", "shutdown": "given back"}
UNTIL_EMPTY_POLL_S = 0.2


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
    ) -> None:
        self.store, self.executor, self.pod = store, executor, pod
        self.lease_s = lease_s
        # a heartbeat also brings a cancel back: often enough that a cancel is felt quickly
        self.beat_s = min(lease_s / 3, HEARTBEAT_MAX_S)
        self.owner = owner or new_owner()
        self.say = on_event or (lambda text: None)
        self.shutdown = asyncio.Event()
        self.done = 0

    async def serve(self, *, until_empty: bool = False, max_jobs: int | None = None) -> int:
        """Run jobs until ``shutdown`` is set (or the queue is empty, or ``max_jobs``)."""
        wakeup = Wakeup(self.store)
        reaped_at = 0.0
        try:
            while not self.shutdown.is_set() and (max_jobs is None or self.done < max_jobs):
                if time.monotonic() - reaped_at > self.lease_s / 3:
                    await self._reap()
                    reaped_at = time.monotonic()
                claim = await self._claim()
                if claim is not None:
                    await self.run_one(claim)
                    continue
                if until_empty and not await self._anything_left():
                    break
                # --until-empty: others' last jobs end without a notice, so look again soon
                await self._idle(wakeup, UNTIL_EMPTY_POLL_S if until_empty else self.lease_s / 3)
        finally:
            await wakeup.close()
        return self.done

    async def _idle(self, wakeup: Wakeup, timeout: float) -> None:
        """Until there may be work (or ``timeout`` has passed), or shutdown."""
        waiting = asyncio.create_task(wakeup.wait(timeout))
        stopping = asyncio.create_task(self.shutdown.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (waiting, stopping):
            task.cancel()

    async def _claim(self) -> Claim | None:
        try:
            return await asyncio.to_thread(
                claims.claim, self.store, self.owner, pod=self.pod, lease_s=self.lease_s
            )
        except JobStoreError as exc:
            self.say(f"runner {self.owner}: {exc.message}; retrying")
            await asyncio.sleep(1.0)
            return None

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

    async def run_one(self, claim: Claim) -> None:
        job = claim.job
        attempt = _Attempt(claim, claim.next_seq)
        named = f" ({job.name})" if job.name else ""
        self.say(f"job {job.id} attempt {claim.attempt}: started{named}")
        began = time.monotonic()
        hooks = Hooks(on_line=lambda w, t: attempt.pending.append((w, t)), on_started=lambda: None)
        hooks.on_started = lambda: setattr(attempt, "started", True)
        running = asyncio.create_task(
            self.executor.execute(job, claim.attempt, hooks, attempt.stop)
        )
        beat_at = time.monotonic()
        while not running.done():
            await asyncio.wait({running}, timeout=FLUSH_S)
            if self.shutdown.is_set():
                attempt.stop_for("shutdown")
            await self._write_progress(attempt)
            if time.monotonic() - beat_at > self.beat_s:
                await self._heartbeat(attempt)
                beat_at = time.monotonic()
        outcome = _outcome_of(running)
        await self._write_progress(attempt)
        await self._end(attempt, outcome)
        self.done += 1
        ending = "retried" if outcome.retry else outcome.status.value
        self.say(
            f"job {job.id} attempt {claim.attempt}: "
            f"{ENDINGS.get(attempt.why or '', ending)} "
            f"in {time.monotonic() - began:.2f}s"
        )

    async def _write_progress(self, attempt: _Attempt) -> None:
        if attempt.why == "lost":
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

    async def _heartbeat(self, attempt: _Attempt) -> None:
        try:
            cancel = await asyncio.to_thread(
                claims.heartbeat, self.store, attempt.claim, self.lease_s
            )
            if cancel:
                attempt.stop_for("cancel")
        except LeaseLost:
            attempt.stop_for("lost")
        except JobStoreError as exc:
            self.say(f"job {attempt.claim.job.id}: heartbeat failed: {exc.message}")

    async def _end(self, attempt: _Attempt, outcome: Outcome) -> None:
        claim = attempt.claim
        for tries in range(30):  # the database may be restarting: the lease covers a while
            try:
                await asyncio.to_thread(self._write_end, attempt, outcome)
                return
            except LeaseLost:
                self.say(f"job {claim.job.id} attempt {claim.attempt}: lease lost, not recorded")
                return
            except JobStoreError as exc:
                self.say(f"job {claim.job.id}: {exc.message}; retrying ({tries + 1})")
                await asyncio.sleep(0.5)

    def _write_end(self, attempt: _Attempt, outcome: Outcome) -> None:
        claim = attempt.claim
        if attempt.why == "lost":
            raise LeaseLost(f"job {claim.job.id}", hint="")
        if attempt.why == "shutdown":
            claims.release(self.store, claim, f"attempt {claim.attempt}: its runner stopped")
        elif attempt.why == "cancel":
            claims.finish(self.store, claim, JobStatus.CANCELLED, error="cancelled by request")
        elif outcome.retry:
            claims.retry(self.store, claim, outcome.error or "the attempt was lost")
        else:
            claims.finish(
                self.store, claim, outcome.status, result=outcome.result, error=outcome.error
            )


def _outcome_of(running: asyncio.Task[Outcome]) -> Outcome:
    """The attempt's outcome; a bug in running it fails the attempt with its cause, instead
    of ending the runner with the job still leased (it would wait out its lease)."""
    try:
        return running.result()
    except Exception as exc:  # recorded on the job, not hidden
        return Outcome(JobStatus.FAILED, error=f"runner error: {type(exc).__name__}: {exc}")
