"""The CLI's side of the holder: one request, events streamed back, signals forwarded.

Deliberately plain (sockets and json, no asyncio, asyncssh or pydantic): this
is the path a user pays for on every ``tpupod exec`` of an SSH pod.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from tpupod.errors import TpupodError
from tpupod.fanout.report import LinePrinter, notice
from tpupod.fanout.results import FanoutResult, result_from_json
from tpupod.holder import socket_path
from tpupod.pod.state import StateDir
from tpupod.transport.base import OutputLine, Stream

if TYPE_CHECKING:
    from tpupod.fanout.results import WorkerLike

START_TIMEOUT_S = 30.0
LOG_FILE = "holder.log"


class _Stale(Exception):
    """The holder serves an older record of the pod; start a new one."""


def exec_via_holder(
    state: StateDir,
    name: str,
    *,
    workers: dict[int, WorkerLike],
    request: dict[str, object],
    printer: LinePrinter | None,
    notice: Callable[[str], None],
) -> FanoutResult:
    """Run an ``exec`` request through the pod's holder, starting the holder if needed."""
    for _ in range(3):
        try:
            with _connect_or_start(state, name) as sock:
                return _run(sock, workers, {"op": "exec", **request}, printer, notice)
        except _Stale:
            _wait_gone(socket_path(state.pod_dir(name)))
    raise TpupodError(
        f"the connection holder of pod {name!r} keeps restarting",
        hint=f"see {state.pod_dir(name) / LOG_FILE}; TPUPOD_HOLDER=0 works without it",
    )


def held_exec(
    state: StateDir,
    name: str,
    workers: Sequence[WorkerLike],
    request: dict[str, object],
    quiet: bool,
) -> FanoutResult:
    """``tpupod exec`` through the pod's holder: output printed as it arrives, signals forwarded."""
    printer = None if quiet else LinePrinter(workers, sys.stdout, sys.stderr)
    return exec_via_holder(
        state,
        name,
        workers={w.id: w for w in workers},
        request=request,
        printer=printer,
        notice=notice,
    )


def forward_port(
    state: StateDir, name: str, *, worker: int, host: str, port: int, local_port: int = 0
) -> int:
    """Have the pod's holder (started if needed) hold a local port open to ``host:port`` as
    ``worker`` sees it, over its SSH connection; returns the local port. Asked again for the
    same address, the holder answers with the port it already holds."""
    request = {"op": "forward", "worker": worker, "host": host, "port": port}
    for _ in range(3):
        try:
            with _connect_or_start(state, name) as sock:
                answer = _ask(sock, {**request, "local_port": local_port})
        except _Stale:
            _wait_gone(socket_path(state.pod_dir(name)))
            continue
        if "error" in answer:
            raise TpupodError(str(answer["error"]), hint=answer.get("hint"))
        return int(answer["local_port"])
    raise TpupodError(
        f"the connection holder of pod {name!r} keeps restarting",
        hint=f"see {state.pod_dir(name) / LOG_FILE}; TPUPOD_HOLDER=0 works without it",
    )


def close_forward(state: StateDir, name: str, *, worker: int, host: str, port: int) -> None:
    """Close the holder's forward to ``host:port``, if a holder runs and holds one."""
    request = {"op": "unforward", "worker": worker, "host": host, "port": port}
    with (
        contextlib.suppress(OSError, _Stale, ValueError),
        _connect(socket_path(state.pod_dir(name))) as sock,
    ):
        _ask(sock, request)


def _ask(sock: socket.socket, request: dict[str, object]) -> dict[str, Any]:
    """One request, one answer."""
    sock.sendall(json.dumps(request).encode() + b"\n")
    answer: dict[str, Any] = json.loads(sock.makefile("rb").readline() or b"{}")
    if answer.get("error") == "stale":
        raise _Stale
    return answer


def stop_holder(state: StateDir, name: str) -> None:
    """Ask the pod's holder, if one runs, to close its connections and exit."""
    try:
        with _connect(socket_path(state.pod_dir(name))) as sock:
            sock.sendall(b'{"op":"stop"}\n')
            sock.recv(4096)
    except OSError:
        pass


def _run(
    sock: socket.socket,
    workers: dict[int, WorkerLike],
    request: dict[str, object],
    printer: LinePrinter | None,
    notice: Callable[[str], None],
) -> FanoutResult:
    def forward(signum: int, frame: FrameType | None = None) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps({"op": "interrupt", "signal": signum}).encode() + b"\n")

    if printer is not None:
        printer.on_broken_pipe = lambda: forward(signal.SIGPIPE)
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        sock.sendall(json.dumps(request).encode() + b"\n")
        for raw in sock.makefile("rb"):
            message = json.loads(raw)
            if "line" in message:
                worker_id, is_err, text = message["line"]
                if printer is not None:
                    printer(
                        workers[worker_id],
                        OutputLine(Stream.STDERR if is_err else Stream.STDOUT, text),
                    )
            elif "notice" in message:
                notice(message["notice"])
            elif "result" in message:
                return result_from_json(message["result"], workers)
            elif message.get("error") == "stale":
                raise _Stale
            elif "error" in message:
                raise TpupodError(f"the connection holder refused: {message['error']}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise TpupodError(
        "the connection holder stopped before the command ended",
        hint="rerun; if it happens again, run with TPUPOD_HOLDER=0 and report it",
    )


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def _connect_or_start(state: StateDir, name: str) -> socket.socket:
    path = socket_path(state.pod_dir(name))
    try:
        return _connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    log = state.pod_dir(name) / LOG_FILE
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpupod.holder", "--home", str(state.root), "--pod", name],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    # The holder outlives this call. A thread owns its Popen and reaps it when it ends:
    # a long-lived caller (the dashboard, a test) then keeps no zombie, and no Popen is
    # collected while the holder still runs ("subprocess N is still running").
    threading.Thread(target=proc.wait, name=f"holder-{name}", daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return _connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            if proc.returncode not in (None, 0):  # set by the reaping thread
                break
            time.sleep(0.005)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    raise TpupodError(
        f"the connection holder of pod {name!r} did not start" + (f": {tail[0]}" if tail else ""),
        hint=f"see {log}; TPUPOD_HOLDER=0 runs without it",
    )


def _wait_gone(path: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
