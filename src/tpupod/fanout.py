"""Run one command on many workers at once, and say how each one ended.

The engine never raises mid-flight: every worker ends with a
:class:`WorkerResult` (success, failure, timeout, stopped, unreachable), and
the caller decides what a failure means (``FanoutResult.raise_for_failures``).
Policies:

* ``on_fail=KILL``: the first worker that fails stops every other one.
* ``timeout``: at that many seconds, every worker still running is stopped.
* ``interrupt``: a Ctrl-C or SIGTERM of the caller stops every worker; a
  second request kills at once.

Stopping a worker means its transport's ``kill``: TERM to the command's whole
process group, then KILL after ``grace`` seconds.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tpupod.errors import WorkerError
from tpupod.pod import Pod, Worker
from tpupod.providers import provider_for
from tpupod.results import (
    DEFAULT_GRACE_S,
    FanoutResult,
    OnFail,
    Outcome,
    WorkerResult,
)
from tpupod.state import StateDir
from tpupod.transport import Connector, ExitStatus, OutputLine, RemoteProcess, Transport

TAIL_LINES = 10
# After a command exits, how long to keep reading output that a background
# child still holds open (as `ssh` would wait forever, and we should not).
OUTPUT_LINGER_S = 2.0

INTERRUPT_REASONS: dict[int, tuple[str, str]] = {
    signal.SIGINT: ("interrupted (Ctrl-C)", "press Ctrl-C again to kill at once"),
    signal.SIGTERM: ("terminated (SIGTERM)", ""),
    signal.SIGPIPE: ("our output was closed", ""),
}

LineHandler = Callable[[Worker, OutputLine], None]
Action = Callable[[Worker, Transport], Awaitable[str | None]]
NoticeHandler = Callable[[str], None]


@dataclass(frozen=True)
class Policy:
    """What to do when a worker fails, when time is up, and how long TERM may take."""

    on_fail: OnFail = OnFail.WAIT
    timeout: float | None = None
    grace: float = DEFAULT_GRACE_S


class Interrupt:
    """A stop request from outside (a signal handler): the first is graceful, the second forces."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.forced = asyncio.Event()
        self.signal: int | None = None

    def request(self, signum: int = signal.SIGINT) -> None:
        if self.requested.is_set():
            self.forced.set()
        else:
            self.signal = signum
            self.requested.set()


class _WorkerRun:
    """One worker's command, from start to result; ``stop`` may be called at any time."""

    def __init__(
        self,
        worker: Worker,
        transport: Transport,
        command: str,
        env: dict[str, str],
        on_line: LineHandler | None,
        *,
        guard: bool = False,
    ) -> None:
        self.worker = worker
        self.transport = transport
        self.command = command
        self.env = env
        self.on_line = on_line
        self.guard = guard
        self.proc: RemoteProcess | None = None
        self.stop_outcome: Outcome | None = None
        self.stopped_by: int | None = None
        self.grace = DEFAULT_GRACE_S
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.lines = 0
        self.started = time.monotonic()

    async def run(self) -> WorkerResult:
        try:
            self.proc = await self.transport.start(self.command, self.env, guard=self.guard)
        except WorkerError as exc:
            return self._result(Outcome.UNREACHABLE, None, error=exc.reason)
        if self.stop_outcome is not None:  # stopped while it was starting
            await self.proc.kill(self.grace)
        pump = asyncio.create_task(self._pump(self.proc))
        try:
            status = await self.proc.wait()
            await asyncio.wait_for(pump, OUTPUT_LINGER_S)
        except TimeoutError:
            pass  # wait_for cancelled the pump: a background child holds the output open
        except WorkerError as exc:  # the connection went away mid-command
            return self._result(Outcome.UNREACHABLE, None, error=exc.reason)
        finally:
            pump.cancel()
            self.proc.close()
        if self.stop_outcome is not None and not status.ok:
            return self._result(self.stop_outcome, status)
        return self._result(Outcome.OK if status.ok else Outcome.FAILED, status)

    async def stop(self, outcome: Outcome, grace: float, by: int | None = None) -> None:
        if self.stop_outcome is None:
            self.stop_outcome, self.stopped_by = outcome, by
        self.grace = grace
        if self.proc is not None:
            await self.proc.kill(grace)

    async def _pump(self, proc: RemoteProcess) -> None:
        async for line in proc.lines():
            self.lines += 1
            self.tail.append(line.text)
            if self.on_line is not None:
                self.on_line(self.worker, line)

    def _result(
        self, outcome: Outcome, status: ExitStatus | None, error: str | None = None
    ) -> WorkerResult:
        return WorkerResult(
            worker=self.worker,
            outcome=outcome,
            duration=time.monotonic() - self.started,
            status=status,
            tail=tuple(self.tail),
            lines=self.lines,
            error=error,
            stopped_by=self.stopped_by if outcome is Outcome.STOPPED else None,
        )


