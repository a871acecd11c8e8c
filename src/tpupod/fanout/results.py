"""What a fan-out produced: how each worker ended, and the whole run's verdict.

Kept free of heavy imports (no pydantic, no asyncio), so that the CLI can
print a result that a connection holder sent it without loading the engine.
"""

from __future__ import annotations

import enum

from tpupod.base.plain import TYPE_CHECKING, Plain
from tpupod.errors import FanoutFailed
from tpupod.transport.base import ExitStatus

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, Protocol

    class WorkerLike(Protocol):
        """What a result needs of a worker (a Worker, or a light stand-in for one)."""

        @property
        def id(self) -> int: ...

        @property
        def hostname(self) -> str: ...

        @property
        def label(self) -> str: ...


DEFAULT_GRACE_S = 5.0


def slice_of(worker: WorkerLike) -> int | None:
    """The worker's slice on a pod of several, else None (a light stand-in may have none)."""
    found = getattr(worker, "slice", None)
    return None if found is None else int(found)


def place(worker: WorkerLike) -> str:
    """Where a worker is, for a person: its host, and its slice on a pod of slices
    (``slice 1, host-2``)."""
    found = slice_of(worker)
    return worker.hostname if found is None else f"slice {found}, {worker.hostname}"


class OnFail(enum.StrEnum):
    KILL = "kill"
    WAIT = "wait"


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    STOPPED = "stopped"  # killed because another worker failed first
    INTERRUPTED = "interrupted"
    UNREACHABLE = "unreachable"


class WorkerResult(Plain):
    """How one worker ended."""

    __slots__ = (
        "duration",
        "error",
        "hint",
        "killed_after_term",
        "lines",
        "outcome",
        "status",
        "stopped_by",
        "tail",
        "worker",
    )

    def __init__(
        self,
        worker: WorkerLike,
        outcome: Outcome,
        duration: float,
        status: ExitStatus | None = None,
        *,
        tail: tuple[str, ...] = (),
        lines: int = 0,
        error: str | None = None,
        hint: str | None = None,
        stopped_by: int | None = None,
        killed_after_term: bool = False,
    ) -> None:
        self.worker = worker
        self.outcome = outcome
        self.duration = duration
        self.status = status
        self.tail = tail
        self.lines = lines
        self.error = error
        self.hint = hint  # what the user can do about ``error``
        self.stopped_by = stopped_by
        self.killed_after_term = killed_after_term  # TERM was ignored, KILL after the grace

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def last_line(self) -> str:
        """The last non-blank output line, or for an unreachable worker, why."""
        if self.error:
            return self.error
        return next((line for line in reversed(self.tail) if line.strip()), "")

    def outcome_text(self) -> str:
        status = self.status.describe() if self.status else ""
        if self.killed_after_term:
            status = "killed by SIGKILL after TERM"
        match self.outcome:
            case Outcome.OK | Outcome.FAILED:
                return status or self.outcome.value
            case Outcome.TIMED_OUT:
                return "timed out" + (f" ({status})" if status else "")
            case Outcome.STOPPED:
                return f"stopped after w{self.stopped_by} failed" + (
                    f" ({status})" if status else ""
                )
            case Outcome.INTERRUPTED:
                return "interrupted" + (f" ({status})" if status else "")
            case Outcome.UNREACHABLE:
                return "unreachable"


class RunState(enum.StrEnum):
    """How a run (a fan-out) stands."""

    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"
    STOPPED = "stopped"  # by a signal: Ctrl-C, a cancel, a stop, a pod taken down
    TIMED_OUT = "timed out"
    HUNG = "hung"  # no worker progressed for --hang-timeout: the watchdog stopped it
    LAUNCHER_GONE = "launcher gone"  # it died without writing the end (kill -9)


