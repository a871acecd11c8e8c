"""One managed server process: started in its own process group, restarted with backoff.

The agent holds one :class:`ManagedServer` per :class:`ServerSpec`. A server
that exits while it should run is restarted after a wait that doubles from
``restart_backoff_s`` up to 30 s (reset once a run lasted a minute: ``backoff.py``),
and every restart is counted and said in its log; the restarts its own keeper makes of
its processes (the builtin server's engine and front end) are counted by that keeper in
``NAME.restarts`` beside the log (``services.CHILD_RESTARTS_ENV``). Stopping sends TERM to the
whole group, then KILL after a grace period (JAX ignores TERM). Output goes,
line by line through a pipe the agent reads, to a log file per server, each
line after its UTC time (``2026-01-31T12:00:00.123Z ``), so ``serve logs``
says when; the agent reports its last lines. A server started anew (not
restarted) begins a new log: the one before is kept as ``NAME.log.1``.

**A server outlives its agent.** Its output goes into a named pipe beside its log
(``NAME.pipe``) that the server itself holds open for reading and writing as its stdout:
with no agent reading (one killed with -9, before its keeper starts the next), its lines
wait in the pipe (1 MiB) instead of failing its write, which had killed it at its next
line (an engine's restart said in the log). The next agent takes the server over
(``ManagedServer.take_over``): it reads the same pipe, watches the process (not its
child: through a pidfd) and restarts it when it ends, as its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

from tpupod.base.files import FULL_DISK
from tpupod.serve.backends import ServerSpec, compile_cache_env, render, render_env
from tpupod.serve.backoff import Backoff
from tpupod.serve.eventloop import cancelled
from tpupod.serve.services import (
    CHILD_RESTARTS_ENV,
    child_restarting,
    child_restarts,
    stamp,
)
from tpupod.transport.local import kill_process_group

READY_POLL_S = 0.2
STOP_GRACE_S = 5.0
DRAIN_S = 2.0  # after a server exits, how long its output may still come (a child holds it)
LINE_LIMIT = 64 * 1024  # a longer "line" is cut into pieces of this size
PIPE_BYTES = 1 << 20  # a server's output kept while no agent reads it (pipe-max-size's default)


class ServerState(enum.StrEnum):
    STARTING = "starting"  # running, not yet answering /v1/models on every port
    READY = "ready"
    BACKOFF = "backoff"  # exited; waiting to be restarted
    STOPPED = "stopped"


def tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of a text file (empty when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024 * max(1, lines // 100 + 1)))
            data = f.read()
    except OSError:
        return []
    return list(deque(data.decode(errors="replace").splitlines(), maxlen=lines))


class ManagedServer:
    def __init__(
        self,
        spec: ServerSpec,
        log_dir: Path,
        base_env: dict[str, str],
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        # called as it starts and once it is ready (the agent records its servers)
        self.on_change = on_change or (lambda: None)
        self.log_path = log_dir / f"{spec.name}.log"
        # the restarts the server's own keeper makes of its processes (the builtin server's
        # engine and front end), by process: beside its log, kept while the log goes on
        self.children_path = log_dir / f"{spec.name}.restarts"
        self.compile_cache = log_dir.parent / "compile-cache"  # every server's on this host
        self.base_env = base_env
        self.state = ServerState.STARTING
        self.restarts = 0  # after the server exited by itself
        self.user_restarts = 0  # asked for (tpupod serve restart, the dashboard)
        self.pid: int | None = None
        self.started_at: float | None = None
        self.last_exit: int | None = None
        # what the readiness poll last heard short of 200 (a 404: not an OpenAI server?)
        self.answer: str | None = None
        # the log's disk is full: since when (time.time()), and the lines lost since; said
        # by status (serve status, the dashboard) while it lasts, in the log once it is over
        self.disk_full_since: float | None = None
        self.lines_lost = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._taken_ready = False

    def start(self, fresh: bool = True) -> None:
        """Supervise the server; ``fresh``: a new log (the old one kept as ``NAME.log.1``)."""
        if fresh:
            with contextlib.suppress(FileNotFoundError):
                self.log_path.replace(self.log_path.with_name(self.log_path.name + ".1"))
            self.children_path.unlink(missing_ok=True)
        self._task = asyncio.create_task(self._supervise())

    def take_over(self, pid: int, started_at: float, ready: bool) -> None:
        """Supervise the server an agent before started (``pid``, its process group, still
        runs): read its output where it left it, restart it when it ends. ``ready``: it
        answered before (an engine its keeper restarts meanwhile does not make it new)."""
        self.pid, self.started_at = pid, started_at
        self._taken_ready = ready
        self._note(f"agent {os.getpid()} took over this server (pid {pid}); the agent before ended")
        self._task = asyncio.create_task(self._supervise(taken=pid))

    def start_lost(self) -> None:
        """Start again a server that ended while no agent ran (one more restart)."""
        self.restarts += 1
        self._note(
            f"the server ended while no agent ran; starting it again (restart {self.restarts})"
        )
        self.start(fresh=False)

    async def _supervise(self, taken: int | None = None) -> None:
        backoff = Backoff(self.spec.restart_backoff_s)
        while not self._stopping:
            began = time.monotonic()
            ended: Awaitable[int | None]
            if taken is not None:  # it began before this agent did
                began -= time.time() - (self.started_at or time.time())
                copying = asyncio.create_task(self._copy(await _read_end(self.pipe_path)))
                ended = _ended(taken)
                taken = None
            else:
                copying = await self._spawn()
                assert self._proc is not None
                ended = self._proc.wait()
            if self._taken_ready:
                self.state, self._taken_ready = ServerState.READY, False
            ready = asyncio.create_task(
                asyncio.sleep(0) if self.state is ServerState.READY else self._wait_ready()
            )
            try:
                code = await ended
            finally:  # stop() cancels us here too: the poll ends before stop() returns
                await cancelled(ready)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(copying), DRAIN_S)
            self.last_exit = code
            self.pid = None
            if self._stopping:
                break
            self.state = ServerState.BACKOFF
            ran = time.monotonic() - began
            wait = backoff.after(ran)
            self._note(
                f"the server exited ({_exit_text(code)}) after {ran:.1f}s; "
                f"starting it again in {wait:g}s (restart {self.restarts + 1})"
            )
            await asyncio.sleep(wait)
            if not self._stopping:
                self.restarts += 1
        self.state = ServerState.STOPPED

    @property
    def pipe_path(self) -> Path:
        return self.log_path.with_suffix(".pipe")

    async def _spawn(self) -> asyncio.Task[None]:
        """Start the server; the task that copies its output to the log, stamped."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        output = _output_pipe(self.pipe_path)
        reading = await _read_end(self.pipe_path)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *render(self.spec),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=asyncio.subprocess.STDOUT,
                env={
                    **self.base_env,
                    **compile_cache_env(self.spec, self.compile_cache, self.base_env),
                    **render_env(self.spec),
                    CHILD_RESTARTS_ENV: str(self.children_path),
                },
                start_new_session=True,  # its own group: stop and restart take all its children
            )
        finally:
            os.close(output)  # the server's alone: end of file once its group is gone
        self.pid = self._proc.pid
        self.started_at = time.time()
        self.state = ServerState.STARTING
        self.on_change()
        return asyncio.create_task(self._copy(reading))

    async def _copy(self, output: asyncio.StreamReader) -> None:
        """Each line the server writes, to its log after the time it came. On a full disk
        the lines are dropped and counted, and the pipe read on: a copy that ended there
        left the server blocked on its next write once the pipe had filled (hung)."""
        partial, lost = b"", 0
        # unbuffered: a write the disk refused is not kept to be written again later
        with open(self.log_path, "ab", buffering=0) as log:  # noqa: ASYNC230 (opened once)
            while chunk := await output.read(LINE_LIMIT):
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                if len(partial) >= LINE_LIMIT:
                    lines.append(partial)
                    partial = b""
                now = stamp()
                lost = self._append(log, b"".join(now + line + b"\n" for line in lines), lost)
            if partial:
                self._append(log, stamp() + partial + b"\n", lost)

    def _append(self, log: IO[bytes], data: bytes, lost: int) -> int:
        """``data`` to the log, after a line saying how many were lost before where some
        were; the count lost now (a full disk: these too)."""
        try:
            if lost:
                said = f"[tpupod agent] {lost} line(s) lost: the disk under {self.log_path.parent}"
                log.write(stamp() + f"{said} was full\n".encode())
            log.write(data)
        except OSError as exc:
            if exc.errno not in FULL_DISK:
                raise
            self.disk_full_since = self.disk_full_since or time.time()
            self.lines_lost = lost + data.count(b"\n")
            return self.lines_lost
        self.disk_full_since, self.lines_lost = None, 0
        return 0

    @property
    def follows(self) -> bool:
        """A follower of a replica across workers (no endpoint of its own)."""
        return self.spec.group is not None and self.spec.group.rank > 0

    def ready_when(self) -> list[str]:
        """The URLs that must answer ``GET /v1/models`` for this server to be ready: its
        own ports'; a replica's follower serves none, and is ready when its replica is,
        once the leader's endpoint answers (the leader answers only after every member
        joined, loaded and compiled)."""
        group = self.spec.group
        if group is not None and self.follows:
            return [f"http://{_url_host(group.leader_host)}:{group.http_port}/v1/models"]
        host = _url_host("127.0.0.1" if self.spec.host in ("0.0.0.0", "") else self.spec.host)
        return [f"http://{host}:{port}/v1/models" for port in self.spec.ports]

    async def _wait_ready(self) -> None:
        """Mark the server ready once every URL of ``ready_when`` answers 200."""
        import httpx  # the serve extra (this module's other imports are light)

        waiting = self.ready_when()
        self.answer = None
        async with httpx.AsyncClient(timeout=2.0) as client:
            while waiting:
                for url in list(waiting):
                    with contextlib.suppress(httpx.HTTPError):
                        r = await client.get(url)
                        if r.status_code == 200:
                            waiting.remove(url)
                        else:
                            whose = "its leader's " if self.follows else ""
                            self.answer = f"{whose}GET /v1/models answers {r.status_code}"
                if waiting:
                    await asyncio.sleep(READY_POLL_S)
        self.state = ServerState.READY
        self.on_change()

    def _note(self, text: str) -> None:
        with contextlib.suppress(OSError), open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"{stamp().decode()}[tpupod agent] {text}\n")

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """TERM the server's group, KILL it after ``grace`` s; no restart follows."""
        self._stopping = True
        proc, pid = self._proc, self.pid
        if proc is not None and proc.returncode is None:
            await stop_group(proc.pid, grace, proc)
        elif pid is not None:  # taken over from the agent before: not our child
            await stop_group(pid, grace, None)
        try:
            if self._task is not None:
                # a cancel of our caller meanwhile is raised after, not swallowed with the
                # supervisor's own; an error the supervisor ended with is raised here
                await cancelled(self._task)
                failed = None if self._task.cancelled() else self._task.exception()
                if failed is not None:
                    raise failed
        finally:
            self.state = ServerState.STOPPED
            self.pid = None

    def status(self, log_lines: int = 6) -> dict[str, object]:
        uptime = time.time() - self.started_at if self.started_at and self.pid else None
        return {
            "name": self.spec.name,
            "backend": self.spec.backend.value,
            "ports": list(self.spec.ports),
            "pid": self.pid,
            "state": self.state.value,
            "restarts": self.restarts,
            "child_restarts": child_restarts(self.children_path),
            "restarting": child_restarting(self.children_path),
            "user_restarts": self.user_restarts,
            "uptime_s": round(uptime, 1) if uptime is not None else None,
            "last_exit": self.last_exit,
            "answer": self.answer if self.state is ServerState.STARTING else None,
            "disk_full": (
                {"since": self.disk_full_since, "lines_lost": self.lines_lost}
                if self.disk_full_since is not None
                else None
            ),
            "log": tail(self.log_path, log_lines),
        }


