"""The builtin server as three processes: a keeper, the engine, the front end (vLLM's split).

``python -m tpupod.serve.builtin`` (what the fleet's agent starts and
watches) binds the ports, then becomes the *keeper*: a small process that
starts two children in its process group and restarts either when a signal
kills it (``kill -9``, the OOM killer, an abort):

- the **engine** process loads the model and runs every port's engine (one
  process owns the device, as before); each engine is served over a Unix
  socket (``enginelink.py``);
- the **front end** process holds the ports (inherited from the keeper) and
  runs HTTP, validation, chat templates and tokenizing, so request handling
  never takes the engine loop's interpreter time.

Front end killed: the engine keeps its compiled programs and KV cache (the
dead front end's requests are cancelled); the keeper starts a new front end
on the same listening sockets (connections wait in the backlog meanwhile).
Engine killed: the front end fails every request in flight (a stream ends
with an ``error`` event) and answers 503 with the reason until the keeper's
new engine is warm. A child that exits by itself (an error, a clean stop)
ends the server with its exit code, and the fleet's supervisor takes over.
A child that hangs is killed, then restarted as above: the front end kills an
engine silent for ``--stall-timeout`` with requests in flight
(``enginelink.py``), and the keeper a front end whose ``/health`` has not
answered for as long after it first did (``_Probe``).
SIGTERM stops both children (the front end first), then the keeper exits 0;
the children die with the keeper (``PR_SET_PDEATHSIG``), and all three share
the process group the fleet stops, so ``serve status``, ``serve restart`` and
``serve down`` see one server as before. The sockets' folder (in the temp
folder, mode 0700) is named after the keeper's pid: one that ``kill -9`` left
is removed by the next keeper to start.

Deferred imports: each process imports its own side: the engine process the link's host, the
front end the link's client and the HTTP app; the keeper neither.

Each restart is said in the server's log when the death is seen (``the engine process
was killed (SIGKILL) after 41.2s; starting it again in 0.5s (restart 2)``) and counted,
by process, in the file the fleet's agent names (``TPUPOD_SERVE_CHILD_RESTARTS``), which
``serve status`` shows beside the agent's own restarts of the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tpupod import settings
from tpupod.serve import eventloop, services
from tpupod.serve.backoff import Backoff
from tpupod.serve.builtin import server

RESTART_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
STOP_GRACE_S = 8.0
POLL_S = 0.05
PROBE_S = 1.0  # the keeper asks its front end's /health this often
FOLDER_PREFIX = "tpupod-builtin-"


class _Child:
    """One child process of the keeper and its restarts: counted in the file the agent
    names (``services.CHILD_RESTARTS_ENV``), which ``serve status`` shows, and said in the
    server's log as each death is seen."""

    def __init__(
        self, role: str, argv: list[str], fds: tuple[int, ...], counted: Path | None
    ) -> None:
        self.role, self.argv, self.fds, self.counted = role, argv, fds, counted
        self.proc: subprocess.Popen[bytes] | None = None
        self.began = 0.0
        self.backoff = Backoff(RESTART_BACKOFF_S, MAX_BACKOFF_S)
        self.due: float | None = None  # when a restart is due
        # on file: this server's keeper may be a new one (the agent restarted the server)
        self.restarts = services.child_restarts(counted).get(role, 0) if counted else 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, pass_fds=self.fds, stdin=subprocess.DEVNULL)
        if self.due is not None:  # a restart
            self.restarts += 1
            if self.counted is not None:
                self.restarts = services.count_child_restart(self.counted, self.role)
        self.began = time.monotonic()
        self.due = None

    def exited(self) -> int | None:
        """Its exit code, once it ended (and only once)."""
        if self.proc is None or (code := self.proc.poll()) is None:
            return None
        self.proc = None
        return code

    def schedule_restart(self, code: int) -> None:
        ran = time.monotonic() - self.began
        wait = self.backoff.after(ran)
        _say(
            f"the {self.role} process was killed ({_signal_name(code)}) after {ran:.1f}s; "
            f"starting it again in {wait:g}s (restart {self.restarts + 1})"
        )
        self.due = time.monotonic() + wait

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


