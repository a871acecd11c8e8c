"""``tpupod run``: one program on every worker in lockstep, supervised from outside.

Preflight (every worker answers, JAX's coordinator port is free on worker 0,
no process holds the accelerator), a new launch id and token, the rendezvous
service, every worker's environment, then the fan-out with ``on_fail=kill``:
when one JAX process dies its peers would wait out JAX's heartbeat timeout
(about 100 s) and ignore TERM, so the launcher kills them (TERM, then KILL).
Every line of output is also kept in ``runs/LAUNCH_ID/wN.log`` under the
pod's state folder, with ``run.json`` describing the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import secrets
import shlex
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from tpupod import settings
from tpupod.base.durations import format_seconds
from tpupod.base.files import remove_path, write_atomic
from tpupod.errors import PreflightError, StateError, TpupodError
from tpupod.fanout.context import Context, NoticeHandler, Sinks
from tpupod.fanout.execute import Policy, Supervision, run_on
from tpupod.fanout.report import DISK_FULL, DISK_FULL_HINT, worker_list
from tpupod.fanout.results import FanoutResult, OnFail, Outcome
from tpupod.fanout.worker import LineHandler
from tpupod.hang.digest import hints as stack_hints
from tpupod.hang.digest import lines as digest_lines
from tpupod.hang.digest import odd_workers
from tpupod.hang.digest import save as save_stacks
from tpupod.hang.progress import Progress
from tpupod.hang.stacks import GONE_HINT
from tpupod.hang.stacks import take as take_stacks
from tpupod.hang.watchdog import Stacks, Watchdog
from tpupod.image.containerize import (
    Container,
    check_workers,
    explain,
    remove_containers,
    wrap,
)
from tpupod.launch.client import LEAVING
from tpupod.launch.jaxinit import DEFAULT_COORDINATOR_PORT
from tpupod.launch.megascale import check_tpu_env, worker_megascale
from tpupod.launch.records import LAUNCHER_LOCK, RUN_FILE, RUNS_DIR, STOP_FILE
from tpupod.launch.rendezvous import FailureHandler, RendezvousServer
from tpupod.launch.rendezvous_main import EXIT_CODE, FAILED, READY
from tpupod.ops import defaults
from tpupod.ops.free_tpu import free_tpu_script
from tpupod.ops.sync import shell_path, sync_local
from tpupod.pod import users as podusers
from tpupod.pod.names import new_launch_id
from tpupod.pod.record import Pod, Worker
from tpupod.pod.spec import GcpPodSpec
from tpupod.providers import Connector
from tpupod.transport import OutputLine, RemoteProcess

# What runtimes print for themselves at every start: kept in the per-worker logs, but off the
# terminal (unless asked for) and out of the summary's last lines.

PREFLIGHT_TIMEOUT_S = 30.0
RENDEZVOUS_START_S = 30.0
ROOM_CHECK_S = 1.0  # how often a run's logs look whether their disk is full
CLOSE_GRACE_S = 1.0  # a service on worker 0 still serving a worker that hangs up late

# Is the port taken on the worker? (bash's /dev/tcp: no nc or ss needed.)
PORT_CHECK = (
    "if (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; then echo busy; else echo free; fi"
)


@dataclass(frozen=True)
class Launch:
    launch_id: str
    run_dir: Path
    coordinator: str
    rendezvous: str


@dataclass(frozen=True)
class RunResult:
    launch: Launch
    fanout: FanoutResult


class Chatter:
    """Takes one worker's chatter out of its lines: gloo's "[Gloo] Rank N is connected to M
    peer ranks. Expected number of connected peer ranks is : M", and the line a worker told
    to stop leaves (the summary already says why it stopped).

    gloo writes that message in pieces (text, numbers, the newline), from several threads,
    to the stdout the program prints to, so other output lands between any two pieces:
    "[Gloo] Rank [Gloo] Rank 0 is connected ...", "[Gloo] Rank worker 1 of 2: ..." then
    "1 is connected ...", "... is : 1[Gloo] Rank 1 is ... : 1" then an empty line, or a
    count left alone on the next line. So each text piece is cut out wherever it lands;
    what is left is shown, unless it is only the numbers of cut-up messages; and while
    messages have begun that have not ended, a line of nothing but digits is their end.
    Called with a line, returns what to show of it, or None.
    """

    PIECES = re.compile(
        r"\[Gloo\] Rank \d*|\d* is connected to \d*| peer ranks\. "
        r"|Expected number of connected peer ranks is : \d*"
    )
    BEGUN = "[Gloo] Rank "
    OWN = ("[Gloo] Rank ", " peer ranks. ", "connected peer ranks is : ")  # gloo's alone

    def __init__(self) -> None:
        self.owed = 0  # newlines still to come from messages that began on an earlier line

    def __call__(self, text: str) -> str | None:
        if text.startswith(LEAVING):
            return None
        if not any(piece in text for piece in self.OWN):
            if self.owed and (not text.strip() or text.strip().isdigit()):
                self.owed -= 1
                return None
            return text
        rest = self.PIECES.sub("", text)
        chatter_only = not rest.strip() or rest.replace(" ", "").isdigit()
        # Each message begun here, and the program's own text, brings a newline; the line
        # ended on one of them.
        self.owed = max(0, self.owed + text.count(self.BEGUN) + (not chatter_only) - 1)
        return None if chatter_only else rest


class TailCleaner(Chatter):
    """What a worker's summary row may show as its last line: not chatter, not what it
    printed after another worker failed (``collateral``, see ``_RunLog.tee``), and not one
    of tpupod's own marker lines (``tpupod-progress {...}`` from ``podprogress``,
    ``tpupod-bench-results ...``), which the launcher's views read out of the output: every
    such marker starts with ``tpupod-NAME ``. The terminal still gets markers (a live view
    takes them out there)."""

    OWN_MARKER = re.compile(r"\x1e?tpupod-[a-z]+(?:-[a-z]+)* ")

    def __init__(self, collateral: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self.collateral = collateral

    def __call__(self, text: str) -> str | None:
        if self.collateral() or self.OWN_MARKER.match(text):
            return None
        return super().__call__(text)


async def run(
    ctx: Context,
    command: str,
    *,
    workers: Sequence[Worker] | None = None,
    env: dict[str, str] | None = None,
    policy: Policy = Policy(OnFail.KILL),
    coordinator_port: int | None = None,
    sync_dir: str | None = None,
    repo: Path | None = None,
    rendezvous_on: str = "auto",
    worker_python: str | None = None,
    show_chatter: bool = False,
    collateral_in_logs_only: bool = False,
    container: Container | None = None,
    on_launch: Callable[[Launch], None] | None = None,
    hang_timeout: float | None = None,
    shown: str | None = None,
    unlogged: Callable[[str], bool] | None = None,
) -> RunResult:
    """Launch ``command`` on the context's pod (its selected ``workers``) in lockstep and
    supervise it to the end; output to the context's sinks, over its connections.

    With ``container``, it runs in that image on every worker (``image/containerize.py``):
    the image is checked the same everywhere first, and no container outlives the run.
    With ``collateral_in_logs_only`` (a terminal's view, not a job's log), what the others
    print after the first failure reaches the logs only (``_RunLog.collateral``).
    ``on_launch`` is told the launch once its id exists, before the workers start.
    Each worker's progress (heartbeats, else lines) goes to the run's ``progress.json``;
    with ``hang_timeout``, a run where none progresses that long is stopped as hung
    (``tpupod.hang``). ``shown``: what the run's record shows as its command, where that is
    not ``command`` itself (a job runner's wrapper: the job's own command); ``unlogged``:
    the lines the caller reads that are no output of the program (a job's markers), kept
    out of the logs.
    """
    pod, state, connector = ctx.pod, ctx.state, ctx.connector
    on_line, notice, interrupt = ctx.sinks.on_line, ctx.sinks.on_notice, ctx.sinks.interrupt
    selected = list(workers) if workers is not None else list(pod.workers)
    # A run's identity is the selected workers, renumbered 0..N-1 in order (slices too).
    sub_pod = pod.subset(selected)
    port = coordinator_port or _coordinator_port(pod)
    await _checks(pod, connector, selected, sub_pod, port=port, container=container)
    workdir, env = await _workdir(ctx, selected, sync_dir, repo, env)
    launch_id = new_launch_id()
    given = shown or command  # what the run's record and 'logs --list' show: the user's
    command = _in_workdir(command, workdir, container, launch_id)
    token = secrets.token_hex(16)
    # Workers report their own failures to the rendezvous before JAX's shutdown can hold
    # them; the fan-out counts them at once and has the rendezvous stop the others.
    supervision = Supervision()
    server = _rendezvous(
        pod,
        rendezvous_on,
        connector,
        selected[0],
        supervision=supervision,
        notice=notice,
        python=worker_python or pod.worker_python(),
        workdir=workdir,
    )
    launch = Launch(
        launch_id=launch_id,
        run_dir=state.pod_dir(pod.name) / RUNS_DIR / launch_id,
        coordinator=f"{selected[0].internal_address}:{port}",
        rendezvous=await server.start(launch_id, token, len(selected)),
    )
    run_env = {
        **(env or {}),
        "TPUPOD_LAUNCH_ID": launch_id,
        "TPUPOD_RENDEZVOUS": launch.rendezvous,
        "TPUPOD_RENDEZVOUS_TOKEN": token,
        "TPUPOD_COORDINATOR": launch.coordinator,
    }
    workers_said = f"{len(selected)} worker{'s' if len(selected) != 1 else ''}"
    notice(f"launch {launch_id}: {workers_said}, logs in {launch.run_dir}")
    if on_launch is not None:
        on_launch(launch)
    run_connector = _Renumbered(connector, selected) if sub_pod is not pod else connector
    # Once one fails and the others are stopped, their fall stays in the logs.
    collateral = collateral_in_logs_only and OnFail(policy.on_fail) is OnFail.KILL
    log_to = _RunLog(
        launch, given, selected, supervision if collateral else None, notice, unlogged=unlogged
    )
    log_to.record["job"] = _job_of(env or {})
    # 'tpupod down' refuses to take the pod from under a run (with --force: stops it)
    # (down --force writes who it is to the stop-request file first, as a cancel does)
    stop_request = launch.run_dir / STOP_FILE
    using = podusers.using(state, pod.name, f"tpupod run {launch_id}", request=stop_request)
    # a stop from 'tpupod cancel' or the dashboard names its sender before its SIGINT (one
    # the caller can tell, as a run with --retries its own cancel, when none did)
    told = interrupt.who
    interrupt.who = lambda: _read_text(stop_request) or (told() if told else None)
    progress = Progress([w.id for w in sub_pod.workers])
    watchdog = _watchdog(hang_timeout, progress, sub_pod, launch, run_connector, ctx.sinks, log_to)
    with log_to as log, using:
        watching = asyncio.create_task(watchdog.watch()) if watchdog is not None else None
        try:
            tee = log.tee(on_line, show_chatter=show_chatter, progress=progress)
            sinks = Sinks(tee, notice, interrupt)
            result = await run_on(
                Context(sub_pod, sinks, connector=run_connector, state=state),
                command,
                env=run_env,
                policy=policy,
                guard=True,  # a supervised program never outlives its launcher
                supervision=supervision,
                chatter=lambda worker: TailCleaner(lambda: log.collateral(worker.id)),
                worker_env=worker_megascale(sub_pod, *_local_port(sub_pod)),
            )
        finally:
            if watching is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
            await server.close()
            if container is not None:
                await remove_containers(
                    sub_pod, run_connector, sub_pod.workers, container.engine, launch_id
                )
        _hang_ending(result, watchdog, log.record)
        progress.save(launch.run_dir, force=True)  # each worker's last progress, kept
        log.finish(result)
        if log.held:
            notice(log.held_note())
    return RunResult(launch, explain(result) if container is not None else result)


async def _checks(
    pod: Pod,
    connector: Connector,
    selected: list[Worker],
    sub_pod: Pod,
    *,
    port: int,
    container: Container | None,
) -> None:
    """The preflight, the GCP multislice variables and the image, at once (the image's
    fan-out then costs no launch time); the first to fail raises."""
    checks: list[Awaitable[object]] = [
        _preflight(pod, connector, selected, port),
        check_tpu_env(pod, selected, sub_pod, connector),
    ]
    if container is not None:
        checks.append(check_workers(pod, connector, selected, container))
    for outcome in await asyncio.gather(*checks, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


async def _workdir(
    ctx: Context,
    selected: list[Worker],
    sync_dir: str | None,
    repo: Path | None,
    env: dict[str, str] | None,
) -> tuple[str, dict[str, str] | None]:
    """Where the program starts (a shell word, or ""), and its environment: with
    ``sync_dir``, this repository's HEAD shipped there first (the commit in the
    environment); on a local pod, where the launcher stands."""
    pod = ctx.pod
    if sync_dir is not None:
        commit = await _sync(
            pod,
            connector=ctx.connector,
            workers=selected,
            repo=repo or Path.cwd(),
            directory=sync_dir,
            notice=ctx.sinks.on_notice,
        )
        return shell_path(sync_dir), {**(env or {}), "TPUPOD_CODE_COMMIT": commit}
    if pod.on_this_machine:
        # Local workers share this machine's files: start where the launcher stands, so
        # `tpupod run -- python examples/x.py` means what it says.
        return shlex.quote(os.getcwd()), env
    return "", env


def _job_of(env: dict[str, str]) -> dict[str, int] | None:
    """The job a job runner launched this run for (its environment names it), for the
    record: the dashboard links a job to its runs."""
    try:
        return {"id": int(env["TPUPOD_JOB_ID"]), "attempt": int(env["TPUPOD_JOB_ATTEMPT"])}
    except (KeyError, ValueError):
        return None


def _in_workdir(command: str, workdir: str, container: Container | None, launch_id: str) -> str:
    """The command started in ``workdir`` (a shell word, or ""), in the container if any
    (the directory mounted there too, as it is where the program expects its files)."""
    if container is None:
        return f"cd {workdir} && {command}" if workdir else command
    mounted = dataclasses.replace(container, workdir_mounted=bool(workdir))
    wrapped = wrap(command, mounted, launch_id)
    return f"cd {workdir} && {{\n{wrapped}\n}}" if workdir else wrapped


def _rendezvous(
    pod: Pod,
    where: str,
    connector: Connector,
    first: Worker,
    *,
    supervision: Supervision,
    notice: NoticeHandler,
    python: str,
    workdir: str,
) -> _Rendezvous:
    """The launch's rendezvous (``--rendezvous-on``), wired to the fan-out's supervision;
    on worker 0, run by ``python`` in ``workdir`` (the program's: a relative python is
    from there)."""
    server: _Rendezvous
    if _on_worker0(pod, where):
        server = _Worker0Rendezvous(
            connector, first, notice, supervision.report_failure, python=python, workdir=workdir
        )
    else:
        server = _LauncherRendezvous(connector, first, notice, supervision.report_failure)
    supervision.on_stopping = server.stop
    return server


def _on_worker0(pod: Pod, where: str) -> bool:
    """Where the rendezvous runs: on the launcher, unless the workers may not reach it
    (a Cloud TPU reached at its external addresses: the launcher is probably behind NAT)."""
    if where == "auto":
        spec = pod.spec
        return isinstance(spec, GcpPodSpec) and not spec.internal
    if where not in ("launcher", "worker0"):
        raise TpupodError(f"--rendezvous-on {where!r}", hint="one of auto, launcher, worker0")
    return where == "worker0"


class _Rendezvous(Protocol):
    async def start(self, launch_id: str, token: str, count: int) -> str: ...

    def stop(self, reason: str) -> None:
        """Tell every worker still running to leave now."""
        ...

    async def close(self) -> None: ...


class _LauncherRendezvous:
    """The service in this process, at the address the workers already reach us at."""

    def __init__(
        self,
        connector: Connector,
        first: Worker,
        notice: NoticeHandler,
        on_failure: FailureHandler,
    ) -> None:
        self.connector, self.first, self.notice = connector, first, notice
        self.on_failure = on_failure
        self.server: RendezvousServer | None = None

    async def start(self, launch_id: str, token: str, count: int) -> str:
        self.server = RendezvousServer(
            launch_id, token, count, on_event=self.notice, on_failure=self.on_failure
        )
        host, port = await self.server.start(await self.connector.reachback(self.first))
        return f"{host}:{port}"

    def stop(self, reason: str) -> None:
        if self.server is not None:
            self.server.stop(reason)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()


class _Worker0Rendezvous:
    """The service as a process on worker 0 (``python -m tpupod.launch.rendezvous_main``)."""

    def __init__(
        self,
        connector: Connector,
        first: Worker,
        notice: NoticeHandler,
        on_failure: FailureHandler,
        *,
        python: str,
        workdir: str,
    ) -> None:
        self.transport = connector.transport(first)
        self.first, self.notice = first, notice
        self.python, self.workdir = python, workdir
        self.on_failure = on_failure
        self.proc: RemoteProcess | None = None
        self.relay: asyncio.Task[None] | None = None
        self.stopping: asyncio.Task[None] | None = None

    async def start(self, launch_id: str, token: str, count: int) -> str:
        command = (
            f"{shlex.quote(self.python)} -m tpupod.launch.rendezvous_main --launch-id {launch_id} "
            f"--count {count} --host {shlex.quote(self.first.internal_address)}"
        )
        if self.workdir:
            command = f"cd {self.workdir} && {command}"
        self.proc = await self.transport.start(
            command, {"TPUPOD_RENDEZVOUS_TOKEN": token}, guard=True
        )
        lines = self.proc.lines()
        ended = False  # the service ended without a word of READY (not only slow to start)
        try:
            async with asyncio.timeout(RENDEZVOUS_START_S):
                async for line in lines:
                    if line.text.startswith(READY):
                        self.relay = asyncio.create_task(self._relay(lines))
                        return line.text.split()[1]
                    self.notice(f"rendezvous on {self.first.label}: {line.text}")
                ended = True
        except TimeoutError:
            pass
        await self.close()
        failed = PreflightError(
            f"the rendezvous service did not start on {self.first.label} ({self.first.hostname})",
            hint=f"tpupod must be importable by {self.python} there ('--worker-python PATH'), "
            "or use --rendezvous-on launcher when the workers can reach this machine",
        )
        failed.lasting = ended  # its python cannot run it: every launch would end the same
        raise failed

    async def _relay(self, lines: AsyncIterator[OutputLine]) -> None:
        codes: dict[int, int] = {}  # worker -> the exit code it gave itself, before its failure
        async for line in lines:
            if line.text.startswith(EXIT_CODE):
                _, worker, code = line.text.split(" ", 2)
                codes[int(worker)] = int(code)
            elif line.text.startswith(FAILED):
                _, worker, reason = line.text.split(" ", 2)
                self.on_failure(int(worker), json.loads(reason), codes.pop(int(worker), None))
            else:
                self.notice(f"rendezvous on {self.first.label}: {line.text}")

    def stop(self, reason: str) -> None:
        """Ending the service closes every worker's connection, and a worker leaves on that.
        KILL: a TERM would let it serve on until the workers leave (``rendezvous_main``)."""
        if self.stopping is None and self.proc is not None:
            self.stopping = asyncio.create_task(self.proc.kill(0.0))

    async def close(self) -> None:
        """The run is over: TERM ends a service with nobody connected at once."""
        if self.relay is not None:
            self.relay.cancel()
        if self.stopping is not None:
            await self.stopping
        if self.proc is not None:
            await self.proc.kill(CLOSE_GRACE_S)
            self.proc.close()


def _coordinator_port(pod: Pod) -> int:
    """Local pods share this machine: take a free port. Real hosts: the TPU firewall's port."""
    return _free_port() if pod.on_this_machine else DEFAULT_COORDINATOR_PORT


