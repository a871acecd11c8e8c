"""Every worker's Python stacks at once: ``py-spy dump`` of a run's program on each worker.

One fan-out runs a small stdlib-only script on every worker (``python3 -c``: tpupod need
not be installed there), which finds the run's processes by their environment
(``TPUPOD_LAUNCH_ID`` and the worker's ``TPUPOD_WORKER_ID``, which ``tpupod run`` gives
every process it starts, inside ``--image`` containers too: the host sees a container's
processes and their environment) and dumps each Python one with py-spy (``--json``; all
threads; ``--native`` adds C/C++ frames). py-spy is looked for on ``PATH``, beside the
program's own interpreter (through ``/proc/PID/root``: a container's files, seen from the
host) and beside the script's. A worker where it cannot be done (no
py-spy, ptrace refused, the program gone) says why, on its own line; the others are shown.

Why py-spy: it reads any CPython process from outside (no cooperation from the program,
which may be stuck where no signal handler runs, e.g. inside a C call holding the GIL),
in tens of milliseconds, from a wheel on PyPI; faulthandler needs the program's help and
a running interpreter loop, and pystack needs gdb-like symbols. Measured in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import Outcome
from tpupod.pod.record import Pod, Worker
from tpupod.providers import Connector
from tpupod.transport import OutputLine

if TYPE_CHECKING:
    from tpupod.fanout.results import WorkerLike

MARKER = "tpupod-stacks "
TIMEOUT_S = 20.0
PY_SPY_HINT = (
    "install py-spy where the program runs: pip install py-spy (or 'tpupod[stacks]') in the "
    "workers' Python"
)
PTRACE_HINT = (
    "py-spy attaches with ptrace: run as the program's user or root, and in a container "
    "add CAP_SYS_PTRACE (podman run --cap-add SYS_PTRACE)"
)
GONE_HINT = "the run's program is not running there: 'tpupod logs' shows how it ended"
NOT_PY = "py-spy reads Python programs; for others, log in and use gdb or eu-stack"

# Runs on each worker: argv = launch id, worker id, native (0/1). Prints one marker line.
_SCRIPT = r"""
import json, os, shutil, subprocess, sys
launch, me, native = sys.argv[1].encode(), sys.argv[2].encode(), sys.argv[3] == "1"
def read(pid, what):
    try:
        with open("/proc/%s/%s" % (pid, what), "rb") as f:
            return f.read()
    except OSError:
        return b""
def parent(pid):
    stat = read(pid, "stat").decode(errors="replace")
    return stat.rsplit(")", 1)[-1].split()[1] if ")" in stat else "0"
found, others = {}, []
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    env = dict(v.split(b"=", 1) for v in read(pid, "environ").split(b"\0") if b"=" in v)
    if env.get(b"TPUPOD_LAUNCH_ID") != launch or env.get(b"TPUPOD_WORKER_ID") != me:
        continue
    argv = [a.decode(errors="replace") for a in read(pid, "cmdline").split(b"\0") if a]
    try:
        exe = os.readlink("/proc/%s/exe" % pid)
    except OSError:
        exe = argv[0] if argv else ""
    if not os.path.basename(exe).startswith("python") and not (
        argv and os.path.basename(argv[0]).startswith("python")):
        name = os.path.basename(exe) or "?"
        if name not in ("bash", "sh", "cat"):  # not tpupod's own wrapper and guard
            others.append("%s (pid %s)" % (name, pid))
        continue
    if any(a.startswith("tpupod.") for a in argv[1:3]):  # tpupod's own services
        continue
    found[pid] = argv
places = [shutil.which("py-spy")]
for pid, argv in found.items():  # beside the program's python, seen through its root
    if argv and "/" in argv[0]:  # (a container's files, from the host)
        try:
            where = os.path.join(os.readlink("/proc/%s/cwd" % pid), argv[0])
        except OSError:
            continue
        places.append("/proc/%s/root%s" % (pid, os.path.join(os.path.dirname(where), "py-spy")))
places += [os.path.join(os.path.dirname(sys.executable), "py-spy"),
           os.path.expanduser("~/.local/bin/py-spy")]
spy = next((p for p in places if p and os.access(p, os.X_OK)), None)
out = {"processes": [], "error": None, "others": others[:4]}
if not found:
    out["error"] = "not-python" if others else "gone"  # (a wrapper alone: it is ending)
elif spy is None:
    out["error"] = "no-py-spy"