class _Restarting:
    """The children being restarted, from a death until the server answers 200 again:
    on file for ``serve status`` (``restarting (engine)``; it said "ready" for the minutes
    an engine took to come back), and the return said in the log."""

    def __init__(self, counted: Path | None) -> None:
        self.counted = counted
        self.roles: list[str] = []
        self.since: float | None = None

    def mark(self, child: _Child) -> None:
        if child.role not in self.roles:
            self.roles.append(child.role)
        self.since = self.since if self.since is not None else time.monotonic()
        self._save()

    def back(self, *, quiet: bool = False) -> None:
        if self.since is None:
            return
        if not quiet:
            took = time.monotonic() - self.since
            _say(f"the {' and '.join(self.roles)} is serving again after {took:.1f}s")
        self.roles, self.since = [], None
        self._save()

    def _save(self) -> None:
        if self.counted is not None:
            with contextlib.suppress(OSError):  # a full disk: status goes without it
                services.set_child_restarting(self.counted, self.roles)


class _Probe:
    """Asks the front end's ``/health`` every ``PROBE_S`` s (a thread: the keeper's loop
    never waits on it). Any HTTP answer counts, a 503 too: the front end is alive. A
    front end still starting is not listening yet (refused), so silence counts only after
    it first answered: :meth:`silent` is how long since its last answer, then."""

    def __init__(self, host: str, port: int) -> None:
        self.address = ("::1" if host == "::" else "127.0.0.1" if host in ("0.0.0.0", "") else host,
                        port)  # fmt: skip
        self.answered: float | None = None
        self.healthy = False  # its last answer was 200: the engine behind it serves too
        threading.Thread(target=self._run, name="front-end-probe", daemon=True).start()

    def reset(self) -> None:
        """A new front end, or a new engine: neither has answered yet."""
        self.answered = None
        self.healthy = False

    def silent(self) -> float:
        return 0.0 if self.answered is None else time.monotonic() - self.answered

    def _run(self) -> None:
        request = b"GET /health HTTP/1.1\r\nHost: keeper\r\nConnection: close\r\n\r\n"
        while True:
            try:
                with socket.create_connection(self.address, timeout=PROBE_S) as conn:
                    conn.sendall(request)
                    head = conn.recv(12)
                    if head.startswith(b"HTTP/1."):
                        self.answered = time.monotonic()
                        self.healthy = head[9:12] == b"200"
            except OSError:
                pass
            # until a first answer, often: a front end that hangs just after it starts
            # serving is then seen too
            time.sleep(PROBE_S if self.answered is not None else PROBE_S / 4)


def _say(text: str) -> None:
    print(f"[tpupod builtin] {text}", file=sys.stderr, flush=True)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def keep(args: argparse.Namespace, sockets: list[socket.socket]) -> int:
    """Run the engine and the front end; restart the one a signal kills; 0 after SIGTERM."""
    _sweep_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))  # 0700: ours alone
    base = [sys.executable, "-m", "tpupod.serve.builtin", *_passed_on(args), "--ipc", str(folder)]
    fds = tuple(s.fileno() for s in sockets)
    named = settings.child_restarts_file()
    counted = Path(named) if named else None
    engine = _Child("engine", [*base, "--role", "engine"], (), counted)
    front = _Child("front end", [*base, "--role", "frontend", "--fds", _join(fds)], fds, counted)
    children = [front, engine]
    probe = _Probe(args.host, server.parse_ports(args.ports)[0]) if args.stall_timeout else None
    restarting = _Restarting(counted)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    try:
        engine.start()
        front.start()
        while not stopping:
            time.sleep(POLL_S)
            for child in children:
                if (code := child.exited()) is not None and not stopping:
                    if code >= 0:  # it ended by itself: so does the server
                        return code
                    if child is engine:
                        for path in folder.glob("*.sock"):
                            path.unlink(missing_ok=True)
                    child.schedule_restart(code)
                    restarting.mark(child)
                    if probe is not None:  # the silence is the restart's, not a hang; and
                        probe.reset()  # a 200 from before the death is not the return
                if child.due is not None and time.monotonic() >= child.due:
                    child.start()
                    _restarted(child is front, probe, restarting)
            if restarting.since is not None and probe is not None and probe.healthy:
                restarting.back()
            if probe is not None and probe.silent() > args.stall_timeout:
                _say(f"the front end has not answered for {args.stall_timeout:g}s; killing it")
                probe.reset()
                front.signal(signal.SIGKILL)  # the loop above restarts it
        return 0
    finally:
        restarting.back(quiet=True)
        _stop(children)
        shutil.rmtree(folder, ignore_errors=True)


