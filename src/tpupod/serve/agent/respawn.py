"""``python -m tpupod.serve.agent.respawn --state-dir D [--listen] NAME -- ARGV``: a detached
service, started again when it dies.

The router is one process on worker 0 in front of every server: when it died (``kill
-9``, the OOM killer, a crash) the endpoint refused every request until the next
``serve up``, which restarted the whole fleet. ctl's ``ensure`` starts it (and each
worker's agent, which takes over the servers the one before left) under this small
parent, which starts it again on the port its first run bound (``--port 0`` picks one
once: the endpoint does not move), its output to the same log.

* **The socket outlives the router** (``--listen``, the builtin router): this process
  binds the service's ``--host``/``--port`` once and hands the listening socket to each
  run (``--fd N``). A connection that comes while no router runs waits in the socket's
  backlog for the next one, instead of being refused (a kill cost 1.5-4.9 s of refused
  requests): a kill costs only the requests in flight in the killed router.
  sgl-router (a Rust server) binds its own port.
* **At once or after a wait.** A run that listened and was killed by a signal served
  fine: it is started again at once. One that exits by itself (an error) or dies
  before it listens is started again after 1 s, doubling up to 30 s (back to 1 s after
  a run of 60 s, ``backoff.py``), so one that keeps failing does not spin. A first run
  that ends before it listens is not started again: this exits with its code, which
  ``ensure`` reports at once with the log's last lines.
* **Said and counted.** Each line of the log starts with its UTC time, as the servers'
  logs do: the service's output comes through a pipe this process reads (``stamp``). Each
  end is said in one line of its own (``the router exited (killed by SIGKILL) after
  12.3s; started again at once (restart 3)``), and each start after the first is
  counted (``NAME.restarts``, which ``serve status`` shows). On a full disk the count is
  kept here and written once there is room (``services.when_room``), the latest one;
  meanwhile each run has its number in its environment (``services.RESTART_ENV``), where
  ``serve status`` reads it.

SIGTERM or SIGINT (ctl's ``stop``) is passed on to the service, which is waited for;
then this exits 0 (the listening socket closed first: new connections are refused
while the service drains). Its pid is in ``NAME.keeper`` beside the service's own record
(``NAME.json``, written by the service, naming this process as its ``parent``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO

from tpupod.serve import defaults, services
from tpupod.serve.backoff import Backoff

STOP_GRACE_S = 8.0  # the service's own shutdown (the router drains for a few seconds)
DRAIN_S = 2.0  # after the service ends, how long its output may still come (a child holds it)
LINE_LIMIT = 64 * 1024  # a longer "line" is written in pieces of this size
_writing = threading.Lock()  # this process's lines and the service's, whole lines each


def keeper_path(state: Path, service: str) -> Path:
    return state / f"{service}.keeper"


def with_port(argv: list[str], port: int | None) -> list[str]:
    """``argv`` with its ``--port`` value replaced by ``port`` (None: as it is)."""
    if port is None or "--port" not in argv[:-1]:
        return argv
    i = argv.index("--port")
    return [*argv[: i + 1], str(port), *argv[i + 2 :]]


def _bound_port(state: Path, service: str, pid: int) -> int | None:
    """The port the service's record says it listens on, once it has written it."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = json.loads((state / f"{service}.json").read_text())
        if record["pid"] == pid:
            return int(record["port"])
    return None


def _write(line: bytes) -> None:
    """One line to the log (this process's stdout), after the time it came."""
    with _writing, contextlib.suppress(OSError):  # a full disk: the line is lost, not us
        sys.stdout.buffer.write(services.stamp() + line.rstrip(b"\n") + b"\n")
        sys.stdout.buffer.flush()


def _say(text: str) -> None:
    _write(f"[tpupod respawn] {text}".encode())


def _copy(output: IO[bytes]) -> None:
    """Each line the service writes, to the log, stamped (in a thread: one a run)."""
    with contextlib.suppress(OSError, ValueError):
        while line := output.readline(LINE_LIMIT):
            _write(line)


