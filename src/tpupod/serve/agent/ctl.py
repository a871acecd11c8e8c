"""``python -m tpupod.serve.agent.ctl``: the worker side of ``tpupod serve``, run through
the transport.

The launcher never talks to an agent over the network: it runs this module on
the worker (a local subprocess, or an SSH command), which reads the worker's
state folder and answers with one JSON line. So the same code works where
the launcher cannot reach the worker's internal address (a laptop driving a
cloud pod), and tokens never leave the worker.

Services (``agent``, ``router``) run detached: a new session (``setsid``),
stdin from /dev/null, output to a log file, so they outlive the SSH session
that started them (the transports' orphan guard is not used for them). Each
records ``NAME.json`` (pid, host, port) once it listens, and reads its bearer
token from ``NAME.token`` (mode 0600), both in the state folder::

    .tpupod/serve/agent.json agent.token agent.log servers.json logs/NAME.log
    .tpupod/serve/router.json router.token router.log

The router is the builtin one (``tpupod.serve.router``) or sgl-router
(``tpupod.serve.router.sgl`` records ``kind: sgl`` in router.json); ``view`` asks
either for its backends; ``running`` says what of a fleet runs, whether or not a fleet
record knows it (a service being started included: ``services.spawned``).
``preflight`` is ``serve up``'s look before it starts anything: whether the backend can
serve the model here, and which process (from /proc) holds a port the fleet would bind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpupod import settings
from tpupod.base import procfs
from tpupod.errors import UsageError
from tpupod.extras import missing
from tpupod.serve import services
from tpupod.serve.agent import respawn
from tpupod.serve.services import STATE_DIR, read_info, token

READY_TIMEOUT_S = 30.0
NOTICE_EVERY_S = 30.0  # wait-ready says which servers still start, and their last answer
STOP_GRACE_S = 8.0
SERVICES = ("agent", "router")
LISTEN = "0A"  # a socket's state in /proc/net/tcp
SHOWN_CHARS = 80  # of a port holder's command line
# the builtin router serves on the listening socket its respawn parent holds (--listen):
# sgl-router binds its own
BUILTIN_ROUTER = "tpupod.serve.router"


DOWN = "no {service} runs here"  # nothing runs the service, nothing starts it again


def keeper(state: Path, service: str) -> int | None:
    """The pid of the service's live ``respawn`` parent (the router has one), or None (a
    pid on file that is now another process's is not it)."""
    try:
        pid = int(respawn.keeper_path(state, service).read_text())
    except (OSError, ValueError):
        return None
    return pid if procfs.alive(pid) and respawn.__name__ in procfs.cmdline(pid) else None


def ensure(
    state: Path, service: str, argv: list[str], timeout: float, again: bool = False
) -> dict[str, Any]:
    """Start the service detached unless it runs; its record once it listens. Both run
    under ``respawn``, which starts them again when they die: the builtin router on the
    socket respawn holds, the agent on its port (it takes over the servers the one before
    left).
    ``again``: the fleet's router was lost (its parent too), and this start is one more
    restart of it, its request counts kept; else its restarts and counts begin at 0."""
    running = read_info(state, service) or unrecorded(state, service)
    if running is None and (parent := keeper(state, service)) is not None:
        running = _wait_record(state, service, parent, timeout)  # it is being started again
        if running is None:  # another parent would only fight this one for the port
            return _not_started(state, service, f"is being started again (pid {parent})")
    if running is not None:
        return {**running, "started_now": False}
    state.mkdir(parents=True, exist_ok=True)
    # the servers an agent killed hard left are taken over by the new agent (server.py)
    keeping = ["-m", "tpupod.serve.agent.respawn", "--state-dir", str(state)]
    keeping += ["--listen"] if argv[1:3] == ["-m", BUILTIN_ROUTER] else []
    argv = [sys.executable, *keeping, service, "--", *argv]
    services.count_restarts(state, service, services.restarts(state, service) + 1 if again else 0)
    if service == "router" and not again:  # a new fleet's router: its counts begin at 0
        services.counts_path(state).unlink(missing_ok=True)
    with open(state / f"{service}.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_noted_session(state, service),  # noqa: PLW1509 (ctl has one thread)
            close_fds=True,
        )
    info = _wait_record(state, service, proc.pid, timeout, proc)
    if info is not None:
        return {**info, "started_now": True}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a respawn parent and its service with it
    return _not_started(state, service, f"did not start (exit {proc.poll()})")