class Ending(Plain):
    """How a run ended, typed: its state, the worker that failed first (in time), who
    stopped it, and why in words. The summary's last line says it (``report``), the run's
    record keeps it (``run.json``'s ``ending``) for ``tpupod logs``, ``status``, the
    dashboard and recovery, so none of them reads it back from text."""

    __slots__ = ("exit_code", "first_failure", "state", "stopped_by", "why")

    def __init__(
        self,
        state: RunState,
        exit_code: int | None = None,
        *,
        first_failure: int | None = None,
        stopped_by: str | None = None,
        why: str = "",
    ) -> None:
        self.state, self.exit_code, self.first_failure = state, exit_code, first_failure
        self.stopped_by, self.why = stopped_by, why

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Ending:
        first, code = data.get("first_failure"), data.get("exit_code")
        return cls(
            RunState(str(data["state"])),
            None if code is None else int(code),
            first_failure=None if first is None else int(first),
            stopped_by=None if data.get("stopped_by") is None else str(data["stopped_by"]),
            why=str(data.get("why") or ""),
        )

    def describe(self) -> str:
        """In a few words: ``ok``, ``failed (exit 3): w1 exit 3: disk full``."""
        said = self.state.value
        if self.exit_code not in (None, 0):
            said += f" (exit {self.exit_code})"
        why = (self.why or "").removeprefix(f"{self.state.value}: ")  # 'hung: ...' said once
        return f"{said}: {why}" if why else said


class FanoutResult(Plain):
    """How a fan-out ended: every worker's result, and which failed first."""

    __slots__ = (
        "command",
        "elapsed",
        "failure_order",
        "hung",
        "interrupt_signal",
        "stopped_by",
        "timed_out",
        "workers",
    )

    def __init__(
        self,
        command: str,
        workers: list[WorkerResult],
        elapsed: float,
        failure_order: list[int] | None = None,
        *,
        timed_out: bool = False,
        interrupt_signal: int | None = None,
        stopped_by: str | None = None,
        hung: str | None = None,
    ) -> None:
        self.command = command
        self.workers = workers
        self.hung = hung  # why the hang watchdog stopped it (``tpupod.hang``), if it did
        self.elapsed = elapsed
        self.failure_order = failure_order if failure_order is not None else []
        self.timed_out = timed_out
        self.interrupt_signal = interrupt_signal
        self.stopped_by = stopped_by  # who sent the stopping signal, when known

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.workers)

    @property
    def failed_count(self) -> int:
        return sum(not r.ok for r in self.workers)

    @property
    def first_failure(self) -> WorkerResult | None:
        by_id = {r.worker.id: r for r in self.workers}
        return by_id[self.failure_order[0]] if self.failure_order else None

    def exit_code(self) -> int:
        """0 when every worker succeeded; else a code that says why, as shells do.

        Hung (stopped by the hang watchdog): 124, as a timeout (``timeout(1)``); its cause
        is the record's ``hung``, not the code. Interrupted: 128 + the signal. Otherwise the
        first failure decides: its exit code (128 + signal when killed), 124 for a timeout,
        255 for an unreachable worker (as ``ssh``).
        """
        first = self.first_failure
        if self.hung is not None:
            return 124
        if first is None:
            return 0
        if self.interrupt_signal is not None:
            return 128 + self.interrupt_signal
        if first.outcome is Outcome.TIMED_OUT:
            return 124
        if first.outcome is Outcome.UNREACHABLE:
            return 255
        if first.status is None:  # an operation (put, get) that failed
            return 1
        return first.status.shell_code or 1

    def ending(self, stopped_by: str | None = None) -> Ending:
        """How it ended, typed (``stopped_by``: who sent the stopping signal, when known: a
        ``tpupod cancel``, a stop from the dashboard)."""
        code, first = self.exit_code(), self.first_failure
        if self.hung is not None:
            return Ending(RunState.HUNG, code, why=self.hung)
        if self.interrupt_signal is not None:
            import signal  # here: only a stopped run needs the names

            name = signal.Signals(self.interrupt_signal).name
            count = self.failed_count
            workers = "worker" if count == 1 else "workers"
            left = f"{count} {workers} did not finish" if count else "every worker ended by itself"
            by = stopped_by or self.stopped_by or name
            return Ending(RunState.STOPPED, code, stopped_by=by, why=f"stopped by {by}: {left}")
        if first is None:
            return Ending(RunState.OK, 0)
        if self.timed_out and first.outcome is Outcome.TIMED_OUT:
            late = [r.worker.label for r in self.workers if r.outcome is Outcome.TIMED_OUT]
            names = ", ".join(late[:4]) + (f" and {len(late) - 4} more" if len(late) > 4 else "")
            why = f"timed out: {names} did not finish in time"
            return Ending(RunState.TIMED_OUT, code, first_failure=first.worker.id, why=why)
        said = (
            f": {first.error}"
            if first.error
            else (f": {first.last_line}" if first.last_line else "")
        )
        why = f"{first.worker.label} ({place(first.worker)}) {first.outcome_text()}{said}"
        return Ending(RunState.FAILED, code, first_failure=first.worker.id, why=why)

    def raise_for_failures(self) -> FanoutResult:
        if self.ok:
            return self
        first = self.first_failure
        assert first is not None, "a failed result names its first failure"
        raise FanoutFailed(
            f"{self.failed_count} of {len(self.workers)} workers did not succeed; "
            f"first: w{first.worker.id} ({place(first.worker)}) {first.outcome_text()}",
            self.exit_code(),
            self,
        )


