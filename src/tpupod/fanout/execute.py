"""Run one command on many workers at once, and say how each one ended.

The engine never raises mid-flight: every worker ends with a
:class:`WorkerResult` (success, failure, timeout, stopped, unreachable), and
the caller decides what a failure means (``FanoutResult.raise_for_failures``).
Policies:

* ``on_fail=KILL``: the first worker that fails stops every other one.
* ``timeout``: at that many seconds, every worker still running is stopped.
* ``interrupt``: a Ctrl-C or SIGTERM of the caller stops every worker; a
  second request kills at once.
* ``supervision``: failures a worker reports itself before its process ends
  (``tpupod run``'s workers do, see ``launch/exits.py``) count as soon as they
  arrive, and the supervisor hears when the fan-out starts stopping workers.

Stopping a worker means its transport's ``kill``: TERM to the command's whole
process group, then KILL after ``grace`` seconds.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tpupod.base import limits
from tpupod.errors import WorkerError
from tpupod.fanout.context import Context, Interrupt, NoticeHandler, Sinks
from tpupod.fanout.results import (
    DEFAULT_GRACE_S,
    FanoutResult,
    OnFail,
    Outcome,
    WorkerResult,
)
from tpupod.fanout.worker import LineHandler, WorkerRun
from tpupod.pod.record import Pod, Worker
from tpupod.providers import Connector, provider_for, worker_environment
from tpupod.transport import ExitStatus, Transport

# How long after the first failure the others are stopped: processes that end together (a
# crash that takes several workers down) reach us a few milliseconds apart.
SETTLE_S = 0.05

INTERRUPT_REASONS: dict[int, tuple[str, str]] = {
    signal.SIGINT: ("interrupted (Ctrl-C)", "press Ctrl-C again to kill at once"),
    signal.SIGTERM: ("terminated (SIGTERM)", ""),
    signal.SIGPIPE: ("our output was closed", ""),
}

Action = Callable[[Worker, Transport], Awaitable[str | None]]
# Open files a worker's command may take here: a connection, or three pipes and the guard's.
FILES_PER_WORKER = 4


@dataclass(frozen=True)
class Policy:
    """What to do when a worker fails, when time is up, and how long TERM may take."""

    on_fail: OnFail = OnFail.WAIT
    timeout: float | None = None
    grace: float = DEFAULT_GRACE_S


@dataclass(frozen=True)
class FailureReport:
    """A worker's own word that its program failed, sent before its process ends.

    ``reason`` (an exception's type and message, ``sys.exit(3)``) is shown in
    place of the worker's last line. With neither ``reason`` nor ``status``, the
    worker vanished without a word (its supervisor's connection closed): not a
    failure by itself, but when another worker fails after that, the one that
    vanished is counted as failing first.
    """

    worker: int
    reason: str | None
    status: ExitStatus | None = None  # when the failure is the process's exit itself
    code: int | None = None  # the exit code the program gave itself (sys.exit(N)), if said


class Supervision:
    """The link between a fan-out and an outside supervisor (the rendezvous of ``tpupod run``).

    The supervisor calls :meth:`report_failure` when a worker says it is
    failing; the fan-out calls ``on_stopping(reason)`` when it begins to stop
    the workers still running, so the supervisor can tell them to exit too.
    """

    def __init__(self, on_stopping: Callable[[str], None] | None = None) -> None:
        # Failures in the order they were learned: reports, and exits as they happen.
        self.reports: asyncio.Queue[FailureReport] = asyncio.Queue()
        self.on_stopping = on_stopping or (lambda reason: None)
        # The first worker that failed by itself, from the moment it is known (before the
        # fan-out acts on it): what the others print after that is collateral.
        self.first_failed: int | None = None
        self.stop_begun = False  # from here on, failures are the stop's doing

    def report_failure(self, worker: int, reason: str | None, code: int | None = None) -> None:
        """``worker`` says it fails, and why (and with which exit code, when it gave one);
        ``reason`` None: it vanished without a word."""
        if reason is not None:
            self.failed(worker)
        self.reports.put_nowait(FailureReport(worker, reason, code=code))

    def failed(self, worker: int) -> None:
        if self.first_failed is None and not self.stop_begun:
            self.first_failed = worker

    def stopping(self, reason: str) -> None:
        self.stop_begun = True
        self.on_stopping(reason)


class _Fanout:
    """The controller: watches every worker's run and applies the policies."""

    def __init__(
        self,
        runs: list[WorkerRun],
        command: str,
        policy: Policy,
        interrupt: Interrupt | None,
        on_notice: NoticeHandler | None,
        *,
        supervision: Supervision | None = None,
    ) -> None:
        self.runs = runs
        self.by_id = {run.worker.id: run for run in runs}
        self.supervision = supervision or Supervision()
        for run in runs:
            run.on_exit = self._exited
        self.command = command
        self.on_fail = policy.on_fail
        self.timeout = policy.timeout
        self.grace = policy.grace
        self.interrupt = interrupt or Interrupt()
        self.on_notice = on_notice or (lambda text: None)
        self.results: dict[int, WorkerResult] = {}
        self.failure_order: list[int] = []
        self.stoppers: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.stop_due: float | None = None  # when to act on the first failure
        self.vanished: list[int] = []
        self.forced = False
        self.timed_out = False

    async def run(self) -> FanoutResult:
        started = time.monotonic()
        tasks = {asyncio.create_task(run.run()): run for run in self.runs}
        pending = set(tasks)
        try:
            await self._watch(pending, started)
        finally:
            if pending:  # we were cancelled: leave nothing running, then let every run end
                await asyncio.shield(self._abandon(pending))
            await asyncio.gather(*self.stoppers)
        ordered = [self.results[run.worker.id] for run in self.runs]
        return FanoutResult(
            command=self.command,
            workers=ordered,
            elapsed=time.monotonic() - started,
            failure_order=self.failure_order,
            timed_out=self.timed_out,
            interrupt_signal=self.interrupt.signal if self.interrupt.requested.is_set() else None,
            stopped_by=self.interrupt.by if self.interrupt.requested.is_set() else None,
        )

    async def _watch(self, pending: set[asyncio.Task[WorkerResult]], started: float) -> None:
        interrupted = asyncio.create_task(self.interrupt.requested.wait())
        forced = asyncio.create_task(self.interrupt.forced.wait())
        reports = self.supervision.reports
        report = asyncio.create_task(reports.get())
        try:
            while pending:
                deadline = None
                if self.timeout is not None and not self.timed_out:
                    deadline = started + self.timeout
                wake = min((t for t in (deadline, self.stop_due) if t is not None), default=None)
                watch: set[asyncio.Future[Any]] = {*pending, forced, report}
                if not interrupted.done():
                    watch.add(interrupted)
                done, _ = await asyncio.wait(
                    watch,
                    timeout=None if wake is None else max(0.0, wake - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if report in done:
                    self._reported(report.result())
                    report = asyncio.create_task(reports.get())
                finished = [t for t in pending if t in done]
                pending.difference_update(finished)
                # Record every run that ended in this round before acting on any of them, so
                # a stop never counts (or signals) workers that are already gone.
                for task in finished:
                    self._record(task.result())
                self._act_on_failures()
                if interrupted in done and not forced.done():
                    why = INTERRUPT_REASONS.get(self.interrupt.signal or 0, ("interrupted", ""))
                    if self.interrupt.grace is not None:  # e.g. a preemption notice's grace
                        self.grace = self.interrupt.grace
                    reason, extra = (self.interrupt.reason, "") if self.interrupt.reason else why
                    self._begin_stop(Outcome.INTERRUPTED, reason, extra)
                if forced.done() and not self.forced:
                    self.forced = True
                    self._spawn_stop(Outcome.INTERRUPTED, 0.0)
                if deadline is not None and time.monotonic() >= deadline:
                    self.timed_out = True
                    self._begin_stop(Outcome.TIMED_OUT, f"timeout of {self.timeout:g}s reached")
        finally:
            interrupted.cancel()
            forced.cancel()
            report.cancel()

    def _exited(self, worker: int, status: ExitStatus) -> None:
        if not status.ok:
            if self.by_id[worker].stop_outcome is None:
                self.supervision.failed(worker)
            self.supervision.reports.put_nowait(FailureReport(worker, None, status))

    def _reported(self, report: FailureReport) -> None:
        """A worker says it failed: it counts now, in the order failures were learned."""
        run = self.by_id.get(report.worker)
        if run is None or run.stop_outcome is not None:
            return  # unknown, or being stopped for another worker's failure
        if report.reason is None and report.status is None:
            self.vanished.append(report.worker)
            return
        if run.worker.id in self.results:
            return
        run.failing, run.reason = True, run.reason or report.reason
        run.exit_status = run.exit_status or report.status
        run.own_code = run.own_code or report.code
        self._count_failure(report.worker)

    def _count_failure(self, worker: int) -> None:
        """``worker`` failed: after any worker that vanished before, and failed or is running."""
        for gone in self.vanished:
            result = self.results.get(gone)
            if gone != worker and gone not in self.failure_order and not (result and result.ok):
                self.by_id[gone].failing = True
                self.failure_order.append(gone)
        if worker not in self.failure_order:
            self.failure_order.append(worker)

    def _record(self, result: WorkerResult) -> None:
        self.results[result.worker.id] = result
        failed = result.worker.id in self.failure_order
        if not result.ok and not failed:
            self._count_failure(result.worker.id)
        elif result.ok and failed:  # it vanished without a word, yet exited 0 (os._exit(0))
            self.failure_order.remove(result.worker.id)

    def _act_on_failures(self) -> None:
        """On the first failure, stop the others (after SETTLE_S: workers that fail together
        are then all counted as failed, and none is told to stop after it has ended)."""
        if self.on_fail is not OnFail.KILL or self.stopping or not self.failure_order:
            return
        if self.stop_due is None:
            self.stop_due = time.monotonic() + SETTLE_S
        if time.monotonic() < self.stop_due:
            return
        self.stop_due = None
        first = self.failure_order[0]
        result = self.results.get(first)
        run = self.by_id[first]
        if result is not None:
            what = result.outcome_text()
        elif run.exit_status is not None:
            what = run.exit_status.describe()
        else:
            what = "" if run.reason else "its process ended without a word"
        if run.reason and run.reason not in what:
            what = f"{what}: {run.reason}" if what else run.reason
        gentle = self._ended_by_term(first)
        self._begin_stop(Outcome.STOPPED, f"w{first} failed ({what})", by=first, gentle=gentle)

    def _ended_by_term(self, worker: int) -> bool:
        """Did ``worker`` end as TERM ends a program (killed by it, or exit 143 = 128+TERM),
        a TERM we did not send? It most likely had a notice (a host shutting down: GCE's
        preemption notice TERMs every process), and so did the others: they get TERM and
        the grace, not the rendezvous's "leave now", so that their save is not cut short
        by the one that finished saving first."""
        result, run = self.results.get(worker), self.by_id[worker]
        status = result.status if result is not None else run.exit_status
        said = {run.own_code, status.shell_code if status is not None else None}
        return 128 + signal.SIGTERM in said

    def _begin_stop(
        self,
        outcome: Outcome,
        reason: str,
        extra: str = "",
        by: int | None = None,
        *,
        gentle: bool = False,
    ) -> None:
        running = [run for run in self.runs if run.worker.id not in self.results and run.running]
        if not running:
            return
        self.stopping = True
        for run in running:  # before any worker can end because of the stop
            run.mark_stopping(outcome, self.grace, by)
        plan = f"TERM, then KILL after {self.grace:g}s" if self.grace > 0 else "KILL"
        note = (
            f"{reason}: stopping {len(running)} worker{'s' if len(running) != 1 else ''} ({plan})"
        )
        self.on_notice(f"{note}; {extra}" if extra else note)
        if gentle or (outcome is Outcome.INTERRUPTED and self.interrupt.grace is not None):
            # A stop with its own grace (a preemption notice), or after a worker ended by a
            # TERM: the programs get TERM and the grace to save; the rendezvous does not
            # tell them to leave at once.
            self.supervision.stop_begun = True
        else:
            self.supervision.stopping(reason)
        self._spawn_stop(outcome, self.grace, by)

    def _spawn_stop(self, outcome: Outcome, grace: float, by: int | None = None) -> None:
        task = asyncio.create_task(self._stop_all(outcome, grace, by))
        self.stoppers.add(task)

    async def _abandon(self, pending: set[asyncio.Task[WorkerResult]]) -> None:
        await self._stop_all(Outcome.INTERRUPTED, 0.0)
        await asyncio.wait(pending)

    async def _stop_all(self, outcome: Outcome, grace: float, by: int | None = None) -> None:
        running = [run for run in self.runs if run.worker.id not in self.results and run.running]
        await asyncio.gather(*(run.stop(outcome, grace, by) for run in running))


async def run_on(
    ctx: Context,
    command: str,
    *,
    workers: str | Sequence[Worker] | None = None,
    policy: Policy = Policy(),
    env: dict[str, str] | None = None,
    guard: bool = False,
    supervision: Supervision | None = None,
    chatter: Callable[[Worker], Callable[[str], str | None]] | None = None,
    worker_env: Callable[[Worker], dict[str, str]] | None = None,
) -> FanoutResult:
    """Run ``command`` (a bash command line) on the selected workers of the context's pod
    at once, its output to the context's sinks; returns when every worker's command has
    ended, and never raises for a worker's failure.

    ``workers`` is a selection such as ``"0,2-3"`` or a list of workers (default: all).
    ``guard`` kills the commands if this process dies while they run (see
    ``transport.base.command_script``). ``chatter`` makes, for each worker (given it), a
    cleaner of its lines (it may keep state from one line to the next) that takes a
    runtime's own noise out of a line, or returns None for a line of nothing else:
    ``on_line`` still gets every line as it came, the summary's last lines only what the
    cleaner kept. ``worker_env`` gives each worker variables of its own (``env`` wins).
    """
    pod, sinks = ctx.pod, ctx.sinks
    provider = provider_for(pod.provider)
    selected = pod.select(workers) if workers is None or isinstance(workers, str) else list(workers)
    short = limits.open_files(FILES_PER_WORKER * len(selected))
    if short:
        sinks.on_notice(f"warning: {short}")
    runs = []
    for worker in selected:
        own = worker_env(worker) if worker_env is not None else {}
        environment = worker_environment(pod, worker, {**own, **(env or {})}, provider)
        transport = ctx.connector.transport(worker)
        run = WorkerRun(worker, transport, command, environment, sinks.on_line, guard=guard)
        run.chatter = chatter(worker) if chatter is not None else None
        runs.append(run)
    fanout = _Fanout(
        runs, command, policy, sinks.interrupt, sinks.on_notice, supervision=supervision
    )
    return await fanout.run()


async def each_on(
    ctx: Context, action: Action, *, workers: str | Sequence[Worker] | None = None
) -> FanoutResult:
    """Run ``action(worker, transport)`` for every selected worker at once (put, get, ...).

    The action returns a one-line summary for the table; a ``WorkerError`` it
    raises becomes that worker's failure. Never raises for a worker.
    """
    pod = ctx.pod
    selected = pod.select(workers) if workers is None or isinstance(workers, str) else list(workers)
    started = time.monotonic()

    async def one(worker: Worker) -> WorkerResult:
        began = time.monotonic()
        try:
            summary = await action(worker, ctx.connector.transport(worker))
        except WorkerError as exc:
            outcome = Outcome.UNREACHABLE if exc.unreachable else Outcome.FAILED
            return WorkerResult(
                worker, outcome, time.monotonic() - began, error=exc.reason, hint=exc.hint
            )
        tail = (summary,) if summary else ()
        return WorkerResult(worker, Outcome.OK, time.monotonic() - began, tail=tail)

    results = await asyncio.gather(*(one(worker) for worker in selected))
    failures = [r.worker.id for r in sorted(results, key=lambda r: r.duration) if not r.ok]
    return FanoutResult("", list(results), time.monotonic() - started, failure_order=failures)


async def execute_async(
    pod: Pod,
    command: str,
    *,
    workers: str | Sequence[Worker] | None = None,
    on_fail: OnFail | str = OnFail.WAIT,
    timeout: float | None = None,
    grace: float = DEFAULT_GRACE_S,
    env: dict[str, str] | None = None,
    on_line: LineHandler | None = None,
    on_notice: NoticeHandler | None = None,
    interrupt: Interrupt | None = None,
    connector: Connector | None = None,
) -> FanoutResult:
    """The Python API's fan-out (``tpupod.execute_async``): :func:`run_on` in a context of
    its own made from these arguments. Pass a ``connector``
    (``tpupod.providers.connect(pod)``) to reuse connections across calls; it is then yours
    to close."""
    sinks = Sinks(on_line, on_notice, interrupt)
    async with Context(pod, sinks, connector=connector) as ctx:
        policy = Policy(OnFail(on_fail), timeout, grace)
        return await run_on(ctx, command, workers=workers, policy=policy, env=env)


async def for_each(
    pod: Pod,
    action: Action,
    *,
    workers: str | Sequence[Worker] | None = None,
    connector: Connector | None = None,
) -> FanoutResult:
    """:func:`each_on` in a context of its own (the Python API's form)."""
    async with Context(pod, connector=connector) as ctx:
        return await each_on(ctx, action, workers=workers)


def execute(pod: Pod, command: str, **options: Any) -> FanoutResult:
    """Blocking form of :func:`execute_async` (same options), for scripts without an event loop."""
    return asyncio.run(execute_async(pod, command, **options))
