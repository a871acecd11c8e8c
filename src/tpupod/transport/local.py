"""Commands as local subprocesses: the transport of a local pod's simulated hosts."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from tpupod.base import procfs
from tpupod.base.files import copy_atomic, file_over_folder, put_target
from tpupod.errors import WorkerError
from tpupod.pod.record import Worker
from tpupod.transport.base import ExitStatus, OutputLine, Stream, command_script
from tpupod.transport.lines import read_lines

SHELL = "/bin/bash"
GROUP_POLL_S = 0.05
KILLED_WAIT_S = 5.0  # a KILLed process ends as soon as the kernel runs it; bounded all the same
STREAM_LIMIT = 2**16


class LocalTransport:
    """Runs commands in the worker's working directory, each in a new session (process group)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def start(
        self, command: str, env: Mapping[str, str], *, guard: bool = False
    ) -> LocalProcess:
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _ExitAwareProtocol(loop),
                SHELL,
                "-c",
                command_script(command, guard=guard),
                # Guarded: a pipe we never write to, whose end (ours) closes if we die.
                stdin=asyncio.subprocess.PIPE if guard else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.worker.workdir,
                env={**os.environ, **env},
                start_new_session=True,
            )
        except OSError as exc:
            reason = f"cannot start the command: {exc.strerror or exc}"
            raise WorkerError(
                f"w{self.worker.id}: {reason}",
                hint="the pod's working directory may be gone; "
                "'tpupod down' then 'tpupod up' recreates it",
                worker=self.worker.id,
                reason=reason,
            ) from exc
        return LocalProcess(asyncio.subprocess.Process(transport, protocol, loop), protocol)

    async def put(self, local: Path, remote: str) -> None:
        target = put_target(local, remote)
        dest = self._path(target)
        if await asyncio.to_thread(_file_over_folder, local, dest):
            reason, hint = file_over_folder(local, target)
            raise WorkerError(
                f"w{self.worker.id}: {reason}", worker=self.worker.id, reason=reason, hint=hint
            )
        await self._copy(local, dest)

    async def get(self, remote: str, local: Path) -> None:
        await self._copy(self._path(remote), local)

    def _path(self, remote: str) -> Path:
        path = Path(remote).expanduser()
        return path if path.is_absolute() else Path(self.worker.workdir or ".") / path

    async def _copy(self, src: Path, dest: Path) -> None:
        try:
            await asyncio.to_thread(copy_atomic, src, dest)
        except OSError as exc:
            reason = f"cannot copy {src} to {dest}: {exc.strerror or exc}"
            raise WorkerError(
                f"w{self.worker.id}: {reason}", worker=self.worker.id, reason=reason
            ) from exc


def _file_over_folder(local: Path, dest: Path) -> bool:
    return dest.is_dir() and not dest.is_symlink() and not local.is_dir()


class _ExitAwareProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's stream protocol, plus a future set the moment the process exits.

    ``Process.wait()`` also waits for the pipes to close, which a background
    child that inherited them (``sleep 30 &``) can hold open for its lifetime.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=STREAM_LIMIT, loop=loop)
        self.exited: asyncio.Future[int] = loop.create_future()
        self._process: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert isinstance(transport, asyncio.SubprocessTransport)
        self._process = transport

    def process_exited(self) -> None:
        super().process_exited()
        code = self._process.get_returncode() if self._process is not None else None
        if code is not None and not self.exited.done():
            self.exited.set_result(code)


class LocalConnector:
    def transport(self, worker: Worker) -> LocalTransport:
        return LocalTransport(worker)

    async def reachback(self, worker: Worker) -> str:
        return "127.0.0.1"

    async def close(self) -> None:
        return None


class LocalProcess:
    def __init__(self, proc: asyncio.subprocess.Process, protocol: _ExitAwareProtocol) -> None:
        self._proc = proc
        self._exited = protocol.exited
        assert proc.stdout is not None and proc.stderr is not None
        self._streams: list[tuple[Stream, asyncio.StreamReader]] = [
            (Stream.STDOUT, proc.stdout),
            (Stream.STDERR, proc.stderr),
        ]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def lines(self) -> AsyncIterator[OutputLine]:
        return read_lines(list(self._streams))

    async def wait(self) -> ExitStatus:
        code = await asyncio.shield(self._exited)
        return ExitStatus(code) if code >= 0 else ExitStatus(None, -code)

    def close(self) -> None:
        # asyncio exposes no public way to drop a finished subprocess's pipes.
        transport = getattr(self._proc, "_transport", None)
        if transport is not None and self._proc.returncode is not None:
            transport.close()

    async def kill(self, grace: float) -> None:
        # The group id is the leader's pid (start_new_session). Members outlive
        # the leader, so the group, not the leader, decides when we are done.
        await kill_process_group(self._proc.pid, grace)


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a member we may not signal: the group still exists
    return True


async def kill_process_group(pgid: int, grace: float) -> None:
    """TERM the group, wait up to ``grace`` s for every member to end, then KILL whatever is
    left and wait (bounded) until it is gone. The one way tpupod stops a local process group:
    when it returns, no member is alive, so a port or a file one held is free. Waiting for the
    leader alone is not enough: a member that ignores TERM, or is still cleaning up, outlives it.
    """
    if grace > 0 and signal_group(pgid, signal.SIGTERM) and await _emptied(pgid, grace):
        return
    if signal_group(pgid, signal.SIGKILL):
        await _emptied(pgid, KILLED_WAIT_S)


async def _emptied(pgid: int, within: float) -> bool:
    """Wait up to ``within`` s for the group to have no live member; False if it still has."""
    deadline = asyncio.get_running_loop().time() + within
    while group_has_live_members(pgid):
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(GROUP_POLL_S)
    return True


def group_has_live_members(pgid: int) -> bool:
    """True while some process of the group is alive (zombies waiting to be reaped do not count)."""
    if not signal_group(pgid, 0):
        return False
    for pid in procfs.pids():
        st = procfs.stat(pid)
        if st is not None and st.pgrp == pgid and st.alive:
            return True
    return False