def _restarted(front: bool, probe: _Probe | None, restarting: _Restarting) -> None:
    """A child was started again: a new front end has not answered yet; without a probe
    nothing tells when the server serves again, so its start counts as its return."""
    if probe is None:
        restarting.back()
    elif front:
        probe.reset()


def _sweep_folders() -> None:
    """Remove the socket folders of keepers that died by ``kill -9`` (their own cleanup
    never ran): a folder is named after its keeper's pid."""
    for folder in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-", 1)[0]
        if pid.isdigit() and folder.stat().st_uid == os.getuid() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(children: list[_Child]) -> None:
    """TERM the front end, then the engine; KILL what is left after a grace period."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def _join(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _passed_on(args: argparse.Namespace) -> list[str]:
    """The keeper's own options, for its children."""
    argv = ["--model", args.model, "--host", args.host, "--ports", args.ports]
    argv += ["--max-batch", str(args.max_batch), "--max-length", str(args.max_length)]
    argv += ["--smallest-span", str(args.smallest_span), "--stall-timeout", str(args.stall_timeout)]
    for flag, value in (
        ("--dtype", args.dtype),
        ("--served-model-name", args.served_model_name),
        ("--prefill-tokens", args.prefill_tokens),
        ("--decode-steps", args.decode_steps),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _die_with_parent() -> None:
    """Be killed when the keeper dies (even by ``kill -9``): no orphan holds the device."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the keeper died before the line above
        os._exit(1)


def engine_main(args: argparse.Namespace, ports: list[int]) -> int:
    """The engine process: every port's engine, warm, each behind its link."""
    from tpupod.serve.builtin.link import EngineHost, socket_path

    _die_with_parent()
    engines = server.build_engines(args, len(ports))
    server.warm(engines)
    # from here a stop waits for the engines to fail what they hold (threads inherit the mask)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    for engine, port in zip(engines, ports, strict=True):
        host = EngineHost(engine, socket_path(Path(args.ipc), port))
        engine.start(f"engine-{port}")
        host.start(f"engine-{port}")
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    for engine in engines:
        engine.shutdown(server.SHUTDOWN_MESSAGE, timeout=10)
    return 0


def frontend_main(args: argparse.Namespace, ports: list[int]) -> int:
    """The front-end process: the ports' HTTP servers, each on its engine's link."""
    _die_with_parent()
    sockets = [socket.socket(fileno=int(fd)) for fd in args.fds.split(",")]
    eventloop.use_uvloop()
    return asyncio.run(_front(sockets, ports, args))


async def _front(sockets: list[socket.socket], ports: list[int], args: argparse.Namespace) -> int:
    from tpupod.serve.builtin.link import RemoteEngine, socket_path
    from tpupod.serve.builtin.openai_api import create_app

    ipc, name = Path(args.ipc), server.served_name(args)
    remotes = [RemoteEngine(socket_path(ipc, port), args.stall_timeout) for port in ports]
    links = [asyncio.create_task(remote.run()) for remote in remotes]
    await asyncio.gather(*(remote.connected.wait() for remote in remotes))  # warm engines

    def stop() -> None:
        for remote in remotes:
            remote.shutdown(server.SHUTDOWN_MESSAGE)

    apps = [create_app(r, name, vocab_size=r.vocab_size) for r in remotes]
    await server.serve_apps(apps, sockets, ports, args.host, stop)
    for link in links:
        link.cancel()
    return 0
