"""``tpupod exec`` on a local pod with no event loop: the console script's fast path.

A local pod's workers are processes of this machine. Starting four of them
needs neither asyncio, nor pydantic (the pod's record is read as plain JSON),
nor the CLI framework: those imports cost ten times what the command does.
This runs plain ``exec`` lines (workers, ``-e``, ``--quiet``, ``--verbose``,
``--grace``, ``--on-fail wait``) with ``os.posix_spawn`` and a ``selectors`` loop;
anything else (``--timeout``, ``--on-fail kill``, ``--image``) goes to the
full fan-out (``fanout.py``), which stays the reference: tests run the same
argument lines both ways and compare what the workers saw and what was printed.
"""

from __future__ import annotations

import errno
import os
import selectors
import signal
import sys
import time
from collections import deque

from tpupod.base import limits
from tpupod.base.plain import TYPE_CHECKING
from tpupod.fanout.report import LinePrinter
from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
from tpupod.pod.identity import identity_env
from tpupod.transport.base import ExitStatus, OutputLine, Stream, command_script
from tpupod.transport.lines import LineSplitter

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from tpupod.pod.state import WorkerBrief

TAIL_LINES = 10
OUTPUT_LINGER_S = 2.0  # as workerrun: output a background child holds open after the exit
POLL_S = 0.05
START_HINT = (  # as transport/local.py says it
    "the pod's working directory may be gone; 'tpupod down' then 'tpupod up' recreates it"
)
FILES_HINT = "raise the hard limit on open files (ulimit -Hn): a worker takes four"
SHELL = "/bin/bash"  # as transport/local.py, which imports asyncio


def local_env(record: dict[str, Any], index: int, extra: dict[str, str]) -> dict[str, str]:
    """What worker ``index`` of a local pod sees (``Pod.identity_env`` + the local provider's
    ``worker_env`` + ``extra``), from the raw record; tests compare it with the full path's."""
    workers, spec = record["workers"], record["spec"]
    addresses = [str(w["internal_address"]) for w in workers]
    slices = [w.get("slice") for w in workers]
    name, uid = str(record["name"]), str(record.get("uid", ""))
    return {
        **identity_env(name, uid, int(workers[index]["id"]), addresses, slices),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(spec["devices_per_worker"]),
        **{str(k): str(v) for k, v in spec.get("env", {}).items()},
        **extra,
    }