def _exit_text(code: int | None) -> str:
    """``exit 3``, or ``killed by SIGKILL``."""
    if code is None:
        return "how, only the agent that started it could tell"
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def stop_group(pgid: int, grace: float, proc: asyncio.subprocess.Process | None) -> None:
    """TERM the group, KILL what is left after ``grace`` s; returns once no member is alive
    (a restart then finds the server's port free)."""
    await kill_process_group(pgid, grace)
    if proc is not None:
        await proc.wait()


def _output_pipe(path: Path) -> int:
    """A new named pipe at ``path``; the server's end of it (its stdout), open for reading
    and writing: while the server holds a reader itself, a write finds no closed pipe when
    no agent reads (it waits in the pipe, up to ``PIPE_BYTES``, then blocks)."""
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)
    end = os.open(path, os.O_RDWR)
    with contextlib.suppress(OSError):  # past /proc/sys/fs/pipe-max-size: the default 64 KiB
        fcntl.fcntl(end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return end


async def _read_end(path: Path) -> asyncio.StreamReader:
    """The agent's end of a server's output pipe, as a stream (end of file once no process
    holds the server's end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


async def _ended(pid: int) -> None:
    """Until the process ``pid`` ends; it is not this process's child (an agent before
    started it), so how it ended is not ours to read: None."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _settle, ended)
    try:
        await ended
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
