"""Chaos: training, serving and jobs at once on one state directory, under random kills.

Run as root (simulated SSH hosts in network namespaces, a tmpfs, PostgreSQL)::

    .venv/bin/python benchmarks/chaos.py --minutes 60 --seed 1     # the issue's run
    .venv/bin/python benchmarks/chaos.py --minutes 2 --seed 7      # tests/test_chaos.py's

What runs, with a user's default options, on one state directory (a tmpfs of its own,
so that a full disk can be made and undone):

* **training**: ``tpupod run --retries`` of ``examples/multislice_train.py`` (JAX, Orbax
  checkpoints) on a local pod and, with ``--ssh`` (the default), on an SSH pod of
  simulated hosts; its final parameters are compared with an undisturbed run's;
* **serving**: ``tpupod serve up`` (builtin backend, the router) on the local pod, and
  clients sending streamed and whole chat completions through the real ``openai`` client
  with its retries off (a retry must not hide a fault);
* **jobs**: a PostgreSQL store of the harness's own, two ``tpupod jobs worker --local``
  runners, jobs submitted all along with ``tpupod jobs submit``; each job appends its key
  to a file the harness owns, so executions are counted outside tpupod.

Injections, one every ``--every`` seconds (uniform; seeded; each logged with its time and
target): ``kill -9`` of a training worker, of a run's launcher (continued with ``run
--resume``, as a user would), of an engine, a front end, the router, an agent, a job
runner (another is started), the SSH pod's connection holder; PostgreSQL stopped at once
and started 10-30 s later; a simulated host's network down for 30 s; the state
directory's disk full for 20 s.

The verdict, after the drain: training bit-identical (steps redone counted); jobs
exactly once (lost / duplicated / unexpected, Jepsen's total-queue counts) with every
finished job's stored log complete, a job whose runner was killed while it ran counted
apart where its work was done again by a later attempt (a rerun that can happen anyway,
named by tpupod: the job may have done its work before the kill ended it); requests
(successes, failures by kind, the longest gap without a successful answer); each
injection named in tpupod's own output (its processes' outputs and logs, and what a user
watching ``serve status`` sees of a full disk) within 10 s; after ``serve down``,
``down`` and the runners' stop, no process of the run left and a new ``up`` works.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

try:
    import numpy as np
    import psutil
    from common import TPUPOD, sim_pod
    from tests.conftest import free_base_port
    from tests.postgres import Postgres, new_database, postgres_cluster

    from tpupod.sim import SimPod
except ImportError as missing:  # the venv `make demo` makes has no pytest, psycopg, openai
    raise SystemExit(
        f"error: benchmarks/chaos.py needs the test extra ({missing.name} is missing)\n"
        "hint: run it with the venv `make test` makes (.venv/bin/python), or "
        "pip install -e '.[test]'"
    ) from None

TRAIN = REPO / "examples" / "multislice_train.py"
TINY = REPO / "tests" / "fixtures" / "qwen2-tiny"
MARK = "TPUPOD_CHAOS_MARK"  # every local process of the run inherits it
NAMED_S = 10.0  # an injection must be named this soon
HOME_MB = 512
STEP_S = 0.25
SAVE_EVERY = 20
WATCH_S = 5.0  # the harness runs `serve status` this often, as a user watching it
RETRY_RESUME_S = 5.0  # a run --resume refused on a full disk is tried again this late


# -- what tpupod says -------------------------------------------------------------------


@dataclass
class Line:
    t: float  # time.monotonic() when the harness read it
    source: str
    text: str


class Heard:
    """Every line tpupod says: its commands' outputs (pipes) and its logs under the state
    directory (polled), each with the time it was read."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.lines: list[Line] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.offsets: dict[Path, int] = {}
        threading.Thread(target=self._poll_logs, daemon=True).start()

    def add(self, source: str, text: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.lines.extend(Line(now, source, line) for line in text.splitlines() if line)

    def pipe(self, source: str, stream: Any, echo: Callable[[str], None] | None = None) -> None:
        def read() -> None:
            for text in stream:
                self.add(source, text)
                if echo:
                    echo(text)

        threading.Thread(target=read, daemon=True).start()

    def _poll_logs(self) -> None:
        while not self.stopping.wait(0.25):
            for path in self.home.glob("**/*.log"):
                self._read_new(path)

    def _read_new(self, path: Path) -> None:
        try:
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        if not end:
            return
        self.offsets[path] = self.offsets.get(path, 0) + end
        name = str(path.relative_to(self.home))
        for text in data[:end].decode(errors="replace").splitlines():
            self.add(name, text)

    def find(
        self, pattern: re.Pattern[str], since: float, sources: tuple[str, ...] = ()
    ) -> Line | None:
        """The first line since ``since`` that matches, from one of ``sources`` (a source's
        name, or a folder's prefix ending in "/"; none: from any)."""

        def where(x: Line) -> bool:
            return not sources or any(
                x.source.startswith(s) if s.endswith("/") else x.source == s for s in sources
            )

        with self.lock:
            found = (x for x in self.lines if x.t >= since and where(x))
            return next((x for x in found if pattern.search(x.text)), None)

    def matching(self, pattern: re.Pattern[str], source: str) -> list[str]:
        """The lines from ``source`` (exactly) that match."""
        with self.lock:
            return [x.text for x in self.lines if x.source == source and pattern.search(x.text)]


# -- the run's processes ----------------------------------------------------------------


def marked(mark: str, *words: str) -> list[psutil.Process]:
    """Live processes of this chaos run (by its mark) whose command line has every word."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or proc.environ().get(MARK) != mark:
                continue
            line = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        if all(w in line for w in words):
            found.append(proc)
    return found


def having(*words: str) -> list[psutil.Process]:
    """Live processes whose command line has every word (the SSH pod's, under sshd)."""
    found = []
    for proc in psutil.process_iter():
        try:
            line = " ".join(proc.cmdline())
            if proc.status() != psutil.STATUS_ZOMBIE and all(w in line for w in words):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def describe(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"pid {proc.pid} ({' '.join(proc.cmdline())[:80]})"
    return f"pid {proc.pid}"


# -- training ---------------------------------------------------------------------------


@dataclass
class Training:
    """One ``tpupod run --retries`` on a pod, continued with ``--resume`` when its launcher
    is killed."""

    name: str  # the pod
    work: Path
    steps: int
    heard: Heard
    env: dict[str, str]
    launcher: subprocess.Popen[str] | None = None
    run_id: str | None = None
    launches: int = 0
    codes: list[int] = field(default_factory=list)
    no_room: bool = False  # the last launch said the disk was full
    refused_at: float | None = None  # when its refusal was seen

    @property
    def ckpt(self) -> Path:
        return self.work / f"ckpt-{self.name}"

    @property
    def out(self) -> Path:
        return self.work / f"params-{self.name}.npz"

    def program(self, out: Path, ckpt: Path | None = None, step_s: float = 0.0) -> list[str]:
        argv = [sys.executable, str(TRAIN), "--steps", str(self.steps), "--out", str(out)]
        argv += ["--step-seconds", str(step_s)] if step_s else []
        return argv + (["--ckpt", str(ckpt), "--save-every", str(SAVE_EVERY)] if ckpt else [])

    def start(self) -> None:
        argv = [TPUPOD, "run", "--pod", self.name]
        if self.run_id:
            argv += ["--resume", self.run_id]
        else:
            argv += ["--retries", "1000", "--", *self.program(self.out, self.ckpt, STEP_S)]
        self.launches += 1
        self.no_room = False
        self.launcher = subprocess.Popen(
            argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.heard.pipe(f"run {self.name}", self.launcher.stdout, self._heard)

    def _heard(self, text: str) -> None:
        found = re.search(r"tpupod: run (\S+): --retries", text)
        if found and not self.run_id:
            self.run_id = found.group(1)
        if text.startswith("error: No space left on device"):
            self.no_room = True  # this launch was refused: it never began

    def keep_going(self) -> None:
        """A launcher killed from outside is continued (``run --resume``), as a user would."""
        if self.launcher is None or self.launcher.poll() is None:
            return
        code = self.launcher.returncode
        if code == -signal.SIGKILL:
            self.start()
        elif self.refused:  # a resume refused on a full disk: again a little later
            self.refused_at = self.refused_at or time.monotonic()
            if time.monotonic() - self.refused_at >= RETRY_RESUME_S:
                self.refused_at = None
                self.start()
        elif not self.codes or self.codes[-1] != code:
            self.codes.append(code)

    @property
    def refused(self) -> bool:
        """The last ``--resume`` was refused on a full disk: it never began."""
        ended = self.launcher is not None and self.launcher.poll() not in (None, 0)
        return ended and self.run_id is not None and self.no_room

    @property
    def done(self) -> bool:
        ended = self.launcher is not None and self.launcher.poll() not in (None, -signal.SIGKILL)
        return ended and not self.refused

    def redone(self) -> int:
        """Steps run more than once (worker 0's ``step N loss`` lines, every attempt)."""
        pattern = re.compile(r"\[w0\] step (\d+) loss")
        said = self.heard.matching(pattern, f"run {self.name}")
        steps = [int(found[1]) for text in said if (found := pattern.search(text))]
        return len(steps) - len(set(steps))


def undisturbed(train: Training) -> Path:
    """The anchor: the same program and steps, one run that nothing disturbs (no
    checkpoints, no sleeps: neither changes a step's arithmetic)."""
    out = train.work / f"anchor-{train.name}.npz"
    program = train.program(out)
    subprocess.run(
        [TPUPOD, "run", "--pod", train.name, "-q", "--", *program],
        env=train.env, check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return out


def same_parameters(a: Path, b: Path) -> bool:
    if not (a.exists() and b.exists()):
        return False
    with np.load(a) as x, np.load(b) as y:
        return sorted(x.files) == sorted(y.files) and all(
            np.array_equal(x[k], y[k]) for k in x.files
        )


# -- serving ----------------------------------------------------------------------------


class Clients:
    """``count`` clients sending chat completions (streamed and whole, in turn) through the
    router with the ``openai`` client, its retries off."""

    def __init__(self, base_url: str, api_key: str, count: int) -> None:
        self.base_url, self.api_key = base_url, api_key
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.failed: collections.Counter[str] = collections.Counter()
        self.successes: list[float] = []
        self.failures: list[float] = []  # when each failed (monotonic): where they cluster
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(count)
        ]

    def start(self) -> None:
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)
        self.stopped = time.monotonic()

    def _loop(self, index: int) -> None:
        import openai  # the serve extra's client; only this workload needs it

        client = openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=30
        )
        turn = 0
        while not self.stopping.is_set():
            turn += 1
            stream = (index + turn) % 2 == 0
            try:
                self._one(client, stream, f"chaos {index} {turn}")
            except Exception as exc:  # every failure is counted, by its kind
                with self.lock:
                    self.failed[failure_kind(exc)] += 1
                    self.failures.append(time.monotonic())
                time.sleep(0.05)
            else:
                with self.lock:
                    self.ok += 1
                    self.successes.append(time.monotonic())
        client.close()

    @staticmethod
    def _one(client: Any, stream: bool, prompt: str) -> None:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = client.chat.completions.create(
                model="qwen2-tiny", messages=messages, max_tokens=8, stream=True
            )
            finish = None
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if finish is None:
                raise RuntimeError("stream ended without a finish_reason")
        else:
            answer = client.chat.completions.create(
                model="qwen2-tiny", messages=messages, max_tokens=8
            )
            if not answer.choices:
                raise RuntimeError("an answer without choices")

    def failed_by_window(self, t0: float, width: float = 10.0) -> dict[str, int]:
        """Failures per ``width`` s window since ``t0`` (``"120"``: 120-130 s), those with
        any: set beside the injections' times, they say which fault cost what."""
        counts = collections.Counter(int((t - t0) // width * width) for t in self.failures)
        return {str(start): n for start, n in sorted(counts.items())}

    def longest_gap(self) -> float:
        marks = [self.started, *sorted(self.successes), self.stopped]
        return max(b - a for a, b in itertools.pairwise(marks))


def failure_kind(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    return f"{type(exc).__name__}" + (f" {status}" if status else "")


# -- jobs -------------------------------------------------------------------------------


class Jobs:
    """Runners on a PostgreSQL store, and a submitter; executions counted in ``ran``."""

    def __init__(self, url: str, work: Path, heard: Heard, env: dict[str, str]) -> None:
        self.url, self.heard, self.env = url, heard, env
        self.ran = work / "jobs-ran"  # each job appends its key as its last act
        self.ran.touch()
        self.runners: list[subprocess.Popen[str]] = []
        self.sources: dict[int, str] = {}  # runner pid -> its source in Heard
        self.started_runners = 0
        self.acked: dict[str, int] = {}  # key -> id, for each submit that printed an id
        self.refused: list[str] = []
        self.stopping = threading.Event()
        # (job id, attempt) in flight in a runner the harness killed: its job may have done
        # its work (appended its key) before it was ended, and its rerun is then a second
        # run that can happen anyway, named by tpupod (the words), not a duplicate
        self.cut: set[tuple[int, int]] = set()

    def cut_short(self, in_flight: str | None) -> None:
        """Note the attempt a killed runner had in flight (``job N attempt A: started``)."""
        found = re.match(r"job (\d+) attempt (\d+)", in_flight or "")
        if found:
            self.cut.add((int(found.group(1)), int(found.group(2))))

    def start_runner(self) -> None:
        self.started_runners += 1
        runner = subprocess.Popen(
            [TPUPOD, "jobs", "worker", "--local", "--db", self.url, "--concurrency", "2"],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.heard.pipe(f"runner {self.started_runners}", runner.stdout)
        self.runners.append(runner)
        self.sources[runner.pid] = f"runner {self.started_runners}"

    def busy(self, runner: subprocess.Popen[str]) -> str | None:
        """The job a runner has in flight, by its last line (``job N attempt A: started``)."""
        said = self.heard.matching(re.compile(r"job \d+ attempt \d+: "), self.sources[runner.pid])
        return said[-1].split("tpupod: ")[-1] if said and ": started" in said[-1] else None

    def keep_two(self) -> None:
        self.runners = [r for r in self.runners if r.poll() is None]
        while len(self.runners) < 2:
            self.start_runner()

    def submit_all_along(self, every_s: float) -> None:
        def loop() -> None:
            n = 0
            while not self.stopping.wait(every_s):
                n += 1
                self.submit(f"k{n:05d}")

        self.submitter = threading.Thread(target=loop, daemon=True)
        self.submitter.start()

    def submit(self, key: str) -> None:
        ran = f"echo {key} $TPUPOD_JOB_ATTEMPT >> {self.ran}"  # which attempt did the work
        script = f"echo start {key}; sleep 0.5; {ran}; echo done {key}"
        done = subprocess.run(
            [TPUPOD, "jobs", "submit", "--db", self.url, "--name", key, "--", "sh", "-c", script],
            env=self.env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        self.heard.add("submit", done.stderr)
        if done.returncode == 0 and done.stdout.strip().isdigit():
            self.acked[key] = int(done.stdout.strip())
        else:
            self.refused.append(key)

    def drain(self, timeout: float) -> None:
        from tpupod.jobs.store import Store  # the jobs extra; only the drain needs it

        store = Store.open(self.url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                counts = store.counts()
                if not any(n for status, n in counts.items() if status.value in UNFINISHED):
                    return
                self.keep_two()
                time.sleep(1)
        finally:
            store.close()

    def verdict(self) -> dict[str, Any]:
        from tpupod.jobs.store import Store  # the jobs extra; only the verdict needs it

        runs = [line.split() for line in self.ran.read_text().splitlines() if line.strip()]
        ran = collections.Counter(key for key, *_ in runs)
        attempts = collections.defaultdict(list)  # key -> the attempts that did its work
        for key, *attempt in runs:
            attempts[key].append(int(attempt[0]) if attempt else 0)
        acked = set(self.acked)
        store = Store.open(self.url)
        try:
            statuses: collections.Counter[str] = collections.Counter()
            incomplete, reruns = [], []
            for key, job_id in self.acked.items():
                job = store.get(job_id)
                statuses[job.status.value] += 1
                text = "\n".join(x.line for x in store.logs(job_id, limit=100_000))
                if job.status.value == "completed" and f"done {key}" not in text:
                    incomplete.append(job_id)
                if job.attempt > 1:
                    reruns.append(job_id)
        finally:
            store.close()

        def cut_then_rerun(key: str) -> bool:
            """Every run of ``key`` but its last was an attempt cut by a runner's kill, and
            the job was run again as a later attempt (tpupod names why: its runner lost)."""
            job_id, done = self.acked.get(key), sorted(attempts[key])
            if job_id is None or len(set(done)) < len(done):  # one attempt's work twice
                return False
            return all((job_id, a) in self.cut for a in done[:-1])

        twice = [k for k, n in ran.items() if n > 1]
        return {
            "submitted": len(self.acked) + len(self.refused),
            "acknowledged": len(acked),
            "refused": len(self.refused),
            "lost": sorted(acked - set(ran)),
            "duplicated": sorted(k for k in twice if not cut_then_rerun(k)),
            "run_again_after_a_cut": sorted(k for k in twice if cut_then_rerun(k)),
            "unexpected": sorted(set(ran) - acked - set(self.refused)),
            "ran_though_refused": sorted(set(ran) & set(self.refused)),
            "statuses": dict(statuses),
            "logs_incomplete": incomplete,
            "rerun": reruns,
            "runners_started": self.started_runners,
        }


UNFINISHED = ("pending", "scheduled", "running")


# -- injections -------------------------------------------------------------------------

# What a line of tpupod's says when it names each kind of injection (which process, why).
SERVING_DIED = r".*(SIGKILL|killed|exited|restart|lost|down|gone)"
NAMED = {
    # tpupod's own line: not bash's job report in the worker's output ("[w0] /bin/bash:
    # line 20: 16317 Killed ...", the shell that ran it; a trial saw it counted)
    "worker": r"^tpupod: .*\bw\d.*(SIGKILL|killed|lost)",
    "launcher": r"resum|launcher",
    "engine": "engine" + SERVING_DIED,
    "frontend": "front" + SERVING_DIED,
    "router": "router" + SERVING_DIED,
    "agent": "no agent|agent" + SERVING_DIED,
    "runner": r"runner.*(lost|gone|died)|lost.*runner",
    "postgres": r"(database|store|postgres).*(away|unreachable|down|lost|refused)",
    "network": r"(unreachable|not answer|silent|timed out|lost)",
    "disk": r"(no space|disk.*full|full disk|ENOSPC|cannot write)",
}


@dataclass
class Injection:
    at: float  # monotonic
    kind: str
    target: str
    named_by: re.Pattern[str]  # a line of tpupod's that names it
    named: Line | None = None
    # where that line may come from (a source, or a folder's prefix ending in "/"); empty:
    # anywhere. A worker's kill is named by its own training's run, not the other pod's.
    sources: tuple[str, ...] = ()

    def row(self, start: float) -> str:
        return f"{self.at - start:7.1f}s  {self.kind:<9} {self.target[:70]}"


def kill(procs: list[psutil.Process], rng: random.Random) -> psutil.Process | None:
    if not procs:
        return None
    proc = rng.choice(procs)
    with contextlib.suppress(psutil.Error):
        proc.send_signal(signal.SIGKILL)
        return proc
    return None


class Chaos:
    """The workloads, and the faults thrown at them."""

    def __init__(self, args: argparse.Namespace, work: Path, home: Path) -> None:
        self.args, self.work, self.home = args, work, home
        self.rng = random.Random(args.seed)
        self.mark = uuid.uuid4().hex
        self.env = {
            **os.environ, "TPUPOD_HOME": str(home), MARK: self.mark, "JAX_PLATFORMS": "cpu",
        }  # fmt: skip
        os.environ.update(TPUPOD_HOME=str(home), **{MARK: self.mark})  # sim_pod's StateDir
        self.heard = Heard(home)
        self.injections: list[Injection] = []
        self.undo: list[threading.Thread] = []
        self.sim: SimPod | None = None
        self.pg: Postgres | None = None
        self.trainings: list[Training] = []
        self.serve_up: list[str] = []

    def tpupod(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [TPUPOD, *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        self.heard.add(f"tpupod {argv[0]}", done.stdout + done.stderr)
        return done

    # -- the workloads ------------------------------------------------------------------

    def start(self, stack: contextlib.ExitStack) -> None:
        steps = max(20, int(self.args.minutes * 60 * 0.6 / STEP_S))
        say(f"pods, PostgreSQL and a fleet on {self.home}")
        checked(self.tpupod("up", "--name", "chaos", "--local", "2", "--devices-per-worker", "2"))
        stack.callback(self.tpupod, "down", "--pod", "chaos", "--force")
        self.trainings.append(Training("chaos", self.work, steps, self.heard, self.env))
        if self.args.ssh:
            self.sim = stack.enter_context(SimPod(2))
            sim_pod(self.sim, "chaos-ssh", env={"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"})
            stack.callback(self.tpupod, "down", "--pod", "chaos-ssh", "--force")
            self.trainings.append(Training("chaos-ssh", self.work, steps, self.heard, self.env))
        self.pg = stack.enter_context(postgres_cluster())
        self.jobs = Jobs(new_database(self.pg), self.work, self.heard, self.env)
        # the README's serve up; a free --base-port, as 31000 may be another fleet's here
        self.serve_up = [
            "serve", "up", "--pod", "chaos", "--model", str(TINY),
            "--base-port", str(free_base_port()), "--", "--max-batch", "4", "--max-length", "128",
        ]  # fmt: skip
        stack.callback(self.tpupod, "serve", "down", "--pod", "chaos")
        say("serve up")
        checked(self.tpupod(*self.serve_up))
        endpoint = checked(self.tpupod("serve", "endpoint", "--pod", "chaos")).stdout
        found = dict(re.findall(r"export (\w+)=(\S+)", endpoint))
        self.clients = Clients(found["OPENAI_BASE_URL"], found["OPENAI_API_KEY"], self.args.clients)
        say("the undisturbed runs (the anchors)")
        with concurrent.futures.ThreadPoolExecutor() as pool:
            anchors = pool.map(undisturbed, self.trainings)
            self.anchors = dict(zip([t.name for t in self.trainings], anchors, strict=True))
        say("the workloads")
        for training in self.trainings:
            training.start()
        self.jobs.keep_two()
        self.jobs.submit_all_along(self.args.submit_every)
        self.clients.start()
        self.watching = threading.Event()
        threading.Thread(target=self.watch_status, daemon=True).start()

    def watch_status(self, every: float = WATCH_S) -> None:
        """A user's ``watch tpupod serve status``: what it says of a full disk is heard
        (the logs that would say it are on that disk). Only those lines: its other
        columns (restart counts, a router's restarts) would name later faults with
        what it said of earlier ones."""
        while not self.watching.wait(every):
            done = subprocess.run(
                [TPUPOD, "serve", "status", "--pod", "chaos"], env=self.env,
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            said = [line for line in done.stdout.splitlines() if "disk full" in line]
            self.heard.add("tpupod serve status (watched)", "\n".join(said))

    def tend(self) -> None:
        """What the harness does as a user would: continue a killed launcher, start a runner."""
        for training in self.trainings:
            training.keep_going()
        self.jobs.keep_two()

    # -- faults -------------------------------------------------------------------------

    def kinds(self) -> dict[str, Callable[[], Injection | None]]:
        kinds = {
            "worker": self.kill_worker,
            "launcher": self.kill_launcher,
            "engine": lambda: self.kill_serving("engine", "--role engine"),
            "frontend": lambda: self.kill_serving("frontend", "--role frontend"),
            "router": lambda: self.kill_serving("router", "-m tpupod.serve.router"),
            "agent": lambda: self.kill_serving("agent", "tpupod.serve.agent --host"),
            "runner": self.kill_runner,
            "postgres": self.stop_postgres,
            "disk": self.fill_disk,
        }
        if self.sim is not None:
            kinds["network"] = self.unplug
        return kinds

    def inject(self, kind: str) -> Injection | None:
        made = self.kinds()[kind]()
        if made:
            self.injections.append(made)
            print(f"chaos: {made.row(self.t0)}", flush=True)
        return made

    def kill_worker(self) -> Injection | None:
        """A worker of either training; not the SSH pod's while a host's link is cut: its
        processes there are tpupod's to stop once the link is back (the 15-minute run's
        kill of a worker on a cut host could be named only after the outage)."""
        trainings = [t for t in self.trainings if t.name != "chaos-ssh" or not self.cut()]
        if not trainings:
            return None
        training = self.rng.choice(trainings)
        procs = having(str(TRAIN), str(training.ckpt))  # local or under a simulated sshd
        # its own: ".../ckpt-chaos" is also the start of the SSH pod's ".../ckpt-chaos-ssh"
        # (the 15-minute run's seed 3 killed the SSH pod's worker as the local pod's)
        mine = [p for p in procs if _runs(p, str(TRAIN)) and _argv_has(p, str(training.ckpt))]
        if not mine:
            return None
        proc = self.rng.choice(mine)
        target = f"{training.name} {describe(proc)}"  # before: a local one's is gone after
        if kill([proc], self.rng) is None:
            return None
        own = (f"run {training.name}", f"pods/{training.name}/")
        return injected("worker", target, NAMED["worker"], own)

    def kill_launcher(self) -> Injection | None:
        training = self.rng.choice(self.trainings)
        launcher = training.launcher
        if launcher is None or launcher.poll() is not None or not training.run_id:
            return None
        launcher.send_signal(signal.SIGKILL)
        return injected("launcher", f"{training.name} run {training.run_id}", NAMED["launcher"])

    def kill_serving(self, kind: str, words: str) -> Injection | None:
        procs = [p for p in marked(self.mark, words) if not _keeper(p)]
        proc = kill(procs, self.rng)
        if proc is None:
            return None
        if kind == "agent":  # among the undone at the end: not left running into serve down
            self.later(1, self.serve_again)
        return injected(kind, f"{kind} pid {proc.pid}", NAMED[kind])

    def serve_again(self) -> None:
        """A user whose `serve status` says a worker's agent is gone runs `serve up` again
        (a trial's 2-minute run: one begun as the harness ran `serve down` left a fleet)."""
        self.tpupod("serve", "status", "--pod", "chaos", timeout=60)
        self.tpupod(*self.serve_up)

    def kill_runner(self) -> Injection | None:
        """A runner with a job in flight (an idle runner's death loses nothing to name)."""
        busy = [r for r in self.jobs.runners if r.poll() is None and self.jobs.busy(r)]
        if not busy:
            return None
        runner = self.rng.choice(busy)
        in_flight = self.jobs.busy(runner)
        runner.send_signal(signal.SIGKILL)
        self.jobs.cut_short(in_flight)
        return injected("runner", f"pid {runner.pid} ({in_flight})", NAMED["runner"])

    def stop_postgres(self) -> Injection | None:
        pg = self.pg
        if pg is None or self.recent("postgres"):
            return None
        away = self.rng.uniform(10, 30)
        subprocess.run([*pg.pg_ctl, "-m", "immediate", "stop"], capture_output=True, check=False)
        self.later(
            away, lambda: subprocess.run([*pg.pg_ctl, "start"], capture_output=True, check=False)
        )
        return injected("postgres", f"stopped for {away:.0f}s", NAMED["postgres"])

    def unplug(self) -> Injection | None:
        """A simulated host's link down for 30 s, while the SSH pod's training runs: the
        SSH pod holds nothing else, so a host cut after it ended has nothing to notice it
        (the 60-minute run's 9 network injections after the trainings ended)."""
        sim = self.sim
        if sim is None or self.recent("network"):
            return None
        if all(t.done for t in self.trainings if t.name == "chaos-ssh"):
            return None
        index = self.rng.randrange(len(sim.hosts))
        sim.unplug(index)
        self.later(30, lambda: sim.plug(index))
        return injected("network", f"host {sim.hosts[index].address} for 30s", NAMED["network"])

    def fill_disk(self) -> Injection | None:
        filler = self.home / ".chaos-fill"
        if filler.exists():
            return None
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True, check=False
        )
        self.later(20, lambda: filler.unlink(missing_ok=True))
        return injected("disk", f"{self.home} full for 20s", NAMED["disk"])

    def cut(self) -> bool:
        """A simulated host's link is down now (for 30 s after its injection)."""
        return self.recent("network", 31)

    def recent(self, kind: str, seconds: float = 40) -> bool:
        """An outage of this kind began this recently (it may still last): not another."""
        return any(i.kind == kind and i.at > time.monotonic() - seconds for i in self.injections)

    def later(self, seconds: float, action: Callable[[], object]) -> None:
        def wait_then() -> None:
            time.sleep(seconds)
            action()

        thread = threading.Thread(target=wait_then, daemon=True)
        thread.start()
        self.undo.append(thread)

    # -- the run ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        low, high = self.args.every
        kinds = sorted(self.kinds())
        self.t0 = time.monotonic()
        end = self.t0 + self.args.minutes * 60
        next_at = self.t0 + self.rng.uniform(low, high)
        while time.monotonic() < end:
            self.tend()
            if time.monotonic() >= next_at:
                for _ in range(5):  # a kind with nothing to hit now: another
                    if self.inject(self.rng.choice(kinds)):
                        break
                next_at = time.monotonic() + self.rng.uniform(low, high)
            time.sleep(0.2)
        for thread in self.undo:
            thread.join()
        return self.drain()

    def drain(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.args.drain
        while time.monotonic() < deadline and not all(t.done for t in self.trainings):
            self.tend()
            time.sleep(0.5)
        self.jobs.stopping.set()
        self.jobs.drain(max(10.0, deadline - time.monotonic()))
        self.clients.stop()
        self.watching.set()
        for injection in self.injections:
            injection.named = self.heard.find(injection.named_by, injection.at, injection.sources)
        return {
            "training": {
                t.name: {
                    "identical": same_parameters(t.out, self.anchors[t.name]),
                    "steps": t.steps,
                    "redone": t.redone(),
                    "launches": t.launches,
                    "exit": t.launcher.returncode if t.launcher else None,
                }
                for t in self.trainings
            },
            "jobs": self.jobs.verdict(),
            "requests": {
                "ok": self.clients.ok,
                "failed": dict(self.clients.failed),
                "longest_gap_s": round(self.clients.longest_gap(), 2),
                "failed_by_10s": self.clients.failed_by_window(self.t0),
            },
            "injections": [
                {
                    "t": round(i.at - self.t0, 1),
                    "kind": i.kind,
                    "target": i.target,
                    "named_s": round(i.named.t - i.at, 1) if i.named else None,
                    "named_by": f"{i.named.source}: {i.named.text.strip()}" if i.named else None,
                }
                for i in self.injections
            ],
        }

    def stop_all(self) -> None:
        """serve down, the runners' stop, down: what a user does at the end."""
        self.tpupod("serve", "down", "--pod", "chaos")
        for runner in self.jobs.runners:
            if runner.poll() is None:
                runner.send_signal(signal.SIGTERM)
        for runner in self.jobs.runners:
            with contextlib.suppress(subprocess.TimeoutExpired):
                runner.wait(30)
        for training in self.trainings:
            if training.launcher and training.launcher.poll() is None:
                training.launcher.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    training.launcher.wait(30)
            self.tpupod("down", "--pod", training.name)

    def leftovers(self) -> list[str]:
        """Processes of the run still alive, and whether a new `up` works on the state
        directory: the answer should be none."""
        deadline = time.monotonic() + 10
        while True:
            left = [p for p in marked(self.mark, "") if not _harness(p)]
            left += having(str(self.work) + "/ckpt")  # under a simulated host's sshd
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        found = [describe(p) for p in left]
        again = self.tpupod("up", "--name", "chaos-again", "--local", "1")
        if again.returncode != 0:
            found.append(f"up on the state directory failed: {again.stderr.strip()[-200:]}")
        self.tpupod("down", "--pod", "chaos-again")
        return found


def injected(kind: str, target: str, named_by: str, sources: tuple[str, ...] = ()) -> Injection:
    pattern = re.compile(named_by, re.IGNORECASE)
    return Injection(time.monotonic(), kind, target, pattern, sources=sources)


def _runs(proc: psutil.Process, script: str) -> bool:
    """``proc`` is a python running ``script`` (not a shell whose command line names it)."""
    with contextlib.suppress(psutil.Error):
        return bool(proc.cmdline()[1:2] == [script])
    return False


def _argv_has(proc: psutil.Process, word: str) -> bool:
    """``word`` is one of ``proc``'s arguments, whole."""
    with contextlib.suppress(psutil.Error):
        return word in proc.cmdline()
    return False


def _keeper(proc: psutil.Process) -> bool:
    """The router's keeper (``agent.respawn``), whose command line names the router's."""
    with contextlib.suppress(psutil.Error):
        return "tpupod.serve.agent.respawn" in proc.cmdline()
    return False


def _harness(proc: psutil.Process) -> bool:
    """The harness itself, its PostgreSQL, its simulated hosts (unshare, sshd)."""
    with contextlib.suppress(psutil.Error):
        argv = proc.cmdline()
        return (
            proc.pid == os.getpid()
            or proc.username() == "postgres"
            or argv[:1] in (["unshare"], ["runuser"])
            or (argv[:1] and argv[0].startswith("sshd:") and "[listener]" in " ".join(argv))
        )
    return True


def say(text: str) -> None:
    print(f"chaos: {text}", flush=True)


def checked(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    if done.returncode != 0:
        raise SystemExit(f"chaos: {' '.join(map(str, done.args[1:4]))} failed:\n{done.stderr}")
    return done


@contextlib.contextmanager
def state_home(size_mb: int) -> Iterator[Path]:
    """A state directory on a tmpfs of its own: the disk-full injection fills it alone."""
    home = Path(tempfile.mkdtemp(prefix="tpupod-chaos-home-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(home)], check=True
    )
    try:
        yield home
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)
        shutil.rmtree(home, ignore_errors=True)


def chaos(args: argparse.Namespace) -> dict[str, Any]:
    """One chaos run; its verdict (a dict, printed by main)."""
    # checkpoints and final parameters: in a folder every simulated host sees (each has a
    # /tmp of its own; /var/tmp is shared, as a pod's NFS would be)
    work = Path(tempfile.mkdtemp(prefix="tpupod-chaos-", dir="/var/tmp"))
    print(f"chaos: checkpoints, anchors and heard.log in {work} (kept)", file=sys.stderr)
    with state_home(HOME_MB) as home, contextlib.ExitStack() as stack:
        harness = Chaos(args, work, home)
        try:
            harness.start(stack)
            verdict = harness.run()
        except KeyboardInterrupt:  # said at once: the stop takes ~20 s (pods, fleet, store)
            print(
                f"chaos: interrupted; stopping what it started ({work} is kept)",
                file=sys.stderr,
                flush=True,
            )
            raise
        finally:  # an interrupted run stops what it started too
            harness.heard.stopping.set()
            if hasattr(harness, "clients"):
                harness.clients.stopping.set()
            if hasattr(harness, "jobs"):
                harness.jobs.stopping.set()
                harness.stop_all()
        verdict["leftovers"] = harness.leftovers()
        verdict["seed"] = args.seed
        verdict["minutes"] = args.minutes
        (work / "heard.log").write_text(
            "".join(f"{x.t - harness.t0:9.2f} {x.source}: {x.text}\n" for x in harness.heard.lines)
        )
        verdict["heard"] = str(work / "heard.log")
    return verdict


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The verdict goes to stdout (JSON, then a line per injection) and --json; "
        "the exit status is 1 when a target is missed (each is said on stderr).",
    )
    parser.add_argument("--minutes", type=float, default=60, help="how long faults come")
    parser.add_argument("--seed", type=int, default=1, help="the faults' random seed")
    parser.add_argument(
        "--every", type=float, nargs=2, default=(10.0, 30.0), metavar=("MIN", "MAX"),
        help="seconds between faults, uniform in [MIN, MAX]",
    )  # fmt: skip
    parser.add_argument("--clients", type=int, default=4, help="concurrent chat clients")
    parser.add_argument("--submit-every", type=float, default=2.0, help="seconds between jobs")
    parser.add_argument("--drain", type=float, default=600, help="seconds the drain may take")
    parser.add_argument(
        "--ssh", action=argparse.BooleanOptionalAction, default=True,
        help="also train on an SSH pod of simulated hosts (and unplug their network)",
    )  # fmt: skip
    parser.add_argument("--json", help="write the verdict here too")
    return parser.parse_args(argv)


# How soon each kind must be named. A host whose network is down sends nothing back, not
# even a reset: the launcher knows when the SSH keepalive gives up, after the pod's
# keepalive_interval x keepalive_count (5 s x 3 by default) and one more interval.
NAMED_WITHIN_S = {"network": 5.0 * (3 + 1) + 5.0}
SUCCESS_TARGET = 0.999
GAP_TARGET_S = 10.0


def misses(verdict: dict[str, Any]) -> list[str]:
    """The targets a verdict misses, one line each, prefixed with its area."""
    found = []
    for pod, training in verdict["training"].items():
        if not training["identical"] or training["exit"] != 0:
            found.append(f"training {pod}: not the undisturbed run's parameters ({training})")
    jobs = verdict["jobs"]
    for what in ("lost", "duplicated", "unexpected", "logs_incomplete"):
        if jobs[what]:
            found.append(f"jobs: {what} {jobs[what]}")
    if not jobs["acknowledged"] or jobs["statuses"] != {"completed": jobs["acknowledged"]}:
        found.append(f"jobs: not all {jobs['acknowledged']} acknowledged completed: {jobs}")
    requests = verdict["requests"]
    failed = sum(requests["failed"].values())
    if not requests["ok"] or requests["ok"] < SUCCESS_TARGET * (requests["ok"] + failed):
        found.append(f"requests: {requests['ok']} ok, {requests['failed']} failed")
    if requests["longest_gap_s"] > GAP_TARGET_S:
        found.append(f"requests: {requests['longest_gap_s']} s without a successful answer")
    for i in verdict["injections"]:
        if _late(i):
            found.append(f"injections: {i['kind']} at {i['t']} s named after {i['named_s']} s")
    found += [f"leftovers: {left}" for left in verdict["leftovers"]]
    return found


def checks(verdict: dict[str, Any]) -> list[tuple[str, str]]:
    """Each area of the verdict as one line a user reads: (area, what was measured)."""
    trainings = "; ".join(
        f"{pod}: {'bit-identical' if t['identical'] else 'NOT the undisturbed run'}, "
        f"{t['redone']} steps redone over {t['launches']} launches"
        for pod, t in verdict["training"].items()
    )
    jobs = verdict["jobs"]
    whole = "every log whole" if not jobs["logs_incomplete"] else "logs incomplete"
    requests = verdict["requests"]
    failed = sum(requests["failed"].values())
    ok = 100 * requests["ok"] / max(requests["ok"] + failed, 1)
    injections = verdict["injections"]
    late = [i for i in injections if _late(i)]
    allowances = ", ".join(f"{kind} {s:g} s" for kind, s in NAMED_WITHIN_S.items())
    left = verdict["leftovers"]
    return [
        ("training", trainings),
        ("jobs", f"{jobs['acknowledged']} acknowledged: {len(jobs['lost'])} lost, "
                 f"{len(jobs['duplicated'])} duplicated, {len(jobs['unexpected'])} "
                 f"unexpected, {whole}"),
        ("requests", f"{requests['ok']} ok, {failed} failed: {ok:.2f} % ok (target "
                     f"{100 * SUCCESS_TARGET:g} %); longest gap without an answer "
                     f"{requests['longest_gap_s']} s (target {GAP_TARGET_S:g} s)"),
        ("injections", f"{len(injections) - len(late)} of {len(injections)} named in time "
                       f"({NAMED_S:g} s; {allowances})"),
        ("leftovers", f"{len(left)} left" if left else "nothing left; a new up works"),
    ]  # fmt: skip


def _late(injection: dict[str, Any]) -> bool:
    named = injection["named_s"]
    return named is None or named > NAMED_WITHIN_S.get(injection["kind"], NAMED_S)


def report(verdict: dict[str, Any], out: TextIO | None = None) -> None:
    """The verdict: its JSON, each injection (its whole target, and the whole line of
    tpupod's that named it, with how soon against its allowance), each check met or
    MISSED, and a last line that says which."""
    out = out or sys.stdout
    print(json.dumps({k: v for k, v in verdict.items() if k != "injections"}, indent=2), file=out)
    print("\ninjections:", file=out)
    for i in verdict["injections"]:
        within = NAMED_WITHIN_S.get(i["kind"], NAMED_S)
        named = (
            f"named in {i['named_s']} s of {within:g} s by {i['named_by']}"
            if i["named_s"] is not None
            else f"NOT NAMED within {within:g} s"
        )
        print(f"  {i['t']:7.1f}s {i['kind']:<9} {i['target']}", file=out)
        print(f"            {named}", file=out)
    missed = {m.split(":", 1)[0] for m in verdict["misses"]}
    print("\nchecks:", file=out)
    found = checks(verdict)
    for area, measured in found:
        print(f"  {area:<10} {measured}  {'MISSED' if area in missed else 'met'}", file=out)
    if missed:
        areas = ", ".join(area for area, _ in found if area in missed)
        print(f"chaos: {len(missed)} of {len(found)} checks MISSED: {areas}", file=out)
    else:
        total = len(verdict["injections"])
        print(f"chaos: every target met ({len(found)} checks, {total} injections)", file=out)


def main() -> None:
    args = parse()
    try:
        verdict = chaos(args)
    except KeyboardInterrupt:  # chaos() has stopped what it started on the way out
        print("chaos: interrupted; what it started is stopped", file=sys.stderr)
        sys.exit(130)
    verdict["misses"] = misses(verdict)
    report(verdict)
    if args.json:
        Path(args.json).write_text(json.dumps(verdict, indent=2))
    for miss in verdict["misses"]:
        print(f"chaos: missed: {miss}", file=sys.stderr)
    sys.exit(1 if verdict["misses"] else 0)


if __name__ == "__main__":
    main()
