"""The vocabulary of one attempt, shared by every executor (here, the pool, a pod,
Kubernetes) and the runner: ``Hooks`` in, marker lines read by ``Marks``, an ``Outcome`` out.

An executor reports lines and the moment every worker started through ``Hooks``, stops when
the runner sets ``stop`` (a cancel, a lost lease, the runner itself stopping) and ends in an
``Outcome``; none touches the store (the runner writes, fenced).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tpupod.jobs.code import MARK, RESULT, STARTED
from tpupod.jobs.models import Job, JobStatus

GRACE_S = 3.0  # TERM, then KILL: JAX ignores TERM


@dataclass
class Hooks:
    on_line: Callable[[int, str], None]
    on_started: Callable[[], None]


@dataclass(frozen=True)
class Outcome:
    status: JobStatus
    result: str | None = None
    error: str | None = None
    # the infrastructure ended it (a Kubernetes pod evicted or preempted), not the job itself:
    # it runs again, until max_attempts
    retry: bool = False


class Executor(Protocol):
    async def execute(
        self, job: Job, attempt: int, hooks: Hooks, stop: asyncio.Event
    ) -> Outcome: ...


@dataclass
class Marks:
    """Reads the workers' marker lines: who started, worker 0's result."""

    workers: int
    hooks: Hooks
    started: set[int] = field(default_factory=set)
    result: str | None = None
    last: str = "(no output)"

    def line(self, worker: int, text: str) -> None:
        if not text.startswith(MARK):
            self.hooks.on_line(worker, text)
            if text.strip():
                self.last = text
        elif text == STARTED:
            self.started.add(worker)
            if len(self.started) == self.workers:
                self.hooks.on_started()
        elif text.startswith(RESULT) and worker == 0:
            self.result = json.loads(text[len(RESULT) :])


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"