def _noted_session(state: Path, service: str) -> Callable[[], None]:
    """What the started process does before it runs the service: note itself
    (``services.spawned``), then leave this call's session (setsid: no SIGHUP when the SSH
    session ends). In that order, so that a stop finds it even where this call is killed
    the moment after the fork (a cancelled ``serve up``): while it is still in this call's
    process group, the kill of the group ends it too."""

    def note_then_setsid() -> None:
        services.note_spawned(state, service)
        os.setsid()

    return note_then_setsid


def _not_started(state: Path, service: str, why: str) -> dict[str, Any]:
    lines = (state / f"{service}.log").read_text(errors="replace").splitlines()[-5:]
    return {"error": f"the {service} {why}", "log": lines}


def _wait_record(
    state: Path,
    service: str,
    pid: int,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
) -> dict[str, Any] | None:
    """The service's record once the process ``pid`` (or a child of it: the service under
    its respawn parent) has written it; None past ``timeout`` or once ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = read_info(state, service)
        if info is not None and pid in (info["pid"], info.get("parent")):
            return info
        if (proc is not None and proc.poll() is not None) or not procfs.alive(pid):
            break
        time.sleep(0.05)
    return None


def stop(state: Path, service: str, grace: float) -> dict[str, Any]:
    """TERM the service (its respawn parent, which passes it on), KILL it after ``grace`` s;
    KILL one started that has not recorded itself yet; then KILL any server group it left."""
    info = read_info(state, service)
    parent = keeper(state, service)
    stopped = killed = False
    pid = parent if parent is not None else None if info is None else info["pid"]
    st = procfs.stat(parent) if parent is not None else None
    group = parent if st is not None and st.pgrp == parent else None  # the keeper leads one
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while procfs.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if procfs.alive(pid):
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if group is not None:  # the keeper waits as long as this for its service:
                # killed first, it left the service running (its group; the agent's servers
                # have their own)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
        if info is not None and procfs.alive(info["pid"]):  # its parent was killed first
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(info["pid"], signal.SIGKILL)
        stopped = True
    stopped = _kill_unrecorded(state, service) or stopped
    left = _kill_recorded_groups(state) if service == "agent" else 0
    paths = [state / f"{service}.json", respawn.keeper_path(state, service)]
    if service == "agent":  # stopped: no agent after it is to take these servers over
        paths.append(state / "servers.json")
    for path in (*paths, services.spawned_path(state, service)):
        with contextlib.suppress(OSError):
            path.unlink()
    # killed: it did not stop within ``grace`` (a frozen agent: kill -STOP), which is said
    return {"stopped": stopped, "killed": killed, "grace": grace, "groups_killed": left}


def _kill_unrecorded(state: Path, service: str) -> bool:
    """KILL the session of a process ``ensure`` started that has not recorded itself (an
    agent importing, the ensure that waited for it cancelled): nothing was handed to it
    yet, and its record may come after this stop looked. False when none runs."""
    pid = services.spawned(state, service)
    if pid is None:
        return False
    for kill in (os.killpg, os.kill):  # its group once it left ensure's (setsid), and it
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_GRACE_S
    while procfs.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def _kill_recorded_groups(state: Path) -> int:
    """Server groups an agent that died hard (kill -9) could not stop."""
    killed = 0
    for pgid in _live_recorded_groups(state):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            killed += 1
    return killed


def _live_recorded_groups(state: Path) -> list[int]:
    """The server groups on file (``servers.json``) with a live member."""
    try:
        groups = json.loads((state / "servers.json").read_text()).get("groups", [])
    except (OSError, ValueError):
        return []
    live = {st.pgrp for p in procfs.pids() if (st := procfs.stat(p)) and st.alive}
    return [g for g in groups if g in live]


def running(state: Path) -> dict[str, Any]:
    """What of a fleet runs here, whatever any fleet record says: each service's pid,
    whether it answers (has recorded itself), the agent's server count; and the server
    groups on file that run with no agent (one killed hard)."""
    found = []
    for service in SERVICES:
        info = read_info(state, service)
        parent = keeper(state, service)
        pid = info["pid"] if info else _kept(parent) or services.spawned(state, service)
        if pid is None:
            continue
        entry: dict[str, Any] = {"service": service, "pid": pid, "answers": info is not None}
        if service == "agent" and info is not None:
            answer = call(state, service, "GET", "/admin/status", None)
            if answer.get("status") == 200:
                entry["servers"] = len(answer["body"]["servers"])
        found.append(entry)
    agent = any(entry["service"] == "agent" for entry in found)
    return {"running": found, "orphans": [] if agent else _live_recorded_groups(state)}


def _kept(parent: int | None) -> int | None:
    """The service its keeper (``parent``, a session leader) runs, in the keeper's process
    group (the agent's servers have groups of their own); else the keeper itself (between
    two runs), or None without one."""
    if parent is None:
        return None
    for pid in procfs.pids():
        st = procfs.stat(pid)
        if st is not None and st.alive and st.pgrp == parent and pid != parent:
            return pid
    return parent


def call(state: Path, service: str, method: str, path: str, body: str | None) -> dict[str, Any]:
    """One request to the local service with its token; its status and JSON answer."""
    # the serve extra's: a call only, not every ctl command on the worker
    import httpx

    info = read_info(state, service)
    note: dict[str, str] = {}
    if info is None and (info := unrecorded(state, service)) is not None:
        note = {"record": unrecorded_why(state, service)}
    if info is None and keeper(state, service) is not None:
        why = f"the {service} ended and is being started again (its log: {service}.log)"
        return {"error": why, "status": None}
    if info is None:  # down: nothing runs it, nothing starts it again
        return {"error": DOWN.format(service=service), "status": None, "down": True}
    host = "127.0.0.1" if info["host"] in ("0.0.0.0", "") else info["host"]
    headers = {"Authorization": f"Bearer {token(state, service)}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        r = httpx.request(
            method,
            f"http://{host}:{info['port']}{path}",
            headers=headers,
            content=body,
            timeout=30.0,
        )
    except httpx.HTTPError as exc:
        return {"error": f"the {service} does not answer: {exc}", "status": None, **note}
    try:
        answer: Any = r.json()
    except ValueError:
        answer = r.text
    # no keeper: it runs, but nothing starts it again when it dies (its keeper was killed)
    return {"status": r.status_code, "body": answer, "kept": keeper(state, service) is not None,
            **note}  # fmt: skip


def unrecorded(state: Path, service: str) -> dict[str, Any] | None:
    """The record of a service whose keeper hands each run the same listening socket
    (``--listen``) and runs a new one that has not recorded itself (a full disk: its
    record waits for room): the last run's record, with the pid of the run that serves on
    its port now. None where that is not so (a run being started on a port of its own)."""
    parent = keeper(state, service)
    if parent is None:
        return None
    argv = procfs.cmdline(parent)
    if "--listen" not in argv[: argv.index("--") if "--" in argv else len(argv)]:
        return None
    if (child := _kept(parent)) in (None, parent):  # between two runs
        return None
    try:
        record = json.loads((state / f"{service}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("parent") != parent or "port" not in record:
        return None  # another keeper's run: not on this keeper's socket
    return {**record, "pid": child}


def unrecorded_why(state: Path, service: str) -> str:
    """Why the service that serves has no record of its own (``unrecorded``)."""
    with contextlib.suppress(OSError):
        if os.statvfs(state).f_bavail == 0:
            return (
                f"its record ({service}.json) could not be written: the disk under {state} is full"
            )
    return f"its record ({service}.json) is not written yet"


def restarts(state: Path, service: str) -> int:
    """The service's restarts: on file, or the number of the run its keeper runs now where
    that is more (the keeper writes its count once there is room: a full disk)."""
    counted = services.restarts(state, service)
    parent = keeper(state, service)
    child = _kept(parent)
    running = services.run_restart(child) if child is not None and child != parent else None
    return max(counted, running or 0)


def view(state: Path) -> dict[str, Any]:
    """The router's view of its backends, as ``call`` answers: the builtin router's
    ``/backends``, or sgl-router's workers, health and circuits (``sglrouter.view``)."""
    info = read_info(state, "router")
    if info is not None and info.get("kind") == "sgl":
        # an sgl router's only
        from tpupod.serve.router.sgl import view as sgl_view

        answer = sgl_view(info, token(state, "router"))
    else:
        answer = call(state, "router", "GET", "/backends", None)
    return {**answer, "restarts": restarts(state, "router")}


