"""One worker's command in a fan-out, from start to result.

A :class:`WorkerRun` starts the command through the worker's transport,
pumps its output lines (to the caller and into a tail of the last lines),
waits for its exit status, and can be stopped at any moment. It never
raises: an unreachable or silent worker becomes a result too. The fan-out
controller (``fanout.py``) decides when to stop which run.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tpupod.errors import WorkerError
from tpupod.fanout.results import Outcome, WorkerResult
from tpupod.pod.record import Worker
from tpupod.transport import ExitStatus, OutputLine, RemoteProcess, Transport

TAIL_LINES = 10
# After a command exits, how long to keep reading output that a background
# child still holds open (as `ssh` would wait forever, and we should not).
OUTPUT_LINGER_S = 2.0
# After a stop's kill returned, how long a worker may take to report its end before we give
# up on it (its host went silent): a --timeout is honoured within about this much.
ANSWER_S = 1.0

LineHandler = Callable[[Worker, OutputLine], None]


class WorkerRun:
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
        self.exited = False
        self.stop_outcome: Outcome | None = None
        self.stopped_by: int | None = None
        self.grace = float("inf")  # set when a stop is decided
        self.failing = False  # it failed (said so, or exited) and is ending by itself
        self.exit_status: ExitStatus | None = None
        self.reason: str | None = None  # ... and why
        self.own_code: int | None = None  # the exit code it said it gave itself (sys.exit)
        self.gave_up = asyncio.Event()  # set when the worker stopped answering our stop
        # Takes a runtime's chatter out of a line for the tail (None: nothing to keep).
        self.chatter: Callable[[str], str | None] | None = None
        # Told the moment the command exits, before its last output is read (which can
        # take OUTPUT_LINGER_S): failures are ordered by when they happened.
        self.on_exit: Callable[[int, ExitStatus], None] | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.lines = 0
        self.started = time.monotonic()

    async def run(self) -> WorkerResult:
        starting = asyncio.create_task(
            self.transport.start(self.command, self.env, guard=self.guard)
        )
        if not await self._unless_silent(starting):
            return self._given_up()
        try:
            self.proc = starting.result()
        except WorkerError as exc:
            return self._result(Outcome.UNREACHABLE, None, error=exc.reason, hint=exc.hint)
        if self.stop_outcome is not None:  # stopped while it was starting
            await self.proc.kill(self.grace)
        pump = asyncio.create_task(self._pump(self.proc))
        waiting = asyncio.create_task(self.proc.wait())
        try:
            if not await self._unless_silent(waiting):
                return self._given_up()
            status = waiting.result()
            self.exited = True
            if self.on_exit is not None:
                self.on_exit(self.worker.id, status)
            await asyncio.wait_for(pump, OUTPUT_LINGER_S)
        except TimeoutError:
            pass  # wait_for cancelled the pump: a background child holds the output open
        except WorkerError as exc:  # the connection went away mid-command
            return self._result(Outcome.UNREACHABLE, None, error=exc.reason, hint=exc.hint)
        finally:
            pump.cancel()
            self.proc.close()
        if self.stop_outcome is not None and not status.ok:
            return self._result(self.stop_outcome, status)
        return self._result(Outcome.OK if status.ok else Outcome.FAILED, status)

    async def _unless_silent(self, step: asyncio.Task[Any]) -> bool:
        """Wait for ``step``; False (and ``step`` cancelled) if we gave up on the worker first."""
        gave_up = asyncio.create_task(self.gave_up.wait())
        try:
            await asyncio.wait({step, gave_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gave_up.cancel()
        if step.done():
            return True
        step.cancel()
        return False

    def _given_up(self) -> WorkerResult:
        """A worker that answered neither the command's end nor our stop: its host went silent.
        (A guarded command still dies there: closing its channel ends the guard's input.)"""
        if self.proc is not None:
            self.proc.close()
        return self._result(Outcome.UNREACHABLE, None, error="no answer from the host after stop")

    @property
    def running(self) -> bool:
        """Still to be stopped: not ended, and not already exiting after reporting a failure."""
        return not self.exited and not self.failing

    def mark_stopping(self, outcome: Outcome, grace: float, by: int | None = None) -> None:
        """Decide how this run will be reported, before anything is sent to it."""
        if self.stop_outcome is None:
            self.stop_outcome, self.stopped_by = outcome, by
        self.grace = min(self.grace, grace)

    async def stop(self, outcome: Outcome, grace: float, by: int | None = None) -> None:
        """Kill the command (TERM, then KILL after ``grace``); a worker that has not ended
        ANSWER_S after that (or that is still starting ANSWER_S after the stop) is given up."""
        self.mark_stopping(outcome, grace, by)
        if self.proc is not None:
            await self.proc.kill(grace)
        if not self.exited:
            asyncio.get_running_loop().call_later(ANSWER_S, self.gave_up.set)

    async def _pump(self, proc: RemoteProcess) -> None:
        async for line in proc.lines():
            self.lines += 1
            kept = line.text if self.chatter is None else self.chatter(line.text)
            if kept is not None:
                self.tail.append(kept)
            if self.on_line is not None:
                self.on_line(self.worker, line)

    def _result(
        self,
        outcome: Outcome,
        status: ExitStatus | None,
        error: str | None = None,
        hint: str | None = None,
    ) -> WorkerResult:
        stopped = outcome in (Outcome.STOPPED, Outcome.TIMED_OUT, Outcome.INTERRUPTED)
        if status is not None and status.signal and self.own_code == 128 + status.signal:
            # The command script re-raises a code of 128+N as signal N (it cannot tell them
            # apart); the program said it exited with that code itself (sys.exit(143)).
            status = ExitStatus(self.own_code)
        return WorkerResult(
            worker=self.worker,
            outcome=outcome,
            duration=time.monotonic() - self.started,
            status=status,
            tail=tuple(self.tail),
            lines=self.lines,
            error=error or self.reason,
            hint=hint,
            stopped_by=self.stopped_by if outcome is Outcome.STOPPED else None,
            # Only our escalation sends KILL to a group that was sent TERM first.
            killed_after_term=stopped
            and self.grace > 0
            and status is not None
            and status.signal == signal.SIGKILL,
        )