def chain(earlier: FanoutResult, later: FanoutResult) -> FanoutResult:
    """One result for a step run on the workers ``earlier`` left standing: each worker's row
    from the later step where it took part, else its (failed) row from the earlier one, so
    a worker that dropped out on the way is still reported (and counts as failing first)."""
    rows = {r.worker.id: r for r in earlier.workers} | {r.worker.id: r for r in later.workers}
    order = [
        *earlier.failure_order,
        *(w for w in later.failure_order if w not in earlier.failure_order),
    ]
    return FanoutResult(
        command=later.command or earlier.command,
        workers=[rows[w] for w in sorted(rows)],
        elapsed=earlier.elapsed + later.elapsed,
        failure_order=order,
        timed_out=earlier.timed_out or later.timed_out,
        interrupt_signal=later.interrupt_signal or earlier.interrupt_signal,
    )


def result_to_json(result: FanoutResult) -> dict[str, object]:
    """A result as plain JSON (the connection holder sends it to the CLI)."""
    return {
        "command": result.command,
        "elapsed": result.elapsed,
        "failure_order": result.failure_order,
        "timed_out": result.timed_out,
        "interrupt_signal": result.interrupt_signal,
        "stopped_by": result.stopped_by,
        "hung": result.hung,
        "workers": [
            {
                "id": r.worker.id,
                "outcome": r.outcome.value,
                "duration": r.duration,
                "code": r.status.code if r.status else None,
                "signal": r.status.signal if r.status else None,
                "has_status": r.status is not None,
                "tail": list(r.tail),
                "lines": r.lines,
                "error": r.error,
                "stopped_by": r.stopped_by,
                "killed_after_term": r.killed_after_term,
            }
            for r in result.workers
        ],
    }


def result_from_json(data: dict[str, Any], workers: Mapping[int, WorkerLike]) -> FanoutResult:
    """The inverse of :func:`result_to_json`, with the caller's worker objects."""
    rows = [
        WorkerResult(
            worker=workers[row["id"]],
            outcome=Outcome(row["outcome"]),
            duration=row["duration"],
            status=ExitStatus(row["code"], row["signal"]) if row["has_status"] else None,
            tail=tuple(row["tail"]),
            lines=row["lines"],
            error=row["error"],
            stopped_by=row["stopped_by"],
            killed_after_term=row.get("killed_after_term", False),
        )
        for row in data["workers"]
    ]
    return FanoutResult(
        command=data["command"],
        workers=rows,
        elapsed=data["elapsed"],
        failure_order=list(data["failure_order"]),
        timed_out=data["timed_out"],
        interrupt_signal=data["interrupt_signal"],
        stopped_by=data.get("stopped_by"),
        hung=data.get("hung"),
    )