def wait_ready(state: Path, timeout: float, poll: float = 0.3) -> int:
    """Print a JSON event as each server of the agent becomes ready; 0 once all are.

    A server that exits before it ever answered is failing (a wrong model path, a
    port in use, a bad command line): a restart would fail the same way, so this
    says so at once (``failing``, with its last log lines and exit) and returns 1,
    rather than waiting out restarts or ``timeout``.
    """
    deadline = time.monotonic() + timeout
    every = min(NOTICE_EVERY_S, max(1.0, timeout / 4))  # "still starting", and why
    notice = time.monotonic() + every
    seen: set[str] = set()
    missed = 0  # polls in a row without an agent: it was stopped (serve down, a Ctrl-C)
    while True:
        answer = call(state, "agent", "GET", "/admin/status", None)
        missed = missed + 1 if answer.get("status") is None else 0
        if missed >= 3:
            print(json.dumps({"event": "gone", "error": answer.get("error")}), flush=True)
            return 1
        servers = answer.get("body", {}).get("servers", []) if answer.get("status") == 200 else []
        for s in servers:
            if s["state"] == "ready" and s["name"] not in seen:
                seen.add(s["name"])
                print(json.dumps({"event": "ready", **s}), flush=True)
            elif s["name"] not in seen and (s["state"] == "backoff" or s["restarts"] > 0):
                print(json.dumps({"event": "failing", **s}), flush=True)
                return 1
        if answer.get("status") == 200 and len(seen) == len(servers):
            return 0
        pending = [s for s in servers if s["name"] not in seen]
        if time.monotonic() > deadline:
            print(json.dumps({"event": "timeout", "pending": pending}), flush=True)
            return 1
        if time.monotonic() > notice:
            for s in pending:
                waiting = {"event": "waiting", **{k: s.get(k) for k in ("ports", "answer")}}
                print(json.dumps(waiting), flush=True)
            notice += every
        time.sleep(poll)


