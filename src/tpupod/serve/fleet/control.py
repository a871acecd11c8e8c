"""A pod's serving fleet, one blocking call per ``tpupod serve`` command.

The CLI parses and prints; this is what it calls, and what a Python user or the
dashboard calls the same way::

    fleet = Fleet.open("mypod")
    fleet.up(UpOptions(model="/ckpts/qwen", python=fleet.pod.worker_python()))
    for server in fleet.status().servers:
        print(server.address, server.state)
    fleet.down()

The work on the workers is ``remote.py``'s (asynchronous, through the fan-out); the
record is ``record.py``'s; ``status()`` returns ``status.py``'s typed records.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shlex
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tpupod import settings
from tpupod.errors import ServeError, UsageError
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult
from tpupod.fanout.worker import LineHandler
from tpupod.pod import users as podusers
from tpupod.pod.record import Pod, Worker
from tpupod.pod.state import StateDir
from tpupod.serve.fleet.record import FleetRecord, ServerRecord, UpOptions, load_record
from tpupod.serve.fleet.remote import SERVE_UP, Progress, RemoteFleet
from tpupod.serve.fleet.status import FleetStatus, fleet_status
from tpupod.serve.services import STATE_DIR

T = TypeVar("T")

# Signals that stop a 'serve up': what it started is stopped, it says so, then it exits
# 128+N. SIGHUP: the terminal it ran in was closed.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long 'serve down' waits for a 'serve up' it stopped to stop what that one started.
STARTER_WAIT_S = 90.0


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class UpResult:
    record: FleetRecord
    started: bool  # False: the same fleet served already and nothing was touched
    seconds: float


@dataclass(frozen=True)
class Endpoint:
    """Where OpenAI clients reach the fleet: the base URL and the bearer token."""

    url: str
    token: str


class Fleet:
    """The serving fleet of one pod (recorded or not yet started)."""

    def __init__(self, pod: Pod, state: StateDir | None = None) -> None:
        self.pod = pod
        self.state = state or StateDir()

    @classmethod
    def open(cls, pod: str | None = None) -> Fleet:
        """The fleet of the pod named ``pod`` (default: the only or current one)."""
        state = StateDir()
        return cls(state.resolve(pod), state)

    def record(self) -> FleetRecord:
        """The record of the fleet serving on the pod; a ServeError when none serves (or
        its ``serve up`` has not finished, or ended before the fleet was ready)."""
        record = load_record(self.state, self.pod.name)
        if record.starting is None:
            return record
        if self._starting_alive(record):
            raise ServeError(
                f"the fleet on pod {self.pod.name!r} is still starting "
                f"(serve up, pid {record.starting})",
                hint="wait for 'tpupod serve up' to finish; 'tpupod serve status' shows its "
                "servers meanwhile",
            )
        raise ServeError(
            f"serve up (pid {record.starting}) ended before the fleet on pod "
            f"{self.pod.name!r} was ready",
            hint="'tpupod serve down' stops what it started; then 'tpupod serve up' again",
        )

    def _starting_alive(self, record: FleetRecord) -> bool:
        """Whether the ``serve up`` that started the record still runs (it holds its lock
        among the pod's users: a pid reused since does not count)."""
        users = podusers.users(self.state, self.pod.name)
        return any(u.pid == record.starting and u.what == SERVE_UP for u in users)

    def starting(self, record: FleetRecord) -> str | None:
        """What a record marked ``starting`` means now, in words (None: the fleet is up)."""
        if record.starting is None:
            return None
        if self._starting_alive(record):
            return f"serve up (pid {record.starting}) is starting this fleet"
        return (
            f"serve up (pid {record.starting}) ended before this fleet was ready: "
            "'tpupod serve down' stops what it started"
        )

    def _remote(self, python: str, use: Callable[[RemoteFleet], Awaitable[T]]) -> T:
        return asyncio.run(self._using(python, use))

    async def _using(self, python: str, use: Callable[[RemoteFleet], Awaitable[T]]) -> T:
        remote = RemoteFleet(self.pod, python)
        try:
            return await use(remote)
        finally:
            await remote.close()

    def local_model(self, model: str) -> str:
        """A local pod's workers start in their own folders: a model path here is made
        absolute (a gs:// URL, or a name no file has, is left as given)."""
        if self.pod.on_this_machine and not model.startswith("gs://") and Path(model).exists():
            return str(Path(model).absolute())
        return model

    def up(
        self, options: UpOptions, progress: Progress = _quiet, replace: bool = False
    ) -> UpResult:
        """Start agents and servers on every worker, then the router (see ``RemoteFleet.up``).
        Ctrl-C, SIGTERM and SIGHUP stop it: what it started is stopped, and the ServeError
        it then raises says so and exits 128+N."""
        options = dataclasses.replace(options, model=self.local_model(options.model))
        began = time.monotonic()
        use = self._stoppable(options.python, lambda f: f.up(options, progress, replace))
        record = asyncio.run(use)
        if record is None:
            return UpResult(self.record(), False, time.monotonic() - began)
        return UpResult(record, True, time.monotonic() - began)

    async def _stoppable(self, python: str, use: Callable[[RemoteFleet], Awaitable[T]]) -> T:
        """``_using`` where Ctrl-C, SIGTERM and SIGHUP stop the work: its task is cancelled,
        so ``RemoteFleet.up`` stops what it started; then a ServeError says what was left
        and exits 128+N. A second TERM or HUP while it stops is ignored (the stop is
        bounded by ctl's timeouts); a second Ctrl-C cuts the stop short. A signal its
        starter ignores (nohup's HUP, Ctrl-C for a script's background job) stays ignored.
        Only the main thread can take signals: elsewhere this is ``_using``."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        caught: list[int] = []

        def stop(signum: int) -> None:
            if not caught or (signum == signal.SIGINT and len(caught) == 1):
                caught.append(signum)
                task.cancel()

        installed = []
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_IGN:  # nohup, a script's '&': kept so
                continue
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(signum, stop, signum)
                installed.append(signum)
        try:
            return await self._using(python, use)
        except asyncio.CancelledError:
            others = 1  # cancels not ours: asyncio.run's own Ctrl-C before ours was set
            for _ in caught:
                others = task.uncancel()
            if others > 0:
                raise
            raise self._stopped_by(caught[0]) from None
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)

    def _stopped_by(self, signum: int) -> ServeError:
        """The error a ``serve up`` stopped by a signal ends with (its exit: 128+N)."""
        name = signal.Signals(signum).name
        try:  # a record still marked starting: its down did not finish
            left = load_record(self.state, self.pod.name).starting is not None
        except ServeError:
            left = False
        if left:
            stopped = ServeError(
                f"serve up was stopped ({name}) and could not stop all it had started",
                hint="'tpupod serve status' shows what runs; 'tpupod serve down' stops it",
            )
        else:
            stopped = ServeError(
                f"serve up was stopped ({name}); it stopped what it had started",
                hint="'tpupod serve up' again to start the fleet",
            )
        stopped.exit_code = 128 + signum
        return stopped

    def status(self, python: str | None = None) -> FleetStatus:
        """Every server's state as its agent and the router see it (a worker that does not
        answer is one whose rows say why). With no fleet recorded, a ServeError, naming
        what of a fleet runs on the workers anyway (``python``: theirs, for that look)."""
        return asyncio.run(self.status_async(python))

    async def status_async(self, python: str | None = None) -> FleetStatus:
        """``status()`` for a caller with an event loop running (the dashboard)."""
        try:
            record = load_record(self.state, self.pod.name)  # a fleet starting too
        except ServeError:
            await self._refuse_unrecorded(python)
            raise
        agents, router = await self._using(record.python, lambda f: f.status())
        return fleet_status(record, agents, router, self.starting(record))

    async def _refuse_unrecorded(self, python: str | None) -> None:
        """A ServeError naming the agents, router and servers that run on the workers
        though no fleet is recorded (a ``serve up`` that could not stop them, one started
        by hand); nothing when none runs."""
        chosen = self.pod.worker_python(python)
        found = await self._using(chosen, lambda f: f.running())
        if found:
            listed = ", ".join(found[:-1]) + " and " + found[-1] if len(found) > 1 else found[0]
            raise ServeError(
                f"no fleet is recorded on pod {self.pod.name!r}, yet {listed} "
                f"run{'s' if len(found) == 1 else ''}",
                hint=f"'tpupod serve down --pod {self.pod.name}' stops "
                f"{'it' if len(found) == 1 else 'them'}",
            )

    def restart(self, workers: str | None = None, port: int | None = None) -> list[str]:
        """Restart servers: all, those of some workers, or the one on ``port`` (every member
        of a replica across workers); ``w0:NAME`` for each restarted."""
        record = self.record()
        named = self._on_port(record, port) if port is not None else []
        selected = self.pod.select(workers)
        if named:
            members = {w for s in named for w in (s.worker, *s.followers)}
            selected = [w for w in selected if w.id in members]
        name = named[0].name if named else None
        return self._remote(record.python, lambda f: f.restart(selected, name))

    def _on_port(self, record: FleetRecord, port: int) -> list[ServerRecord]:
        """The servers on ``port`` (one a worker), refused when their process serves other
        ports too."""
        found = [s for s in record.servers if s.port == port]
        if not found:
            raise UsageError(
                f"no server listens on port {port}", hint="'tpupod serve status' lists them"
            )
        names = {s.name for s in found}
        shared = sorted({s.port for s in record.servers if s.name in names} - {port})
        if shared:  # a restart is of a process: it would take these ports down too
            others = ", ".join(f":{p}" for p in shared)
            raise UsageError(
                f"the server on :{port} runs in one process with {others} (the builtin backend "
                "serves a worker's ports from one process): restarting it restarts them all",
                hint=f"restart them together: tpupod serve restart -w {found[0].worker}",
            )
        return found

    def down(self, progress: Progress = _quiet, python: str | None = None) -> None:
        """Stop the router, every agent and every server; with no record, whatever runs.
        A ``serve up`` still starting the fleet is stopped first (SIGTERM: it stops what it
        started), so it cannot start more afterwards, and again at the end: one that began
        while this ran (after the first look) would go on to start a fleet of its own. The
        endpoint's forward (an SSH or cloud pod's) is closed too."""
        self._stop_starters(progress)
        try:
            record: FleetRecord | None = load_record(self.state, self.pod.name)
        except ServeError:
            record = None
        chosen = python or (record.python if record is not None else self.pod.worker_python())
        try:
            self._remote(chosen, lambda f: f.down(progress))
            self._stop_starters(progress)
        finally:
            if record is not None and not self.pod.on_this_machine:
                from tpupod.holder.client import close_forward  # an SSH pod's forward only

                close_forward(
                    self.state, self.pod.name, worker=0, host=record.router_host,
                    port=record.router_port,
                )  # fmt: skip

    def _stop_starters(self, progress: Progress) -> None:
        """TERM every ``serve up`` of this pod, and wait (bounded) until each has stopped."""

        def starters() -> list[podusers.PodUser]:
            users = podusers.users(self.state, self.pod.name)
            return [u for u in users if u.what == SERVE_UP and u.pid != os.getpid()]

        found = starters()
        for user in found:
            progress(f"stopping {user.describe()} first; it stops what it started")
            with contextlib.suppress(ProcessLookupError):
                os.kill(user.pid, signal.SIGTERM)
        deadline = time.monotonic() + STARTER_WAIT_S
        while found and (found := starters()) and time.monotonic() < deadline:
            time.sleep(0.1)

    def logs_command(
        self,
        port: int | None = None,
        lines: int = 50,
        follow: bool = False,
        router: bool = False,
        agent: bool = False,
    ) -> str:
        """The bash line that prints (``tail``) each worker's own servers' logs (a log of
        another fleet's server stays out), or with ``router`` worker 0's router log, with
        ``agent`` each worker's agent's."""
        if sum([router, agent, port is not None]) > 1:
            raise UsageError("--router, --agent and --port choose different logs: give one")
        record = load_record(self.state, self.pod.name)  # a fleet starting too
        chosen = [s for s in record.servers if port is None or s.port == port]
        if not chosen:
            raise UsageError(
                f"no server listens on port {port}", hint="'tpupod serve status' lists them"
            )
        arms = [f"0) set -- {shlex.quote(f'{STATE_DIR}/router.log')};;"] if router else []
        if agent:
            arms = [f"*) set -- {shlex.quote(f'{STATE_DIR}/agent.log')};;"]
        for w in [] if router or agent else self.pod.workers:
            names = sorted({s.name for s in chosen if w.id in (s.worker, *s.followers)})
            files = " ".join(shlex.quote(f"{STATE_DIR}/logs/{name}.log") for name in names)
            if names:
                arms.append(f"{w.id}) set -- {files};;")
        return (
            f'case "$TPUPOD_WORKER_ID" in {" ".join(arms)} *) exit 0;; esac; '
            f'tail -q -n {lines} {"-F" if follow else ""} "$@" 2>/dev/null; true'
        )

    def logs(
        self,
        on_line: LineHandler,
        workers: str | None = None,
        port: int | None = None,
        *,
        lines: int = 50,
        follow: bool = False,
        router: bool = False,
        agent: bool = False,
    ) -> FanoutResult:
        """The servers' (or the router's, or the agents') log lines, each to ``on_line``
        (until interrupted, with ``follow``)."""
        command = self.logs_command(port, lines, follow, router, agent)
        return asyncio.run(execute_async(self.pod, command, workers=workers, on_line=on_line))

    def endpoint(self, direct: bool = False, progress: Progress = _quiet) -> Endpoint:
        """Where clients reach the router. On an SSH or cloud pod the router listens on
        worker 0's internal address: unless ``direct``, a local port forwarded to it over
        the pod's SSH connection (held by the pod's connection holder until ``down``)."""
        record = self.record()
        url = record.base_url
        if not self.pod.on_this_machine and not direct:
            url = self._forwarded(record, progress)
        return Endpoint(url, record.token)

    def _forwarded(self, record: FleetRecord, progress: Progress) -> str:
        """A local URL forwarded to the router over worker 0's SSH connection."""
        from tpupod.holder.client import forward_port  # an SSH pod's only: not serve status

        host, port = record.router_host, record.router_port
        if not settings.holder_enabled():  # the holder is what keeps a forward open
            progress(
                "the router listens on worker 0's internal address and TPUPOD_HOLDER=0 keeps no "
                f"forward open; from outside the pod's network: ssh -N -L {port}:{host}:{port} "
                f"{_login(self.pod.workers[0])}, then use http://127.0.0.1:{port}/v1"
            )
            return record.base_url
        local = forward_port(
            self.state, self.pod.name, worker=0, host=host, port=port, local_port=port
        )
        progress(
            f"127.0.0.1:{local} forwards to the router at {host}:{port} over w0's SSH connection"
        )
        return f"http://127.0.0.1:{local}/v1"


def _login(head: Worker) -> str:
    """``user@host`` (and options) to reach worker 0 with ssh from outside the pod."""
    assert head.ssh is not None
    return str(head.ssh.model_copy(update={"host": head.external_address or head.ssh.host}))