class _Child:
    """A worker's shell, started by :func:`spawn`: its pid and our ends of its pipes."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int) -> None:
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None  # as Popen's: -N when killed by signal N

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def spawn(argv: list[str], env: dict[str, str], cwd: str | None) -> _Child:
    """``subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)`` with its three
    streams piped, by ``os.posix_spawn``: importing subprocess (threading, locale, ...)
    cost this path more than starting four shells. posix_spawn has no ``cwd``, so this
    single-threaded process steps into ``cwd`` for the spawn and back; the signals Python
    ignores (SIGPIPE, SIGXFSZ) are reset for the child as Popen does, and every descriptor
    Python opens is close-on-exec (``inherited_fds_closed`` covers the ones it was given)."""
    fds: list[int] = []  # stdin r/w, stdout r/w, stderr r/w
    back = None
    try:
        for _ in range(3):
            fds.extend(os.pipe())
        if cwd:
            back = os.open(".", os.O_PATH | os.O_DIRECTORY)  # fchdir back, even unreadable
            os.chdir(cwd)
        pid = os.posix_spawn(
            argv[0],
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, fds[0], 0),
                (os.POSIX_SPAWN_DUP2, fds[3], 1),
                (os.POSIX_SPAWN_DUP2, fds[5], 2),
            ],
            setsid=True,
            # Popen's resets, and the two signals tpupod handles: the full CLI handles them
            # before it starts workers, so theirs are at their defaults even where tpupod
            # was started ignoring them (a script's `tpupod exec ... &` ignores SIGINT)
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM),
        )
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        if back is not None:
            os.fchdir(back)
            os.close(back)
    for fd in (fds[0], fds[3], fds[5]):
        os.close(fd)
    return _Child(pid, fds[1], fds[2], fds[4])


def inherited_fds_closed() -> None:
    """Make the descriptors this process inherited (above stderr) close-on-exec, so the
    workers do not get them (as Popen's ``close_fds``): a pipe a worker kept open could
    hold up whoever started tpupod."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)
            except OSError:
                pass  # the listing's own descriptor, closed by now


class _Run:
    """One worker's process: its output splitters, tail, and how it ended."""

    def __init__(self, worker: WorkerBrief, proc: _Child | None) -> None:
        self.worker = worker
        self.proc = proc
        self.started = time.monotonic()
        self.ended: float | None = None
        self.status: ExitStatus | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.lines = 0
        self.pipes_open: set[int] = set()
        self.error: str | None = None
        self.hint: str | None = None

    def pipes(self) -> list[tuple[int, Stream]]:
        """Its stdout and stderr, now counted as open."""
        if self.proc is None:
            return []
        self.pipes_open = {self.proc.stdout, self.proc.stderr}
        return [(self.proc.stdout, Stream.STDOUT), (self.proc.stderr, Stream.STDERR)]

    def take(self, text: str) -> None:
        self.lines += 1
        self.tail.append(text)

    def check_exit(self, now: float) -> bool:
        """Whether it exited just now (its status is then set)."""
        code = None if self.ended is not None or self.proc is None else self.proc.poll()
        if code is None:
            return False
        self.ended = now
        self.status = ExitStatus(code) if code >= 0 else ExitStatus(None, -code)
        return True


def run_local(
    record: dict[str, Any],
    workers: Sequence[WorkerBrief],
    line: str,
    env: dict[str, str],
    *,
    grace: float,
    quiet: bool = False,
) -> FanoutResult:
    """Run the bash command ``line`` on the local pod's ``workers`` (of its ``record``, read
    as plain JSON) with ``env`` added, output printed as it arrives (unless ``quiet``); a
    stop TERMs them, then KILLs after ``grace``."""
    interrupted: list[int] = []  # the signals that stop the workers, first one first
    printer = None
    if not quiet:  # our reader gone (``| head``): stop them all, as SIGPIPE would
        printer = LinePrinter(
            workers,
            sys.stdout,
            sys.stderr,
            on_broken_pipe=lambda: interrupted.append(signal.SIGPIPE),
        )
    script = command_script(line, guard=True)
    short = limits.open_files(4 * len(workers))  # three pipes and the guard's stdin a worker
    if short:
        print(f"tpupod: warning: {short}", file=sys.stderr, flush=True)
    started = time.monotonic()
    inherited_fds_closed()
    runs = [_start(record, w, env, script) for w in workers]
    previous = {
        signum: signal.signal(signum, lambda signum, frame: interrupted.append(signum))
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    failure_order = [run.worker.id for run in runs if run.proc is None]
    try:
        _pump(runs, printer, interrupted, failure_order, grace)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    stopped = interrupted[0] if interrupted else None
    results = [_result(run, stopped) for run in runs]
    for r in results:
        if not r.ok and r.worker.id not in failure_order:
            failure_order.append(r.worker.id)
    return FanoutResult(
        line,
        results,
        time.monotonic() - started,
        failure_order=failure_order,
        interrupt_signal=stopped,
    )


def _start(record: dict[str, Any], worker: WorkerBrief, extra: dict[str, str], script: str) -> _Run:
    env = {**os.environ, **local_env(record, worker.id, extra)}
    try:
        # Guarded (command_script): stdin is a pipe we never write to, closed if we die.
        proc = spawn([SHELL, "-c", script], env, record["workers"][worker.id].get("workdir"))
    except OSError as exc:
        run = _Run(worker, None)
        run.ended = run.started
        run.error = f"cannot start the command: {exc.strerror or exc}"
        run.hint = FILES_HINT if exc.errno == errno.EMFILE else START_HINT
        return run
    return _Run(worker, proc)


def _pump(
    runs: list[_Run],
    printer: LinePrinter | None,
    interrupted: list[int],
    failure_order: list[int],
    grace: float,
) -> None:
    """Read every worker's output until each has exited and closed it (or lingered too long);
    a SIGINT or SIGTERM stops them all (TERM, then KILL after ``grace``)."""
    selector = selectors.DefaultSelector()
    for run in runs:
        for pipe, stream in run.pipes():
            selector.register(pipe, selectors.EVENT_READ, (run, stream, LineSplitter()))
    stopping: float | None = None
    while any(run.ended is None or run.pipes_open for run in runs):
        for key, _ in selector.select(POLL_S):
            _read(selector, key, printer)
        _show_due(selector, printer)
        now = time.monotonic()
        for run in runs:
            if run.check_exit(now) and run.status is not None and not run.status.ok:
                failure_order.append(run.worker.id)
            if run.ended is not None and now - run.ended > OUTPUT_LINGER_S:
                for fd in list(run.pipes_open):
                    _close(selector, run, fd)
        if interrupted and stopping is None:
            stopping = now
            _signal_all(runs, signal.SIGTERM)
        if stopping is not None and now - stopping > grace:
            _signal_all(runs, signal.SIGKILL)
    selector.close()
    for run in runs:
        if run.proc is not None:
            os.close(run.proc.stdin)


def _read(
    selector: selectors.BaseSelector, key: selectors.SelectorKey, printer: LinePrinter | None
) -> None:
    """What one pipe has now, as lines; at its end, the last line and the pipe closed."""
    run, stream, splitter = key.data
    data = os.read(key.fd, 65536)
    _show(run, stream, splitter.feed(data) if data else splitter.finish(), printer)
    if not data:
        _close(selector, run, key.fd)


def _show_due(selector: selectors.BaseSelector, printer: LinePrinter | None) -> None:
    """Each bar state held back whose interval is up (a bar that stopped moving)."""
    for key in list(selector.get_map().values()):
        run, stream, splitter = key.data
        _show(run, stream, splitter.due(), printer)


def _show(run: _Run, stream: Stream, lines: list[str], printer: LinePrinter | None) -> None:
    for text in lines:
        run.take(text)
        if printer is not None:
            printer(run.worker, OutputLine(stream, text))


def _close(selector: selectors.BaseSelector, run: _Run, fd: int) -> None:
    run.pipes_open.discard(fd)
    selector.unregister(fd)
    os.close(fd)


def _signal_all(runs: list[_Run], signum: int) -> None:
    import contextlib  # here: only a signal needs it, and every exec imports this module

    for run in runs:
        if run.proc is not None and run.ended is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signum)


def _result(run: _Run, stopped: int | None) -> WorkerResult:
    if run.proc is None:
        outcome = Outcome.UNREACHABLE
    elif run.status is not None and run.status.ok:
        outcome = Outcome.OK
    else:
        outcome = Outcome.INTERRUPTED if stopped is not None else Outcome.FAILED
    return WorkerResult(
        worker=run.worker,
        outcome=outcome,
        duration=(run.ended or time.monotonic()) - run.started,
        status=run.status,
        tail=tuple(run.tail),
        lines=run.lines,
        error=run.error,
        hint=run.hint,
    )