def _start(
    argv: list[str], fds: tuple[int, ...], restart: int
) -> tuple[subprocess.Popen[bytes], threading.Thread]:
    """The service, its output (stdout and stderr) read by a thread that stamps its lines;
    which restart it is in its environment."""
    child = subprocess.Popen(
        argv,
        env={**os.environ, services.RESTART_ENV: str(restart)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=fds,
    )
    assert child.stdout is not None
    copier = threading.Thread(target=_copy, args=(child.stdout,), name="log", daemon=True)
    copier.start()
    return child, copier


def _exit_text(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def option(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (None: not given)."""
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def listen(argv: list[str]) -> socket.socket:
    """The service's listening socket, bound as the router binds it (its ``--host`` and
    ``--port``, SO_REUSEADDR, a backlog of 1024); inherited by each run."""
    host = option(argv, "--host") or "127.0.0.1"
    port = int(option(argv, "--port") or 0)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


class _Count:
    """The service's restarts: kept here, written to ``NAME.restarts`` when there is room.
    A count is a view, never worth the keeper: on a full disk it is written late, the
    count current then (a restart made meanwhile too), never a stale one."""

    def __init__(self, state: Path, service: str) -> None:
        self.state, self.service = state, service
        self.value = services.restarts(state, service)  # ensure's: 0, or one more (--again)

    def set(self, value: int) -> None:
        self.value = value
        with contextlib.suppress(OSError):
            services.when_room(self._write, f"{self.service}.restarts", say=_say)

    def _write(self) -> None:
        services.write_restarts(self.state, self.service, self.value)


class _Run:
    """One run of the service: its process, the thread copying its output, when it began,
    and whether it listened (recorded itself)."""

    def __init__(self, argv: list[str], fds: tuple[int, ...], restart: int) -> None:
        self.began = time.monotonic()
        self.child, self.copier = _start(argv, fds, restart)
        self.listened = False

    def ran(self) -> str:
        return f"{time.monotonic() - self.began:.1f}s"

    def watch(self, state: Path, service: str, stopping: Callable[[], bool]) -> int | None:
        """Wait for the run to end (TERM it where a stop came as it started); the port its
        record says it listened on, if it recorded itself."""
        port, told = None, False
        while self.child.poll() is None:
            if stopping() and not told:
                self.child.terminate()
                told = True
            if port is None and (port := _bound_port(state, service, self.child.pid)):
                self.listened = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(0.2 if self.listened else 0.05)
        port = port or _bound_port(state, service, self.child.pid)
        self.listened = port is not None
        self.copier.join(DRAIN_S)  # its last lines (how it ended) before ours
        return port


def keep(state: Path, service: str, argv: list[str], hand_socket: bool = False) -> int:
    """Run ``argv`` until told to stop, starting it again whenever it ends; with
    ``hand_socket``, on a listening socket bound here once (``listen``)."""
    run: _Run | None = None
    stopping = False
    try:
        sock = listen(argv) if hand_socket else None
    except OSError as exc:  # ctl's ensure reports the exit with this line
        _say(f"cannot listen on {option(argv, '--host')}:{option(argv, '--port')}: {exc}")
        return 1

    def stop(signum: int, _: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if sock is not None:
            sock.close()  # new connections are refused while the service drains
        if run is not None and run.child.poll() is None:
            run.child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    keeper_path(state, service).write_text(f"{os.getpid()}\n")
    port: int | None = sock.getsockname()[1] if sock is not None else None
    backoff = Backoff(defaults.RESTART_BACKOFF_S)
    count = _Count(state, service)
    served = False  # a run listened: the service can start
    said: str | None = None  # why this start is a restart
    try:
        while not stopping:
            fds = () if sock is None else (sock.fileno(),)
            extra = [] if sock is None else ["--fd", str(sock.fileno())]
            run = _Run([*with_port(argv, port), *extra], fds, count.value)
            if said is not None:
                _say(said)
            port = run.watch(state, service, lambda: stopping) or port
            if stopping:
                break
            served = served or run.listened
            if not served:
                # it never listened (a bad option, a missing package): a restart would fail
                # the same way, and ctl's ensure reports this exit with the log's last lines
                return run.child.returncode or 1
            said = _restart(service, run, count, backoff, lambda: stopping)
    finally:
        if sock is not None:
            sock.close()
        _finish(run)
        with contextlib.suppress(OSError):
            if keeper_path(state, service).read_text().strip() == str(os.getpid()):
                keeper_path(state, service).unlink()
    return 0


def _restart(
    service: str, run: _Run, count: _Count, backoff: Backoff, stopping: Callable[[], bool]
) -> str | None:
    """After a run ended: wait as long as it deserves, count the restart; what to say once
    the next run has started (None: a wait was said now, or a stop came meanwhile)."""
    code = run.child.returncode
    ended = f"the {service} exited ({_exit_text(code)}) after {run.ran()}"
    restart = count.value + 1
    if run.listened and code < 0:  # it served and a signal killed it: no reason to wait
        backoff.reset()
        count.set(restart)
        return f"{ended}; started again at once (restart {restart})"
    wait = backoff.after(time.monotonic() - run.began)
    _say(f"{ended}; starting it again in {wait:g}s (restart {restart})")
    deadline = time.monotonic() + wait
    while not stopping() and time.monotonic() < deadline:
        time.sleep(0.05)
    if stopping():
        return None
    count.set(restart)
    return None


def _finish(run: _Run | None) -> None:
    """The service stopped (KILL after a grace), and how it stopped in the log."""
    if run is None:
        return
    if run.child.poll() is None:
        try:
            run.child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            run.child.kill()
            run.child.wait()
    run.copier.join(DRAIN_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpupod.serve.agent.respawn")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument(
        "--listen", action="store_true", help="bind --host/--port here; each run gets --fd N"
    )
    parser.add_argument("service")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- the service's command line")
    args = parser.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("give the service's command line after --")
    return keep(Path(args.state_dir), args.service, command, args.listen)


if __name__ == "__main__":
    sys.exit(main())