def _local_port(pod: Pod) -> tuple[int, ...]:
    """A free port on a local pod (its workers share this machine's ports); else none."""
    return (_free_port(),) if pod.on_this_machine else ()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _preflight(pod: Pod, connector: Connector, workers: Sequence[Worker], port: int) -> None:
    """Every worker answers; the coordinator port is free on worker 0; nothing holds a TPU."""
    devices = settings.accelerator_devices(defaults.ACCELERATOR_DEVICES)
    # Both at once: a second fan-out after the first cost a launch 10 to 40 ms.
    quiet = Context(pod, connector=connector)
    bounded = Policy(timeout=PREFLIGHT_TIMEOUT_S)
    probe, check = await asyncio.gather(
        run_on(
            quiet,
            free_tpu_script(devices=devices, dry_run=True),
            workers=workers,
            policy=bounded,
            guard=True,
        ),
        run_on(
            quiet, PORT_CHECK.format(port=port), workers=[workers[0]], policy=bounded, guard=True
        ),
    )
    down = [r for r in probe.workers if not r.ok]
    if down:
        reasons = "; ".join(
            f"{r.worker.label} ({r.worker.hostname}): {r.outcome_text()}: {r.last_line}"
            for r in down
        )
        raise PreflightError(
            f"{len(down)} worker(s) not ready: {reasons}",
            hint="'tpupod status' checks every worker",
            unreachable=tuple(r.worker.label for r in down if r.outcome is Outcome.UNREACHABLE),
        )
    busy = [r for r in probe.workers if any(line.startswith("holder:") for line in r.tail)]
    if busy:
        names = ", ".join(r.worker.label for r in busy)
        raise PreflightError(
            f"the accelerator is in use on {names}",
            hint="'tpupod free-tpu --dry-run' shows by whom; 'tpupod free-tpu' frees it",
        )
    if check.workers[0].last_line == "busy":
        raise PreflightError(
            f"port {port} (JAX's coordinator) is in use on {workers[0].label} "
            f"({workers[0].hostname})",
            hint="stop what holds it (an earlier run?), or pass --coordinator-port",
        )


