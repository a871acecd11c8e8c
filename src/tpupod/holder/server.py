"""The holder process: serve one pod's fan-outs over a Unix socket, with connections kept open."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tpupod.base import limits
from tpupod.errors import WorkerError
from tpupod.fanout.context import Interrupt
from tpupod.fanout.execute import FILES_PER_WORKER, execute_async
from tpupod.fanout.results import result_to_json
from tpupod.holder import socket_path
from tpupod.pod.record import Pod, Worker
from tpupod.pod.state import RECORD_FILE, StateDir
from tpupod.providers import Connector, connect
from tpupod.transport import OutputLine, Stream
from tpupod.transport.ssh import SshTransport

CHECK_EVERY_S = 1.0


@dataclass
class Forward:
    """A local port held open to an address as one worker sees it (``serve endpoint``)."""

    worker: Worker
    host: str
    port: int
    local_port: int
    listener: Any = None  # asyncssh's SSHListener, None while its connection is down
    connection: Any = None

    @property
    def alive(self) -> bool:
        return self.listener is not None and not self.connection.is_closed()


class Holder:
    def __init__(self, state: StateDir, pod: Pod, idle_s: float) -> None:
        self.state = state
        self.pod = pod
        self.idle_s = idle_s
        self.record = state.pod_dir(pod.name) / RECORD_FILE
        self.record_version = _version(self.record)
        self.connector: Connector = connect(pod, state)
        self.active = 0
        self.last_used = time.monotonic()
        self.stopping = asyncio.Event()
        self.forwards: dict[tuple[int, str, int], Forward] = {}

    async def serve(self, path: Path) -> None:
        short = limits.open_files(FILES_PER_WORKER * len(self.pod.workers))
        if short:
            print(f"tpupod: warning: {short}", file=sys.stderr, flush=True)  # the holder's log
        path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(self._handle, path=str(path))
        os.chmod(path, 0o600)
        warm = asyncio.create_task(self._warm_up())
        try:
            while not self.stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), CHECK_EVERY_S)
                idle = self.active == 0 and time.monotonic() - self.last_used > self.idle_s
                if (idle and not self.forwards) or _version(self.record) != self.record_version:
                    self.stopping.set()
                await self._revive()
        finally:
            server.close()
            for forward in self.forwards.values():
                if forward.listener is not None:
                    forward.listener.close()
            path.unlink(missing_ok=True)
            warm.cancel()
            await self.connector.close()

    async def _warm_up(self) -> None:
        """Open every connection now, so the first command does not wait for the handshakes."""
        await execute_async(self.pod, "true", connector=self.connector, timeout=60)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        try:
            request = json.loads(await reader.readline() or b"{}")
            op = request.get("op")
            if _version(self.record) != self.record_version:
                _send(writer, {"error": "stale"})
                self.stopping.set()
            elif op == "ping":
                _send(writer, {"ok": True, "pod": self.pod.name})
            elif op == "stop":
                _send(writer, {"ok": True})
                self.stopping.set()
            elif op == "exec":
                await self._exec(request, reader, writer)
            elif op == "forward":
                _send(writer, await self._forward(request))
            elif op == "unforward":
                _send(writer, self._unforward(request))
            else:
                _send(writer, {"error": f"unknown request {op!r}"})
            await writer.drain()
        except (ConnectionError, ValueError):
            pass  # the client went away or sent garbage: nothing to answer
        finally:
            self.active -= 1
            self.last_used = time.monotonic()
            writer.close()

    async def _forward(self, request: dict[str, Any]) -> dict[str, Any]:
        """Hold a local port open to ``host:port`` as worker ``worker`` sees it; asked again,
        answer with the same port. It lasts as long as this holder, which stays for it."""
        worker = self.pod.workers[int(request["worker"])]
        key = (worker.id, str(request["host"]), int(request["port"]))
        forward = self.forwards.get(key) or Forward(worker, key[1], key[2], 0)
        if not forward.alive:
            try:
                await self._listen(forward, int(request.get("local_port") or 0))
            except WorkerError as exc:
                return {"error": exc.message, "hint": exc.hint}
        self.forwards[key] = forward
        return {"ok": True, "local_port": forward.local_port}

    def _unforward(self, request: dict[str, Any]) -> dict[str, Any]:
        key = (int(request["worker"]), str(request["host"]), int(request["port"]))
        forward = self.forwards.pop(key, None)
        if forward is not None and forward.listener is not None:
            forward.listener.close()
        return {"ok": True, "closed": forward is not None}

    async def _listen(self, forward: Forward, wanted: int) -> None:
        transport = self.connector.transport(forward.worker)
        if not isinstance(transport, SshTransport):
            raise WorkerError(f"pod {self.pod.name!r} has no SSH connection to forward over")
        # Once a port was given out, keep it: clients were told that URL.
        port = forward.local_port or wanted
        try:
            forward.listener, forward.connection = await transport.forward(
                port, forward.host, forward.port
            )
        except WorkerError:
            if port == 0 or forward.local_port:
                raise
            forward.listener, forward.connection = await transport.forward(
                0, forward.host, forward.port
            )  # the port asked for is taken here: any other
        forward.local_port = forward.listener.get_port()

    async def _revive(self) -> None:
        """A forward whose SSH connection dropped comes back on the same port once the host
        answers again."""
        for forward in self.forwards.values():
            if forward.listener is not None and not forward.alive:
                forward.listener.close()
                forward.listener = None
            if forward.listener is None:
                with contextlib.suppress(WorkerError):
                    await self._listen(forward, forward.local_port)

    async def _exec(
        self, request: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        interrupt = Interrupt()
        watcher = asyncio.create_task(_watch_client(reader, interrupt))
        workers = [self.pod.workers[i] for i in request["workers"]]

        def on_line(worker: Worker, line: OutputLine) -> None:
            _send(writer, {"line": [worker.id, line.stream is Stream.STDERR, line.text]})

        try:
            result = await execute_async(
                self.pod,
                request["command"],
                workers=workers,
                on_fail=request["on_fail"],
                timeout=request["timeout"],
                grace=request["grace"],
                env=request["env"],
                on_line=None if request.get("quiet") else on_line,
                on_notice=lambda text: _send(writer, {"notice": text}),
                interrupt=interrupt,
                connector=self.connector,
            )
        finally:
            watcher.cancel()
        _send(writer, {"result": result_to_json(result)})


async def _watch_client(reader: asyncio.StreamReader, interrupt: Interrupt) -> None:
    """Interrupt requests from the client; its going away counts as one (leave nothing running)."""
    while line := await reader.readline():
        message = json.loads(line)
        if message.get("op") == "interrupt":
            interrupt.request(int(message.get("signal", signal.SIGINT)))
    interrupt.request(signal.SIGHUP)


def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    if not writer.is_closing():
        writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def _version(record: Path) -> int | None:
    try:
        return record.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def run(home: Path, name: str, idle_s: float) -> None:
    """Serve until idle; a second holder for the same pod exits at once (the lock decides)."""
    state = StateDir(home)
    pod = state.load(name)
    path = socket_path(state.pod_dir(name))
    lock_path = path.with_suffix(".lock")
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        if not _same_file(lock, lock_path):
            return  # an exiting holder removed this file after we opened it: let the next try
        try:
            asyncio.run(Holder(state, pod, idle_s).serve(path))
        finally:
            lock_path.unlink(missing_ok=True)  # still locked: no other holder can be inside


def _same_file(handle: IO[str], path: Path) -> bool:
    try:
        return os.fstat(handle.fileno()).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False
