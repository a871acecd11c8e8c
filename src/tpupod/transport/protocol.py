"""The transport seam: start a command on one worker, read its lines, wait, kill.

A transport serves one worker. Everything above it (the fan-out engine, the
CLI) is the same for a local pod and an SSH pod; a new transport implements
these two small protocols and nothing else. (Apart from ``base.py``, the values and
the command script, which the local fast path imports without ``typing``.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Protocol

from tpupod.transport.base import ExitStatus, OutputLine


class RemoteProcess(Protocol):
    """A command running on one worker, in a process group of its own."""

    def lines(self) -> AsyncIterator[OutputLine]:
        """Output lines as they arrive; ends when both streams are closed."""
        ...

    async def wait(self) -> ExitStatus:
        """Wait for the command (the group leader) to end."""
        ...

    async def kill(self, grace: float) -> None:
        """TERM the command's whole process group, then KILL what is left after ``grace`` s.

        Returns once the group is gone or KILL has been sent. Safe to call again
        (a second call with ``grace=0`` sends KILL at once) and after the command ended.
        """
        ...

    def close(self) -> None:
        """Release the pipes or channel once done with the command (it is not killed)."""
        ...


class Transport(Protocol):
    """The way to one worker (connections are the Connector's to keep and close)."""

    async def start(
        self, command: str, env: Mapping[str, str], *, guard: bool = False
    ) -> RemoteProcess:
        """Start ``command`` (a bash command line) with ``env`` added to the worker's environment.

        With ``guard``, the command's process group is killed if we go away
        while it runs (the launcher killed, the connection lost), so a
        supervised program never outlives its supervisor.

        Raises :class:`~tpupod.errors.WorkerError` when the worker cannot be reached
        or the command cannot be started.
        """
        ...

    async def put(self, local: Path, remote: str) -> None:
        """Copy a local file or folder to ``remote`` on the worker, atomically.

        A relative ``remote`` is relative to where the worker's commands start.
        Raises :class:`~tpupod.errors.WorkerError`.
        """
        ...

    async def get(self, remote: str, local: Path) -> None:
        """Copy ``remote`` (a file or folder) from the worker to ``local``, atomically."""
        ...