async def _sync(
    pod: Pod,
    *,
    connector: Connector,
    workers: Sequence[Worker],
    repo: Path,
    directory: str,
    notice: NoticeHandler,
) -> str:
    """Ship the local HEAD to ``directory`` on every worker; all must end at that commit."""
    result = await sync_local(pod, repo, directory, workers=workers, connector=connector)
    if not result.ok:
        failed = [r for r in result.fanout.workers if not r.ok]
        detail = "; ".join(f"{r.worker.label}: {r.error or r.last_line}" for r in failed)
        odd = ", ".join(f"w{w}" for w in result.differing)
        raise PreflightError(
            f"sync to {directory} failed: {detail or f'{odd} not at {result.expected}'}",
            hint="'tpupod sync --from-local' shows each worker's output",
        )
    assert result.expected is not None
    notice(f"every worker at {result.expected[:12]} in {directory}")
    return result.expected


class _Renumbered:
    """A connector that maps a subset's worker ids back to the pod's workers."""

    def __init__(self, connector: Connector, selected: Sequence[Worker]) -> None:
        self._connector = connector
        self._selected = list(selected)

    def transport(self, worker: Worker) -> Any:
        return self._connector.transport(self._selected[worker.id])

    async def reachback(self, worker: Worker) -> str:
        return await self._connector.reachback(self._selected[worker.id])

    async def close(self) -> None:
        return None


