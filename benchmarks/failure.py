"""How long a multi-process JAX run goes on after one worker fails.

    .venv/bin/python benchmarks/failure.py --runs 5

Three local workers (2 CPU devices each) start JAX's distributed runtime;
then worker 1 fails (an exception, ``sys.exit(3)``, ``os._exit(3)``, or
SIGKILL) while the others compute. Measured: seconds from the failure (the
worker prints the time just before it) to the end of every process.

* ``tpupod run``: the launcher's exit (it ends when every worker has ended).
* by hand (the anchor, in the same run): the same program as three
  background processes with their identity in the environment, the way the
  seed runbooks start them; the time until every process has exited, capped
  at ``--cap`` seconds (JAX's own heartbeat timeout is 100 s).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import TPUPOD

from tpupod.pod.lifecycle import up
from tpupod.pod.spec import LocalPodSpec
from tpupod.pod.state import StateDir

FAILURES = {
    "exception": "raise ValueError('bad shard')",
    "sys.exit(3)": "sys.exit(3)",
    "os._exit(3)": "os._exit(3)",
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
}
PROGRAM = """
import os, signal, sys, time
{init}
import jax
jax.devices()
if {me} == 1:
    time.sleep(0.5)
    print(f"failing at {{time.time()}}", flush=True)
    {failure}
time.sleep(120)
"""
TPUPOD_INIT = "import tpupod; me = tpupod.init_jax().id"
BY_HAND_INIT = (
    "import jax; me = int(os.environ['I']); "
    "jax.config.update('jax_cpu_collectives_implementation', 'gloo'); "
    "jax.distributed.initialize(os.environ['COORD'], 3, me)"
)


def failed_at(path: Path) -> float:
    for line in path.read_text().splitlines():
        if "failing at " in line:
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no worker failed: {path.read_text()[-2000:]}")


def with_tpupod(pod: str, failure: str, env: dict[str, str]) -> float:
    program = PROGRAM.format(init=TPUPOD_INIT, me="me", failure=FAILURES[failure])
    with tempfile.NamedTemporaryFile("w+", suffix=".out") as out:
        argv = [TPUPOD, "run", "--pod", pod, "--", sys.executable, "-c", program]
        subprocess.run(
            argv, check=False, stdout=out, stderr=subprocess.DEVNULL, env=env, timeout=300
        )
        ended = time.time()
        return ended - failed_at(Path(out.name))


def by_hand(failure: str, cap: float) -> float:
    """Three background processes; seconds until all ended (``cap`` if some still run then)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    program = PROGRAM.format(init=BY_HAND_INIT, me="me", failure=FAILURES[failure])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
    env["COORD"] = f"127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", suffix=".out") as out:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", program],
                stdout=out,
                stderr=subprocess.DEVNULL,
                env={**env, "I": str(i)},
                start_new_session=True,
            )
            for i in range(3)
        ]
        deadline = time.monotonic() + 60 + cap
        while "failing at" not in Path(out.name).read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        start = failed_at(Path(out.name))
        while any(p.poll() is None for p in procs) and time.time() - start < cap:
            time.sleep(0.05)
        seconds = min(cap, time.time() - start)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cap", type=float, default=30.0)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="tpupod-bench-")
    env = {**os.environ, "TPUPOD_HOME": home}
    os.environ["TPUPOD_HOME"] = home
    up(LocalPodSpec(name="bench", workers=3, devices_per_worker=2), StateDir())
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"medians of {args.runs} runs (tpupod) and 1 run (by hand, capped at {args.cap:g} s)\n")
    print("| worker 1 fails by | tpupod run: failure to end, s | by hand, s | ratio |")
    print("|---|--:|--:|--:|")
    for failure in FAILURES:
        ours = statistics.median(with_tpupod("bench", failure, env) for _ in range(args.runs))
        anchor = by_hand(failure, args.cap)
        capped = anchor >= args.cap
        shown = f">= {anchor:.0f} (still running)" if capped else f"{anchor:.2f}"
        ratio = f"{'<= ' if capped else ''}{ours / anchor:.3f}"
        print(f"| {failure} | {ours:.2f} | {shown} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
