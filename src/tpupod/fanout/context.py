"""One command's fan-outs: what they all share, built once per command and passed down.

A command runs one fan-out or several (a preflight, a sync, the program, a stop) on the
same pod: they share the pod, its connections (an SSH pod's are kept open across them),
where output goes (each line, each notice) and what stops them (Ctrl-C, a cancel). A
:class:`Context` holds those, so the library calls below a command take it, and what is
particular to each call (the command line, the workers, the policy), instead of a dozen
keyword arguments repeated at every level.

    async with Context(pod, Sinks(on_line=printer, on_notice=notice)) as ctx:
        await execute.run_on(ctx, "hostname", workers=ctx.pod.select("0,2"))
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpupod.fanout.worker import LineHandler
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir

if TYPE_CHECKING:
    from tpupod.providers import Connector

NoticeHandler = Callable[[str], None]


class Interrupt:
    """A stop request from outside (a signal handler): the first is graceful, the second forces."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.forced = asyncio.Event()
        self.signal: int | None = None
        self.grace: float | None = None  # the stop's grace, if not the fan-out's own
        self.reason: str | None = None  # why, if not the signal's name
        self.by: str | None = None  # who sent it, when known ('tpupod cancel' (pid 8002))
        # Asked when a stop comes: who sent it (a launcher reads its run's stop-request file,
        # which a cancel or the dashboard writes before its SIGINT).
        self.who: Callable[[], str | None] | None = None

    def request(
        self, signum: int = signal.SIGINT, *, grace: float | None = None, reason: str | None = None
    ) -> None:
        if self.requested.is_set():
            self.forced.set()
        else:
            self.by = self.who() if self.who is not None else None
            if reason is None and self.by is not None:
                reason = f"stopped by {self.by}"
            self.signal, self.grace, self.reason = signum, grace, reason
            self.requested.set()


def _quiet(text: str) -> None:
    """A notice nobody reads."""


class Sinks:
    """Where a command's fan-outs send output, and what stops them: every output line
    (``on_line``, None: not shown), tpupod's own notices, the interrupt a signal sets."""

    __slots__ = ("interrupt", "on_line", "on_notice")

    def __init__(
        self,
        on_line: LineHandler | None = None,
        on_notice: NoticeHandler | None = None,
        interrupt: Interrupt | None = None,
    ) -> None:
        self.on_line = on_line
        self.on_notice: NoticeHandler = on_notice or _quiet
        self.interrupt = interrupt or Interrupt()  # none given: nothing from outside stops it


class Context:
    """A pod, its connections, and a command's :class:`Sinks`. The connector is opened on
    first use and closed with the context (``async with``) when the context opened it; a
    connector given is the giver's to close."""

    def __init__(
        self,
        pod: Pod,
        sinks: Sinks | None = None,
        *,
        connector: Connector | None = None,
        state: StateDir | None = None,
    ) -> None:
        self.pod = pod
        self.sinks = sinks or Sinks()
        self.state = state or StateDir()
        self._connector = connector
        self._opened = False

    @property
    def connector(self) -> Connector:
        """The pod's connector (opened here on first use)."""
        if self._connector is None:
            from tpupod.providers import provider_for  # a command that connects: not --help

            self._connector = provider_for(self.pod.provider).connect(self.pod, self.state)
            self._opened = True
        return self._connector

    def on(self, pod: Pod) -> Context:
        """The same command's context on another pod record (a subset of the workers, a
        recreated TPU): its sinks and state; its own connector."""
        return Context(pod, self.sinks, state=self.state)

    async def close(self) -> None:
        if self._opened and self._connector is not None:
            await self._connector.close()
            self._connector, self._opened = None, False

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