class _RunLog:
    """Per-worker log files and the run's record (``run.json``), written as the run goes."""

    def __init__(
        self,
        launch: Launch,
        command: str,
        workers: Sequence[Worker],
        supervision: Supervision | None = None,
        notice: Callable[[str], None] = lambda text: None,
        *,
        unlogged: Callable[[str], bool] | None = None,
    ) -> None:
        self.launch = launch
        self.supervision = supervision  # to keep collateral output off the terminal
        self.notice = notice
        self.held: dict[int, int] = {}  # collateral lines kept off it, per worker
        self.hung = False  # the hang watchdog stopped the run: what follows is collateral
        self.cut: str | None = None  # why the logs stopped being written (a full disk)
        self.room_checked = float("-inf")  # when _check_room last looked
        self.full_said = False  # _check_room said the disk is full
        self.unlogged = unlogged or (lambda text: False)  # lines kept out of the logs
        self.record: dict[str, Any] = {
            "launch_id": launch.launch_id,
            "command": command,
            "workers": [_worker_entry(i, w) for i, w in enumerate(workers)],
            "coordinator": launch.coordinator,
            "started": time.time(),
            "finished": None,
            "launcher_pid": os.getpid(),
        }
        self.files: dict[int, IO[str]] = {}
        self.lock: IO[bytes] | None = None

    def __enter__(self) -> _RunLog:
        """The logs and the record opened; a run that could not keep them does not start."""
        try:
            self.launch.run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = (self.launch.run_dir / LAUNCHER_LOCK).open("wb")  # not inherited
            fcntl.flock(self.lock, fcntl.LOCK_EX)
            for worker in self.record["workers"]:
                path = self.launch.run_dir / f"w{worker['id']}.log"
                self.files[worker["id"]] = path.open("a", encoding="utf-8")
            self._save()
        except OSError as exc:
            self.__exit__()
            remove_path(self.launch.run_dir)
            raise StateError(
                f"cannot keep the run's logs in {self.launch.run_dir}: {exc.strerror}",
                hint=DISK_FULL_HINT
                if exc.errno in DISK_FULL
                else "check that TPUPOD_HOME is writable",
            ) from exc
        return self

    def __exit__(self, *exc: object) -> None:
        for file in self.files.values():
            with contextlib.suppress(OSError):  # what a full disk left in its buffer
                file.close()
        if self.lock is not None:
            self.lock.close()  # after finish() wrote the end: the lock's release says "ended"

    def collateral(self, worker: int) -> bool:
        """Whether ``worker``'s lines from now on are collateral: another worker failed by
        itself (its own report, or its exit, learned before the others can see it gone), so
        what this one prints now is the others' fall (gloo's "Connection closed" tracebacks
        as their peer vanishes, their stop), which would bury the real error."""
        if self.supervision is None:
            return False
        if self.hung:  # the watchdog stopped them: what they print now is their fall
            return True
        first = self.supervision.first_failed
        return first is not None and first != worker

    def held_note(self) -> str:
        """What the terminal did not show, and where it is."""
        assert self.supervision is not None
        count = sum(self.held.values())
        names = worker_list(sorted(self.held))
        when = "the run was found hung" if self.hung else f"w{self.supervision.first_failed} failed"
        held, run = sorted(self.held), self.launch.launch_id
        if len(held) <= 2:  # each worker's log (a trial: the hint named w0's alone)
            where = ", ".join(f"'tpupod logs {run} -w {w}'" for w in held)
        else:
            where = f"'tpupod logs {run} -w N' for each of {names}"
        return (
            f"{names} printed {count} more line{'s' if count != 1 else ''} after "
            f"{when}, kept in the logs: {where}"
        )

    def tee(
        self, on_line: LineHandler | None, *, show_chatter: bool, progress: Progress | None = None
    ) -> LineHandler:
        """Every line to the worker's log; to ``on_line`` too, but chatter only if asked,
        and collateral lines never (they are counted). Every line is ``progress`` too; a
        heartbeat marker is only that (kept in ``progress.json``, not in the log)."""
        hide = {worker: Chatter() for worker in self.files}

        def handle(worker: Worker, line: OutputLine) -> None:
            # the stop's own lines (the worker's "stopping", what follows a hang) are no progress
            if progress is not None and not self.hung and not line.text.startswith(LEAVING):
                left = progress.seen(worker.id, line.text)
                if left != line.text:  # a heartbeat's marker: kept out, the rest goes on
                    with contextlib.suppress(OSError):
                        progress.save(self.launch.run_dir)
                    if left is None:
                        return
                    line = OutputLine(line.stream, left)
            if self.cut is None and not self.unlogged(line.text):
                try:
                    self._check_room()
                    file = self.files[worker.id]
                    file.write(line.text + "\n")
                    file.flush()
                except OSError as exc:
                    self._stop_keeping(exc)
            if on_line is None:
                return
            shown = line.text if show_chatter else hide[worker.id](line.text)
            if shown is None:
                return
            if self.collateral(worker.id):  # counted only if it would have been shown
                self.held[worker.id] = self.held.get(worker.id, 0) + 1
                return
            on_line(worker, line if shown == line.text else OutputLine(line.stream, shown))

        return handle

    def _check_room(self) -> None:
        """At most once a ROOM_CHECK_S: a disk with no free block is full now, though the
        logs' last pages still take ~100 short lines each (a disk that filled was said
        10-20 s late, when they ran out)."""
        now = time.monotonic()
        if now - self.room_checked < ROOM_CHECK_S:
            return
        self.room_checked = now
        if not self.full_said and os.statvfs(self.launch.run_dir).f_bavail == 0:
            self.full_said = True  # said, not cut: what still fits is written
            self.notice(
                f"the disk of {self.launch.run_dir} is full: cannot write the run's logs "
                "there once their last pages are used; the run goes on"
            )

    def _stop_keeping(self, exc: OSError) -> None:
        """A log write failed (a full disk): the run goes on, its output still shown; the
        logs stop here, and the record says why (if it can still be written)."""
        self.cut = exc.strerror or str(exc)
        self.record["logs_cut"] = self.cut
        self.notice(
            f"cannot write the run's logs in {self.launch.run_dir} ({self.cut}): the run "
            "goes on and its output is still shown here, but from now on not kept"
        )

    def finish(self, result: FanoutResult) -> None:
        """The run's end in its record; a record that cannot be written is said, not raised
        (the run is over: its result still reaches the caller)."""
        self.record["finished"] = time.time()
        self.record["exit_code"] = result.exit_code()
        self.record["results"] = [
            {"worker": r.worker.id, "outcome": r.outcome_text(), "last_line": r.last_line}
            for r in result.workers
        ]
        # how it ended, typed, as the summary says it: who failed first (in time, not
        # worker order), or who stopped it (a stop's request names its sender), or its timeout
        by = _read_text(self.launch.run_dir / STOP_FILE)
        self.record["ending"] = result.ending(stopped_by=by).to_json()
        try:
            self._save()
        except OSError as exc:
            self.notice(
                f"cannot write the run's end to {self.launch.run_dir / RUN_FILE} "
                f"({exc.strerror}): 'tpupod logs' will call its launcher gone"
            )

    def _save(self) -> None:
        write_atomic(self.launch.run_dir / RUN_FILE, json.dumps(self.record, indent=2) + "\n")