for pid, argv in sorted(found.items(), key=lambda kv: int(kv[0])):
    entry = {"pid": int(pid), "parent": int(parent(pid)), "argv": argv[:8]}
    if spy is not None:
        cmd = [spy, "dump", "--pid", pid, "--json"] + (["--native"] if native else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
        except subprocess.TimeoutExpired:
            entry["error"] = "py-spy took more than 15 s"
        else:
            if done.returncode == 0:
                try:
                    entry["threads"] = json.loads(done.stdout)
                except ValueError:
                    entry["error"] = done.stdout.strip()[-300:]
            else:
                entry["error"] = (done.stderr or done.stdout).strip()[-300:]
    out["processes"].append(entry)
print("tpupod-stacks " + json.dumps(out), flush=True)
"""


LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3")


@dataclass(frozen=True)
class Frame:
    function: str
    file: str  # the file's short name, as py-spy gives it
    line: int
    library: bool = False  # in an installed package or the standard library, not the program

    def __str__(self) -> str:
        return f"{self.function} {self.file}:{self.line}"


@dataclass(frozen=True)
class Thread:
    name: str
    frames: tuple[Frame, ...]  # innermost first
    active: bool = False


@dataclass
class WorkerStacks:
    """One worker's answer: its program's processes and their threads, or why none."""

    worker: WorkerLike
    processes: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None
    hint: str | None = None

    @property
    def main(self) -> Thread | None:
        """The program's main thread: the first process (the one not started by another of
        them: a data loader's children come after) whose main thread py-spy read."""
        found = self._main()
        return found[1] if found else None

    def children(self) -> list[tuple[int, Thread]]:
        """(pid, main thread) of the program's other Python processes (a data loader's
        workers): where a parent waits on them, they are where it hangs."""
        found = self._main()
        out = []
        for process in self.processes:
            if found is None or process["pid"] != found[0]:
                main = _main_thread(threads_of(process))
                if main is not None:
                    out.append((int(process["pid"]), main))
        return out

    def _main(self) -> tuple[int, Thread] | None:
        pids = {p["pid"] for p in self.processes}
        roots = [p for p in self.processes if p["parent"] not in pids] or self.processes
        for process in roots + self.processes:
            main = _main_thread(threads_of(process))
            if main is not None:
                return int(process["pid"]), main
        return None


def _main_thread(threads: list[Thread]) -> Thread | None:
    return next((t for t in threads if t.name == "MainThread"), threads[0] if threads else None)


def threads_of(process: dict[str, Any]) -> list[Thread]:
    return [
        Thread(
            name=str(t.get("thread_name") or t.get("thread_id")),
            frames=tuple(
                Frame(
                    str(f["name"]),
                    str(f.get("short_filename") or f["filename"]),
                    int(f["line"]),
                    any(part in str(f["filename"]) for part in LIBRARY_PARTS),
                )
                for f in t.get("frames", [])
            ),
            active=bool(t.get("active")),
        )
        for t in process.get("threads", [])
    ]


def command(launch_id: str, native: bool) -> str:
    """The worker's command: the script above, for this run, on each worker for its own id
    (the fan-out gives it ``TPUPOD_WORKER_ID``, as the run numbered its workers)."""
    flag = "1" if native else "0"
    # the system's python, bare (-I -S: the script needs only the standard library): ~6 ms
    # to start, where a pyenv shim on PATH costs ~90 (x256 workers sharing a machine)
    python = 'p=/usr/bin/python3; [ -x "$p" ] || p=python3; "$p" -I -S'
    return f'{python} -c {shlex.quote(_SCRIPT)} {shlex.quote(launch_id)} "$TPUPOD_WORKER_ID" {flag}'


async def take(
    pod: Pod,
    launch_id: str,
    workers: Sequence[Worker],
    *,
    connector: Connector | None = None,
    native: bool = False,
) -> tuple[list[WorkerStacks], float]:
    """Every worker's stacks (``pod``: the run's view, its workers numbered as the run
    numbered them), and the seconds it took."""
    started = time.monotonic()
    answers: dict[int, str] = {}

    def on_line(worker: Worker, line: OutputLine) -> None:
        if line.text.startswith(MARKER):
            answers[worker.id] = line.text[len(MARKER) :]

    result = await execute_async(
        pod,
        command(launch_id, native),
        workers=list(workers),
        connector=connector,
        on_line=on_line,
        timeout=TIMEOUT_S,
    )
    found = []
    for r in result.workers:
        text = answers.get(r.worker.id)
        if text is None:
            why = r.error or r.last_line or r.outcome_text()
            reason = "no answer" if r.outcome is Outcome.UNREACHABLE else why
            found.append(WorkerStacks(r.worker, problem=reason, hint="check the host and retry"))
            continue
        found.append(_parsed(r.worker, json.loads(text)))
    return found, time.monotonic() - started


def _parsed(worker: WorkerLike, data: dict[str, Any]) -> WorkerStacks:
    processes = list(data.get("processes", []))
    error = data.get("error")
    if error == "gone":
        return WorkerStacks(worker, problem="its program is not running", hint=GONE_HINT)
    if error == "not-python":
        running = ", ".join(data.get("others", []))
        return WorkerStacks(worker, problem=f"its program is not Python ({running})", hint=NOT_PY)
    if error == "no-py-spy":
        return WorkerStacks(worker, processes, "py-spy is not installed there", PY_SPY_HINT)
    read = [p for p in processes if "threads" in p]
    if read:
        return WorkerStacks(worker, processes)
    said = next((str(p["error"]) for p in processes if p.get("error")), "py-spy read nothing")
    refused = any(w in said.lower() for w in ("permission", "not permitted", "ptrace"))
    hint = PTRACE_HINT if refused else GONE_HINT
    problem = f"ptrace refused ({_last_line(said)})" if refused else _last_line(said)
    return WorkerStacks(worker, processes, problem, hint)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text