def preflight(
    state: Path,
    host: str,
    *,
    backend: str,
    model: str,
    ports: list[int],
    fixed: list[tuple[str, int]],
    shifts: list[int],
    router: str | None = None,
) -> dict[str, Any]:
    """``serve up``'s checks on this worker before anything starts: whether the backend
    can serve ``model`` (``backends.check_model``), and whether the ports the fleet binds
    here are free: the servers' ``ports`` and the ``fixed`` ones (``(flag, port)``: the
    agent's, the router's). A port held by this worker's own fleet (its agent, router or
    servers, which ``serve up`` stops or keeps) is not in the way; ``groups`` lists that
    fleet's process groups, for a launcher whose workers share one host (a local pod: a
    port may be held by another worker's server). ``free_shifts``: the ``shifts`` that
    would move all the servers' ports to free ones (a --base-port to suggest). ``router``
    ``sgl``: this worker runs sgl-router, whose package must import here (``router``)."""
    # the preflight only (pydantic's models): not every ctl command
    from tpupod.serve.backends import Backend, check_model

    answer: dict[str, Any] = {"model": None, "taken": [], "free_shifts": [], "extra": None}
    for extra in ("serve", "model") if backend == Backend.BUILTIN.value else ("serve",):
        if absent := missing(extra):  # the agent and the servers would fail to start
            answer["extra"] = {"extra": extra, "modules": absent}
            return answer
    if router == "sgl":
        # worker 0's check only: sgl-router's package, as its start would import it
        from tpupod.serve.router.sgl import not_importable

        answer["router"] = not_importable()
    try:
        check_model(Backend(backend), model)
    except (UsageError, ValueError) as exc:
        answer["model"] = {"error": str(exc), "hint": getattr(exc, "hint", None)}
    ours = _own_groups(state)
    answer["groups"] = sorted(ours)
    for flag, port in [("--base-port", p) for p in ports] + fixed:
        if port_free(host, port):
            continue
        holders = [_holding(pid) for pid in listeners(port)]
        others = [h for h in holders if not {h["pid"], h["group"]} & ours]
        if holders and not others:
            continue
        answer["taken"].append({"port": port, "flag": flag, "holders": others})
    free = [s for s in shifts if all(port_free(host, p + s) for p in ports)]
    answer["free_shifts"] = free
    return answer