async def _take_stacks(
    pod: Pod, launch: Launch, connector: Connector, progress: Progress
) -> Stacks:
    """The watchdog's stacks: every worker's, digested (groups that tie in size ordered by
    each worker's progress), saved in the run's folder."""
    found, _ = await take_stacks(pod, launch.launch_id, pod.workers, connector=connector)
    lines = digest_lines(found, progress.rank)
    saved = save_stacks(launch.run_dir, found, lines)
    hints = [f"hint: {h}" for h in stack_hints(found)]
    odd = odd_workers(found, progress.rank)
    ended = [w.worker.id for w in found if w.hint == GONE_HINT]
    running = [w.worker.id for w in found if w.worker.id not in ended]
    if odd:
        said = f"not where the others are: {worker_list(odd)}"
    elif ended and running:
        said = f"still running while the others ended: {worker_list(running)}"
        odd = running
    else:
        said = ""
    return Stacks([*lines, *hints], saved, odd, said)


def _watchdog(  # noqa: PLR0917 (each is the run's own)
    timeout: float | None,
    progress: Progress,
    pod: Pod,
    launch: Launch,
    connector: Connector,
    sinks: Sinks,
    log: _RunLog,
) -> Watchdog | None:
    """The run's hang watchdog (``--hang-timeout``), stopping it through its interrupt; what
    the workers print from then on is their fall, kept in the logs only."""
    if timeout is None:
        return None
    interrupt = sinks.interrupt
    sinks.on_notice(f"hang watchdog: no progress for {format_seconds(timeout)} stops the run")

    def stop(why: str) -> None:
        log.hung = True
        interrupt.request(signal.SIGTERM, reason=why)

    return Watchdog(
        progress,
        timeout,
        take=lambda: _take_stacks(pod, launch, connector, progress),
        stop=stop,
        notice=sinks.on_notice,
    )


def _hang_ending(result: FanoutResult, watchdog: Watchdog | None, record: dict[str, Any]) -> None:
    """A run the watchdog stopped ended hung: the result says so, and the record keeps why,
    the digest, where the dump is and the odd workers."""
    if watchdog is None or watchdog.why is None:
        return
    result.hung = watchdog.why
    found = watchdog.stacks
    record["hung"] = {
        "why": watchdog.why,
        "digest": found.digest if found else [],
        "stacks": str(found.saved) if found and found.saved else None,
        "odd": found.odd if found else [],
    }


def _worker_entry(run_id: int, worker: Worker) -> dict[str, Any]:
    """A worker in the run's record: its id in the run and in the pod, its host, its slice
    in the pod (if any)."""
    entry: dict[str, Any] = {"id": run_id, "hostname": worker.hostname, "pod_id": worker.id}
    return entry if worker.slice is None else {**entry, "slice": worker.slice}


def _read_text(path: Path) -> str | None:
    """A small file's text, stripped; None when it is missing, unreadable or empty."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