class _Fanout:
    """The controller: watches every worker's run and applies the policies."""

    def __init__(
        self,
        runs: list[_WorkerRun],
        command: str,
        policy: Policy,
        interrupt: Interrupt | None,
        on_notice: NoticeHandler | None,
    ) -> None:
        self.runs = runs
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
        )

    async def _watch(self, pending: set[asyncio.Task[WorkerResult]], started: float) -> None:
        interrupted = asyncio.create_task(self.interrupt.requested.wait())
        forced = asyncio.create_task(self.interrupt.forced.wait())
        try:
            while pending:
                remaining = None
                if self.timeout is not None and not self.timed_out:
                    remaining = max(0.0, started + self.timeout - time.monotonic())
                watch: set[asyncio.Future[Any]] = {*pending, forced}
                if not interrupted.done():
                    watch.add(interrupted)
                done, _ = await asyncio.wait(
                    watch, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                for task in [t for t in pending if t in done]:
                    pending.discard(task)
                    self._record(task.result())
                if interrupted in done and not forced.done():
                    self._begin_stop(
                        Outcome.INTERRUPTED,
                        *INTERRUPT_REASONS.get(self.interrupt.signal or 0, ("interrupted", "")),
                    )
                if forced.done() and not self.forced:
                    self.forced = True
                    self._spawn_stop(Outcome.INTERRUPTED, 0.0)
                if remaining is not None and not done:
                    self.timed_out = True
                    self._begin_stop(Outcome.TIMED_OUT, f"timeout of {self.timeout:g}s reached")
        finally:
            interrupted.cancel()
            forced.cancel()

    def _record(self, result: WorkerResult) -> None:
        self.results[result.worker.id] = result
        if result.ok:
            return
        self.failure_order.append(result.worker.id)
        if self.on_fail is OnFail.KILL and not self.stopping:
            self._begin_stop(
                Outcome.STOPPED,
                f"w{result.worker.id} failed ({result.outcome_text()})",
                by=result.worker.id,
            )

    def _begin_stop(
        self, outcome: Outcome, reason: str, extra: str = "", by: int | None = None
    ) -> None:
        running = [run for run in self.runs if run.worker.id not in self.results]
        if not running:
            return
        self.stopping = True
        plan = f"TERM, then KILL after {self.grace:g}s" if self.grace > 0 else "KILL"
        note = (
            f"{reason}: stopping {len(running)} worker{'s' if len(running) != 1 else ''} ({plan})"
        )
        self.on_notice(f"{note}; {extra}" if extra else note)
        self._spawn_stop(outcome, self.grace, by)

    def _spawn_stop(self, outcome: Outcome, grace: float, by: int | None = None) -> None:
        task = asyncio.create_task(self._stop_all(outcome, grace, by))
        self.stoppers.add(task)

    async def _abandon(self, pending: set[asyncio.Task[WorkerResult]]) -> None:
        await self._stop_all(Outcome.INTERRUPTED, 0.0)
        await asyncio.wait(pending)

    async def _stop_all(self, outcome: Outcome, grace: float, by: int | None = None) -> None:
        running = [run for run in self.runs if run.worker.id not in self.results]
        await asyncio.gather(*(run.stop(outcome, grace, by) for run in running))


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
    guard: bool = False,
) -> FanoutResult:
    """Run ``command`` (a bash command line) on the selected workers of ``pod`` at once.

    ``workers`` is a selection such as ``"0,2-3"`` or a list of workers (default:
    all). ``on_line`` receives every output line as it arrives. Returns when
    every worker's command has ended; never raises for a worker's failure.
    Pass a ``connector`` (``tpupod.providers.connect(pod)``) to reuse
    connections across calls; it is then yours to close. ``guard`` kills the
    commands if this process dies while they run (see ``transport.base.guarded``).
    """
    provider = provider_for(pod.provider)
    selected = pod.select(workers) if workers is None or isinstance(workers, str) else list(workers)
    own_connector = connector is None
    pod_connector = connector if connector is not None else provider.connect(pod, StateDir())
    runs = []
    for worker in selected:
        worker_env = {**pod.identity_env(worker), **provider.worker_env(pod, worker), **(env or {})}
        transport = pod_connector.transport(worker)
        runs.append(_WorkerRun(worker, transport, command, worker_env, on_line, guard=guard))
    try:
        policy = Policy(OnFail(on_fail), timeout, grace)
        return await _Fanout(runs, command, policy, interrupt, on_notice).run()
    finally:
        if own_connector:
            await pod_connector.close()


async def for_each(
    pod: Pod,
    action: Action,
    *,
    workers: str | Sequence[Worker] | None = None,
    connector: Connector | None = None,
) -> FanoutResult:
    """Run ``action(worker, transport)`` for every selected worker at once (put, get, ...).

    The action returns a one-line summary for the table; a ``WorkerError`` it
    raises becomes that worker's failure. Never raises for a worker.
    """
    provider = provider_for(pod.provider)
    selected = pod.select(workers) if workers is None or isinstance(workers, str) else list(workers)
    pod_connector = connector if connector is not None else provider.connect(pod, StateDir())
    started = time.monotonic()

    async def one(worker: Worker) -> WorkerResult:
        began = time.monotonic()
        try:
            summary = await action(worker, pod_connector.transport(worker))
        except WorkerError as exc:
            return WorkerResult(worker, Outcome.FAILED, time.monotonic() - began, error=exc.reason)
        tail = (summary,) if summary else ()
        return WorkerResult(worker, Outcome.OK, time.monotonic() - began, tail=tail)

    try:
        results = await asyncio.gather(*(one(worker) for worker in selected))
    finally:
        if connector is None:
            await pod_connector.close()
    failures = [r.worker.id for r in sorted(results, key=lambda r: r.duration) if not r.ok]
    return FanoutResult("", list(results), time.monotonic() - started, failure_order=failures)


def execute(pod: Pod, command: str, **options: Any) -> FanoutResult:
    """Blocking form of :func:`execute_async` (same options), for scripts without an event loop."""
    return asyncio.run(execute_async(pod, command, **options))
