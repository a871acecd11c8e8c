"""Hung runs (issue 40): how soon a hang is named, what stacks cost, what a heartbeat costs.

Run as root for the simulated SSH hosts (the local sizes need no root):

    .venv/bin/python benchmarks/hang.py                        # 4, 64 local; 256 simulated
    .venv/bin/python benchmarks/hang.py --local 4 --sim --runs 3   # no simulated hosts

In one run:

1. *Hang to digest*: a program where every worker meets the others
   (``tpupod.rendezvous('start')``), prints a line with the time, then blocks: the last
   worker in ``next_batch``, the others in ``wait_for_peers``. ``tpupod run
   --hang-timeout T`` names the hang; the time from the last worker's line (the last
   progress) to the digest's last line on the launcher's stderr, minus T, is what tpupod
   adds: the watchdog's check interval, then taking and grouping every worker's stacks.
   At 4 workers also the issue's JAX program (the others in ``process_allgather``).
2. *Stacks*: ``tpupod stacks`` of every worker of that program, run as a fresh CLI
   process while it blocks; and ``tpupod stacks -w 0`` (one process) beside ``py-spy
   dump --pid P`` of the same process run by hand (the anchor), in turn.
3. *Heartbeat*: ``tpupod.heartbeat(step)`` per call beside a bare ``time.time()`` (the
   anchor), then a program with a 100 ms step and a heartbeat every step, steps with and
   without it in turn; both inside ``tpupod run`` on one worker, so the marker lines go
   through the launcher as in a real run.

Local pods run workers as processes of this machine; the simulated pod's hosts are
network namespaces with real sshd (``tpupod.sim``), all on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common import TPUPOD, sim_pod

from tpupod.holder.client import stop_holder
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod

PYTHON = sys.executable  # the workers' Python: has tpupod and py-spy
PY_SPY = str(Path(sys.executable).with_name("py-spy"))

BLOCKING = """
import os, sys, time
import tpupod

me = tpupod.rendezvous("start", timeout=600)

def next_batch():
    time.sleep(3600)  # a stuck data loader

def wait_for_peers():
    time.sleep(3600)  # a collective whose peer never comes

print(f"blocking at {time.time():.6f} pid {os.getpid()}", flush=True)
next_batch() if me.id == me.count - 1 else wait_for_peers()
"""

JAX_BLOCKING = """
import os, time
import tpupod

me = tpupod.init_jax()
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

def next_batch(step):
    if me.id == me.count - 1 and step == 2:
        time.sleep(3600)  # a stuck data loader
    return np.ones(4) * step

for step in range(100):
    if step == 2:
        print(f"blocking at {time.time():.6f} pid {os.getpid()}", flush=True)
    batch = next_batch(step)
    multihost_utils.process_allgather(jnp.asarray(batch.sum()))
"""

HEARTBEAT = """
import json, os, statistics, time
os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # a steady step
import numpy as np
import tpupod
from tpupod import heartbeat

CALLS, REPEATS, STEPS = 200_000, 15, 100

def as_documented(base):  # tpupod.heartbeat(step), as the docs write it
    started = time.perf_counter()
    for i in range(base, base + CALLS):
        tpupod.heartbeat(i)
    return (time.perf_counter() - started) / CALLS

def by_name(base):  # from tpupod import heartbeat
    started = time.perf_counter()
    for i in range(base, base + CALLS):
        heartbeat(i)
    return (time.perf_counter() - started) / CALLS

def clock(base):  # the anchor: a bare clock read in the same loop
    started = time.perf_counter()
    for i in range(base, base + CALLS):
        time.time()
    return (time.perf_counter() - started) / CALLS

per_call = {"documented": [], "by_name": [], "time": []}
for r in range(REPEATS):  # in turn, so a drift in the machine's speed hits each
    per_call["documented"].append(as_documented(3 * r * CALLS))
    per_call["by_name"].append(by_name((3 * r + 1) * CALLS))
    per_call["time"].append(clock(0))

a = np.random.default_rng(0).standard_normal((300, 300))

def work(reps):  # one step's compute
    for _ in range(reps):
        a @ a

def took(reps):
    started = time.perf_counter()
    work(reps)
    return time.perf_counter() - started