def _holding(pid: int) -> dict[str, Any]:
    st = procfs.stat(pid)
    return {"pid": pid, "group": st.pgrp if st else None, "text": holder(pid)}


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (as the servers do: SO_REUSEADDR, so
    a connection closing in TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listeners(port: int) -> list[int]:
    """The pids of the processes with a socket listening on ``port`` (any address)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    found = []
    for pid in procfs.pids():
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(_link(pid, fd) in inodes for fd in fds):
                found.append(pid)
    return found


def _listening_inodes(port: int) -> set[str]:
    wanted = f":{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1].endswith(wanted) and fields[3] == LISTEN:
                    inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


# a local pod's worker folder: STATE_DIR/pods/NAME/workers/wN (pod/state.py)
LOCAL_WORKER_DIR = re.compile(r"(.+)/pods/([^/]+)/workers/w\d+(?:/.*)?")


def holder(pid: int) -> str:
    """``pid 123 (python3 -m http.server 31000)``, with the pod it serves when tpupod
    started it on a pod's worker (its TPUPOD_POD), and on a local pod its state directory
    (the worker folder it runs in: one machine may hold same-named pods of several)."""
    argv = procfs.cmdline(pid)
    line = " ".join([os.path.basename(argv[0]), *argv[1:]]) if argv else "?"
    if len(line) > SHOWN_CHARS:
        line = line[: SHOWN_CHARS - 3] + "..."
    pods = [v for v in procfs.environ(pid) if v.startswith(b"TPUPOD_POD=")]
    pod = ""
    if pods:
        name = pods[0].decode(errors="replace").partition("=")[2]
        found = LOCAL_WORKER_DIR.fullmatch(procfs.cwd(pid))
        home = f" of {found.group(1)}" if found and found.group(2) == name else ""
        pod = f", pod {name!r}{home}"
    return f"pid {pid} ({line}{pod})"


def _own_groups(state: Path) -> set[int]:
    """The process groups of this worker's fleet: its agent's servers (recorded, even by
    an agent killed hard), the agent, the router and its respawn parent."""
    try:
        groups = set(json.loads((state / "servers.json").read_text()).get("groups", []))
    except (OSError, ValueError):
        groups = set()
    for service in SERVICES:
        if (info := read_info(state, service)) is not None:
            groups.add(info["pid"])
    if (parent := keeper(state, "router")) is not None:
        groups.add(parent)
    return groups


def _numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def _flag_port(text: str) -> tuple[str, int]:
    flag, _, port = text.rpartition("=")
    return flag, int(port)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tpupod.serve.agent.ctl")
    parser.add_argument("--state-dir", default=STATE_DIR)
    sub = parser.add_subparsers(dest="action", required=True)
    e = sub.add_parser("ensure", help="start a service detached unless it runs")
    e.add_argument("service", choices=SERVICES)
    e.add_argument("--timeout", type=float, default=READY_TIMEOUT_S)
    e.add_argument("--token-env", default=None, help="take the token from this variable")
    e.add_argument("--replace", action="store_true", help="stop a running one first")
    e.add_argument("--again", action="store_true", help="the fleet's lost router: count it")
    e.add_argument("argv", nargs=argparse.REMAINDER, help="-- the service's command line")
    s = sub.add_parser("stop", help="stop a service (TERM, then KILL)")
    s.add_argument("service", choices=SERVICES)
    s.add_argument("--grace", type=float, default=STOP_GRACE_S)
    c = sub.add_parser("call", help="one request to a local service")
    c.add_argument("service", choices=SERVICES)
    c.add_argument("method")
    c.add_argument("path")
    c.add_argument("--body", default=None)
    sub.add_parser("view", help="the router's view of its backends (either router)")
    sub.add_parser("running", help="what of a fleet runs here, recorded or not")
    p = sub.add_parser("preflight", help="serve up's checks: the model, the ports")
    p.add_argument("--host", required=True, help="the address the fleet binds here")
    p.add_argument("--backend", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--ports", default="", help="the servers' ports here: P,P,...")
    p.add_argument("--fixed", action="append", default=[], help="FLAG=PORT: another port")
    p.add_argument("--shifts", default="", help="S,S,...: moves of the servers' ports to try")
    p.add_argument("--router", default=None, help="sgl: sgl-router runs here")
    w = sub.add_parser("wait-ready", help="report servers as they become ready")
    w.add_argument("--timeout", type=float, default=600.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    state = Path(args.state_dir).expanduser().absolute()
    if args.action == "ensure":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        token(state, args.service, settings.named(args.token_env) if args.token_env else None)
        if args.replace:
            stop(state, args.service, STOP_GRACE_S)
        answer = ensure(state, args.service, command, args.timeout, args.again)
    elif args.action == "stop":
        answer = stop(state, args.service, args.grace)
    elif args.action == "call":
        answer = call(state, args.service, args.method, args.path, args.body)
    elif args.action == "view":
        answer = view(state)
    elif args.action == "running":
        answer = running(state)
    elif args.action == "preflight":
        fixed = [_flag_port(f) for f in args.fixed]
        answer = preflight(
            state, args.host, backend=args.backend, model=args.model,
            ports=_numbers(args.ports), fixed=fixed, shifts=_numbers(args.shifts),
            router=args.router,
        )  # fmt: skip
    else:
        return wait_ready(state, args.timeout)
    print(json.dumps(answer), flush=True)
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
