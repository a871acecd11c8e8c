"""``python -m tpupod.serve.agent.respawn --state-dir D NAME -- ARGV``: a detached service, started
again when it dies.

The router is one process on worker 0 in front of every server: when it died (``kill
-9``, the OOM killer, a crash) the endpoint refused every request until the next
``serve up``, which restarted the whole fleet. ctl's ``ensure`` now starts it under
this small parent, which starts it again after 1 s (doubling up to 30 s, back to 1 s
after a run of 60 s) on the port its first run bound (``--port 0`` picks one once:
the endpoint does not move), its output to the same log, with a line saying why. Each
line of the log starts with its UTC time, as the servers' logs do: the service's output
comes through a pipe this process reads (``stamp``). Each start after the first is
counted (``NAME.restarts``, which ``serve status`` shows). A first run that ends before
it listens is not started again: this exits with its code, which ``ensure`` reports at
once with the log's last lines.

SIGTERM or SIGINT (ctl's ``stop``) is passed on to the service, which is waited for;
then this exits 0. Its pid is in ``NAME.keeper`` beside the service's own record
(``NAME.json``, written by the service, naming this process as its ``parent``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
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
    with _writing:
        sys.stdout.buffer.write(services.stamp() + line.rstrip(b"\n") + b"\n")
        sys.stdout.buffer.flush()


def _say(text: str) -> None:
    _write(f"[tpupod respawn] {text}".encode())


def _copy(output: IO[bytes]) -> None:
    """Each line the service writes, to the log, stamped (in a thread: one a run)."""
    with contextlib.suppress(OSError, ValueError):
        while line := output.readline(LINE_LIMIT):
            _write(line)


def _start(argv: list[str]) -> tuple[subprocess.Popen[bytes], threading.Thread]:
    """The service, its output (stdout and stderr) read by a thread that stamps its lines."""
    child = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert child.stdout is not None
    copier = threading.Thread(target=_copy, args=(child.stdout,), name="log", daemon=True)
    copier.start()
    return child, copier


def _exit_text(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def keep(state: Path, service: str, argv: list[str]) -> int:
    """Run ``argv`` until told to stop, starting it again whenever it ends."""
    child: subprocess.Popen[bytes] | None = None
    copier: threading.Thread | None = None
    stopping = False

    def stop(signum: int, _: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    keeper_path(state, service).write_text(f"{os.getpid()}\n")
    port: int | None = None
    backoff = Backoff(defaults.RESTART_BACKOFF_S)
    try:
        while not stopping:
            began = time.monotonic()
            child, copier = _start(with_port(argv, port))
            told = False
            while child.poll() is None:
                if stopping and not told:  # the stop came as it started
                    child.terminate()
                    told = True
                if port is None:
                    port = _bound_port(state, service, child.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(0.2)
            copier.join(DRAIN_S)  # its last lines (how it ended) before ours
            if stopping:
                break
            if port is None and (port := _bound_port(state, service, child.pid)) is None:
                # it never listened (a bad option, a missing package): a restart would fail
                # the same way, and ctl's ensure reports this exit with the log's last lines
                return child.returncode or 1
            wait = backoff.after(time.monotonic() - began)
            _say(
                f"the {service} ended ({_exit_text(child.returncode)}); "
                f"starting it again in {wait:g}s"
            )
            deadline = time.monotonic() + wait
            while not stopping and time.monotonic() < deadline:
                time.sleep(0.05)
            if not stopping:
                services.count_restarts(state, service, services.restarts(state, service) + 1)
    finally:
        _finish(child, copier)
        with contextlib.suppress(OSError):
            if keeper_path(state, service).read_text().strip() == str(os.getpid()):
                keeper_path(state, service).unlink()
    return 0


def _finish(child: subprocess.Popen[bytes] | None, copier: threading.Thread | None) -> None:
    """The service stopped (KILL after a grace), and how it stopped in the log."""
    if child is not None and child.poll() is None:
        try:
            child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if copier is not None:
        copier.join(DRAIN_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpupod.serve.agent.respawn")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("service")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- the service's command line")
    args = parser.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("give the service's command line after --")
    return keep(Path(args.state_dir), args.service, command)


if __name__ == "__main__":
    sys.exit(main())