work(5)
reps = max(1, round(0.1 / statistics.median(took(10) / 10 for _ in range(5))))  # ~100 ms
with_beat, without = [], []
for step in range(2 * STEPS):  # in turn
    started = time.perf_counter()
    work(reps)
    if step % 2:
        heartbeat(step)
    (with_beat if step % 2 else without).append(time.perf_counter() - started)
result = {k + "_s": statistics.median(v) for k, v in per_call.items()}
result.update(step_with_s=statistics.median(with_beat), step_without_s=statistics.median(without),
              calls=CALLS, repeats=REPEATS, steps=STEPS)
print("result " + json.dumps(result), flush=True)
"""

# 256 namespaces' sshd on the same 2 cores as 256 Python programs: a host may take more than
# the default 5 s to start a command while the others start theirs
SIM_CONNECT_TIMEOUT_S = 30.0
STARTED = re.compile(r"^\[w(\d+)\]\s+blocking at ([\d.]+) pid (\d+)$")


class Run:
    """A ``tpupod run`` in the background, its output lines read as they come, timed."""

    def __init__(self, env: dict[str, str], argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str, str]] = []  # (time.time(), stream, text)
        self.readers = [
            threading.Thread(target=self._read, args=(stream, name), daemon=True)
            for stream, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream: object, name: str) -> None:
        for text in stream:  # type: ignore[attr-defined]
            self.lines.append((time.time(), name, text.rstrip("\n")))

    def started(self) -> dict[int, tuple[float, int]]:
        """worker -> (the time it blocked, its pid), from its 'blocking at' line."""
        found = {}
        for _, _, text in list(self.lines):
            match = STARTED.match(text)
            if match:
                found[int(match[1])] = (float(match[2]), int(match[3]))
        return found

    def wait_blocked(self, workers: int, timeout: float) -> dict[int, tuple[float, int]]:
        deadline = time.monotonic() + timeout
        while len(found := self.started()) < workers:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.fail(f"{len(found)} of {workers} workers blocked")
            time.sleep(0.05)
        return found

    def first_line(self, pattern: str) -> float | None:
        return next((at for at, _, text in list(self.lines) if re.search(pattern, text)), None)

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(5)
        return code

    def stop(self) -> None:
        """Ctrl-C, as a user stops it (the launcher stops its workers)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.finish(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.finish(10)

    def fail(self, why: str) -> None:
        tail = "\n".join(text for _, _, text in self.lines[-20:])
        self.stop()
        raise RuntimeError(f"{why}; the run's last lines:\n{tail}")


def tpupod(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [TPUPOD, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tpupod {' '.join(args[:3])} failed: {proc.stderr[-1000:]}")
    return proc.stdout


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed: {proc.stderr[-1000:]}")
    return took


def program(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


def hang_to_digest(
    env: dict[str, str], pod: str, script: str, workers: int, timeout_s: int
) -> dict[str, float]:
    """One hang named by the watchdog: seconds from the last progress to the watchdog's
    notice and to the digest's last line, and the whole run."""
    argv = [TPUPOD, "run", "--pod", pod, "--hang-timeout", f"{timeout_s}s", "--", PYTHON, script]
    run = Run(env, argv)
    blocked = max(at for at, _ in run.wait_blocked(workers, 600).values())
    code = run.finish(timeout_s + 300)
    fired = run.first_line(r"^tpupod: hung: no worker progressed .*taking")
    shown = run.first_line(r"^tpupod: stacks saved in ")
    digest = [t for _, s, t in run.lines if s == "err" and re.match(r"^tpupod:   w\d", t)]
    if code != 124 or fired is None or shown is None:
        tail = "\n".join(text for _, _, text in run.lines[-20:])
        raise RuntimeError(f"the run did not end hung (exit {code}):\n{tail}")
    last = f"w{workers - 1} (1 of {workers})"
    if not digest or not digest[0].startswith(f"tpupod:   {last}"):
        raise RuntimeError(f"the digest does not lead with {last}: {digest}")
    return {"fired": fired - blocked - timeout_s, "digest": shown - blocked - timeout_s}


@contextmanager
def blocked_run(env: dict[str, str], pod: str, script: str, workers: int) -> Iterator[Run]:
    """The blocking program running (no watchdog) until the block ends."""
    run = Run(env, [TPUPOD, "run", "--pod", pod, "--", PYTHON, script])
    try:
        run.wait_blocked(workers, 600)
        yield run
    finally:
        run.stop()


def stacks_every_worker(
    env: dict[str, str], pod: str, script: str, workers: int, runs: int
) -> tuple[list[float], list[float]]:
    """Wall seconds of ``tpupod stacks`` (a fresh CLI process) of every worker, and of
    ``tpupod exec -- true`` on every worker (any fan-out's cost), in turn."""
    with blocked_run(env, pod, script, workers):
        argv = [TPUPOD, "stacks", "--pod", pod]
        anchor = [TPUPOD, "exec", "-q", "--pod", pod, "--", "true"]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
        if len(lines) != 2 or not lines[0].startswith(f"w{workers - 1} (1 of {workers}): "):
            raise RuntimeError(f"unexpected digest: {out}")
        timed(anchor, env)  # the connection holder up, as the stacks command found it
        samples: tuple[list[float], list[float]] = ([], [])
        for _ in range(runs):
            samples[0].append(timed(argv, env))
            samples[1].append(timed(anchor, env))
        return samples


def stacks_one_process(
    env: dict[str, str], pod: str, script: str, workers: int, runs: int
) -> dict[str, list[float]]:
    """``tpupod stacks -w 0`` beside ``py-spy dump --pid P`` of the same process (and
    ``tpupod exec -w 0 -- true``, what any fan-out to one worker costs), in turn."""
    with blocked_run(env, pod, script, workers) as run:
        pid = run.started()[0][1]
        commands = {
            "tpupod stacks -w 0 (fresh CLI process)": [
                TPUPOD, "stacks", "--pod", pod, "-w", "0",
            ],
            "tpupod exec -w 0 -- true (the fan-out alone)": [
                TPUPOD, "exec", "-q", "--pod", pod, "-w", "0", "--", "true",
            ],
            "tpupod --help (the CLI's start alone)": [TPUPOD, "--help"],
            "py-spy dump --pid P, by hand": [PY_SPY, "dump", "--pid", str(pid)],
        }  # fmt: skip
        samples: dict[str, list[float]] = {label: [] for label in commands}
        for i in range(runs + 1):
            for label, argv in commands.items():
                took = timed(argv, env)
                if i:  # the first round warms the page cache
                    samples[label].append(took)
        return samples


def heartbeat_cost(env: dict[str, str], pod: str, folder: Path) -> dict[str, float]:
    script = program(folder, "heartbeat.py", HEARTBEAT)
    out = tpupod(env, "run", "--pod", pod, "-w", "0", "--", PYTHON, script, timeout=600)
    line = next(t for t in out.splitlines() if "result " in t)
    return dict(json.loads(line.split("result ", 1)[1]))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def print_hang_row(size: str, program_name: str, rows: list[dict[str, float]], t: int) -> None:
    fired = statistics.median(r["fired"] for r in rows)
    digest = statistics.median(r["digest"] for r in rows)
    worst = max(r["digest"] for r in rows)
    print(
        f"| {size} | {program_name} | {t} | {len(rows)} | {ms(fired)} | {ms(digest - fired)} | "
        f"{ms(digest)} | {ms(worst)} |",
        flush=True,
    )


def measure_pod(  # noqa: PLR0917 (each is the measurement's own)
    env: dict[str, str],
    pod: str,
    size: str,
    workers: int,
    args: argparse.Namespace,
    folder: Path,
    hang_timeout: int,
) -> None:
    tpupod(env, "exec", "-q", "--pod", pod, "--", "true")  # every connection open, as in use
    scripts = {"plain": program(folder, "blocking.py", BLOCKING)}
    if workers == 4 and not args.no_jax:
        scripts["JAX"] = program(folder, "jax_blocking.py", JAX_BLOCKING)
    for name, script in scripts.items():
        rows = [hang_to_digest(env, pod, script, workers, hang_timeout) for _ in range(args.runs)]
        print_hang_row(size, name, rows, hang_timeout)
        walls = stacks_every_worker(env, pod, script, workers, args.runs)
        STACKS_ROWS.append((size, name, walls))


STACKS_ROWS: list[tuple[str, str, tuple[list[float], list[float]]]] = []


def main() -> None:  # noqa: PLR0915 (one run, its tables in order)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local", type=int, nargs="*", default=[4, 64], help="local pod sizes")
    parser.add_argument("--sim", type=int, nargs="*", default=[256], help="simulated SSH hosts")
    parser.add_argument("--runs", type=int, default=5, help="runs of each measurement")
    parser.add_argument("--hang-timeout", type=int, default=10, help="seconds, local pods")
    parser.add_argument(
        "--sim-hang-timeout",
        type=int,
        default=60,
        help="seconds, simulated pods (256 programs take more than 10 s to meet on 2 cores)",
    )
    parser.add_argument("--no-jax", action="store_true", help="skip the 4-worker JAX program")
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    spy = subprocess.run([PY_SPY, "--version"], capture_output=True, text=True, check=True)
    print(f"{spy.stdout.strip()}; {args.runs} runs of each")
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-hang-") as tmp:
        folder = Path(tmp)
        os.environ["TPUPOD_HOME"] = str(folder / "home")
        env = {**os.environ, "TPUPOD_HOLDER_IDLE": "600"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        print("\n| workers | program | T s | runs | to the notice - T, ms | stacks + digest ms | "
              "to the digest - T, ms (median) | worst ms |")  # fmt: skip
        print("|---|---|--:|--:|--:|--:|--:|--:|")
        for count in args.local:
            pod = f"local{count}"
            tpupod(env, "up", "--name", pod, "--local", str(count))
            try:
                measure_pod(env, pod, f"{count} local", count, args, folder, args.hang_timeout)
                if count == min(args.local):
                    one = stacks_one_process(env, pod, str(folder / "blocking.py"), count, 15)
                    beat = heartbeat_cost(env, pod, folder)
            finally:
                tpupod(env, "down", "--pod", pod)
        for count in args.sim:
            with SimPod(count) as sim:
                pod = f"sim{count}"
                sim_pod(sim, pod, connect_timeout=SIM_CONNECT_TIMEOUT_S)
                print(f"(simulated pod of {count} hosts up in {sim.startup_s:.0f}s)", flush=True)
                try:
                    measure_pod(
                        env,
                        pod,
                        f"{count} simulated SSH",
                        count,
                        args,
                        folder,
                        args.sim_hang_timeout,
                    )
                finally:
                    stop_holder(StateDir(), pod)
                    tpupod(env, "down", "--pod", pod)
        print("\n| workers | program | tpupod stacks, every worker: median ms | max ms | "
              "tpupod exec -- true, every worker: median ms | stacks vs exec |")  # fmt: skip
        print("|---|---|--:|--:|--:|--:|")
        for size, name, (walls, execs) in STACKS_ROWS:
            wall, anchor = statistics.median(walls), statistics.median(execs)
            print(f"| {size} | {name} | {ms(wall)} | {ms(max(walls))} | {ms(anchor)} | "
                  f"{wall / anchor:.1f}x |")  # fmt: skip
        if args.local:
            anchor = statistics.median(one["py-spy dump --pid P, by hand"])
            print("\n| one process (15 runs, in turn) | median ms | vs py-spy by hand |")
            print("|---|--:|--:|")
            for label, samples in one.items():
                median = statistics.median(samples)
                print(f"| {label} | {ms(median)} | {median / anchor:.2f}x |")
            clock = beat["time_s"] * 1e9
            with_s, without_s = beat["step_with_s"], beat["step_without_s"]
            print(f"\n| per call (median of {beat['repeats']} x {beat['calls']:,}) | ns | "
                  "vs time.time() |")  # fmt: skip
            print("|---|--:|--:|")
            for label, key in (
                ("tpupod.heartbeat(step)", "documented_s"),
                ("heartbeat(step), imported by name", "by_name_s"),
            ):
                per_call = beat[key] * 1e9
                print(f"| {label} | {per_call:.0f} | {per_call / clock:.2f}x |")
            print(f"| time.time() | {clock:.0f} | 1.00x |")
            print(f"\n| 100 ms step ({beat['steps']} of each, in turn) | median ms |")
            print("|---|--:|")
            print(f"| with a heartbeat | {with_s * 1000:.2f} |")
            print(f"| without | {without_s * 1000:.2f} |")
            print(f"| difference | {(with_s / without_s - 1) * 100:+.2f} % |")
            print(f"| one call's cost / step | {beat['documented_s'] / without_s * 100:.4f} % |")


if __name__ == "__main__":
    main()
