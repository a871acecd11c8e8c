"""Supervision of `tpupod run`: a failing worker ends the run in seconds, a killed launcher
leaves nothing behind, and the summary says what really ended each process."""

from __future__ import annotations

import asyncio
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult, sim_leftovers, tpupod_argv
from tests.test_launch import needs_jax
from tpupod.pod.record import Pod
from tpupod.sim import SimPod

PYTHON = sys.executable
JAX_ENV = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}

# Every worker joins JAX, then one fails while the others compute (or sit in a collective
# with it); each prints when it fails, so the test can time the end of the run from there.
FAILING = """
import os, signal, sys, time
import tpupod
me = tpupod.init_jax()
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
jax.devices()
print("initialized", flush=True)
if me.id == {worker}:
    time.sleep(0.5)
    print(f"failing at {{time.time()}}", flush=True)
    {failure}
elif {in_collective}:
    multihost_utils.sync_global_devices("never")
time.sleep(120)
"""

FAILURES = {
    "exception": ("raise ValueError('bad shard 7')", 1, "ValueError: bad shard 7"),
    "sys.exit": ("sys.exit(3)", 3, "sys.exit(3)"),
    "os._exit": ("os._exit(3)", 3, "exit 3"),
    "SIGKILL": ("os.kill(os.getpid(), signal.SIGKILL)", 137, "killed by SIGKILL"),
}


def run_failing(
    cli: Callable[..., CliResult], pod: Pod, worker: int, failure: str, in_collective: bool = False
) -> tuple[CliResult, float]:
    code = FAILURES[failure][0]
    program = FAILING.format(worker=worker, failure=code, in_collective=in_collective)
    result = cli("run", "--pod", pod.name, "--", PYTHON, "-c", program, timeout=120)
    failed_at = float(re.findall(r"failing at ([0-9.]+)", result.out)[0])
    return result, time.time() - failed_at  # cli() returns once the launcher has exited


def check_summary(result: CliResult, pod: Pod, worker: int, failure: str) -> None:
    _, code, shown = FAILURES[failure]
    assert result.code == code, result.err[-3000:]
    first = re.findall(r"^first failure: (.*)$", result.err, re.MULTILINE)
    assert len(first) == 1 and first[0].startswith(f"w{worker} "), result.err[-3000:]
    assert shown in first[0]
    rows = {line.split()[0]: line for line in result.err.splitlines() if re.match(r"w\d+ ", line)}
    for other in range(len(pod.workers)):
        if other != worker:  # stopped by us, or ended by JAX itself after w{worker} died
            row = rows[f"w{other}"]
            stopped = f"stopped after w{worker} failed" in row
            assert stopped or "killed by SIGABRT" in row, result.err[-3000:]
    assert "Traceback" not in _tpupod_lines(result.err)


def _tpupod_lines(err: str) -> str:
    """What tpupod itself printed: everything but the workers' own [wN] lines."""
    return "\n".join(line for line in err.splitlines() if not line.startswith("[w"))


def make_jax_pod(kind: str, request: pytest.FixtureRequest) -> Pod:
    """3 local workers x 2 devices, or 2 simulated SSH hosts x 2 CPU devices."""
    if kind == "local":
        pod: Pod = request.getfixturevalue("make_pod")(3, devices=2)
    else:
        pod = request.getfixturevalue("make_ssh_pod")(2, env=JAX_ENV)
    return pod


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("worker", ["first", "other"])
@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_a_worker_failing_after_init_jax_ends_the_run_in_seconds(
    kind: str,
    worker: str,
    failure: str,
    request: pytest.FixtureRequest,
    cli: Callable[..., CliResult],
    leftovers: Callable[[Pod], list[str]],
) -> None:
    needs_jax()
    pod = make_jax_pod(kind, request)
    failing = 0 if worker == "first" else len(pod.workers) - 1
    result, seconds = run_failing(cli, pod, failing, failure)
    check_summary(result, pod, failing, failure)
    assert seconds < 5, f"the run ended {seconds:.1f}s after w{failing} failed"
    assert leftovers(pod) == []


def test_a_failure_while_the_others_wait_in_a_collective_blames_the_failing_worker(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    needs_jax()
    pod = make_pod(3, devices=1)
    result, seconds = run_failing(cli, pod, 1, "SIGKILL", in_collective=True)
    check_summary(result, pod, 1, "SIGKILL")
    assert seconds < 5


def test_a_worker_that_finishes_early_is_not_a_failure(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    needs_jax()
    pod = make_pod(2, devices=1)
    program = (
        "import time, tpupod; me = tpupod.init_jax(); import jax; jax.devices(); "
        "time.sleep(0 if me.id == 1 else 3); print('done', me.id)"
    )
    result = cli("run", "--pod", pod.name, "--", PYTHON, "-c", program, timeout=120)
    assert result.code == 0, result.err[-2000:]
    assert "2/2 ok" in result.err


def test_a_worker_that_ignores_term_is_reported_as_killed_after_term(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    program = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    result = cli(
        "run", "--pod", pod.name, "--timeout", "1", "--grace", "1", "--", PYTHON, "-c", program
    )
    assert result.code == 124
    rows = [line for line in result.err.splitlines() if re.match(r"w\d+ ", line)]
    assert len(rows) == 2
    assert all("timed out (killed by SIGKILL after TERM)" in row for row in rows), result.err


def test_a_timed_out_run_says_it_timed_out_and_names_no_first_failure(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(3)
    result = cli("run", "--pod", pod.name, "--timeout", "1", "--", "echo working; sleep 60")
    assert result.code == 124
    assert "first failure" not in result.err, result.err
    assert "timed out: w0, w1, w2 did not finish in time" in result.err


def test_a_timed_out_jax_run_ends_without_a_traceback(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    needs_jax()
    pod = make_pod(2, devices=1)
    program = "import time, tpupod; tpupod.init_jax(); import jax; jax.devices(); time.sleep(60)"
    result = cli("run", "--pod", pod.name, "--timeout", "4", "--", PYTHON, "-c", program)
    assert result.code == 124, result.err[-2000:]
    assert result.seconds < 15
    assert "Traceback" not in result.err and "CancelledError" not in result.err


def test_no_stopping_notice_when_every_worker_already_ended(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    # Both exit at once, while a background child keeps their output open (read for 2 s more).
    result = cli("exec", "--pod", pod.name, "--on-fail", "kill", "--", "sleep 3 & exit 5")
    assert result.code == 5
    assert "stopping" not in result.err


# w1 fails as after init_jax (supervised: it tells the launcher before its process ends);
# the others do what JAX workers in a collective do when a peer vanishes: a burst of gloo
# "Connection closed" tracebacks, faster than any stop (they ignore TERM, as JAX does).
COLLATERAL = """
import os, pathlib, signal, sys, time
me = int(os.environ["TPUPOD_WORKER_ID"])
flag = pathlib.Path(sys.argv[1])
if me == 1:
    from tpupod.launch.client import client
    client()
    # fail once the others ignore TERM (a TERM before that ended one at once, unprinted)
    while not all(flag.with_name(f"ignores-term-{w}").exists() for w in (0, 2)):
        time.sleep(0.001)
    flag.write_text(str(os.getpid()))
    raise ValueError("bad shard 7")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
flag.with_name(f"ignores-term-{me}").touch()
print("step 1", flush=True)
def alive(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while not flag.exists() or not flag.read_text() or alive(int(flag.read_text())):
    time.sleep(0.001)
for i in range(25):
    print("jaxlib.xla_extension.XlaRuntimeError: Gloo error: Connection closed by peer",
          file=sys.stderr)
sys.exit(1)
"""


def test_the_others_collateral_failures_stay_in_their_logs(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(3)
    flag = str(tmp_path / "w1-pid")
    result = cli("run", "--pod", pod.name, "--", PYTHON, "-c", COLLATERAL, flag)
    assert result.code == 1, result.err
    assert "[w1] ValueError: bad shard 7" in result.err
    assert "first failure: w1 " in result.err and "ValueError: bad shard 7" in result.err
    assert "Connection closed" not in result.out + result.err, result.err
    assert "w0, w2 printed 50 more lines after w1 failed, kept in the logs" in result.err
    # the hint names each worker's log, not w0's alone (a trial)
    assert re.search(r"'tpupod logs \S+ -w 0', 'tpupod logs \S+ -w 2'\n", result.err), result.err
    rows = [line for line in result.err.splitlines() if line.startswith(("w0 ", "w2 "))]
    assert len(rows) == 2 and all(row.endswith("step 1") for row in rows), result.err
    logs = cli("logs", "--pod", pod.name, "-w", "0")
    assert logs.out.count("Connection closed by peer") == 25


def test_a_caller_that_keeps_every_line_gets_the_collateral_too(
    make_pod: Callable[..., Pod], tmp_path: Path
) -> None:
    """A job's log (``jobs/execute.py``) is every line: only a terminal leaves them out."""
    from tpupod.fanout.context import Context, Sinks
    from tpupod.launch.run import run

    pod = make_pod(3)
    seen: list[tuple[int, str]] = []
    command = shlex.join([PYTHON, "-c", COLLATERAL, str(tmp_path / "w1-pid")])

    async def launch() -> Any:
        sinks = Sinks(lambda w, line: seen.append((w.id, line.text)))
        async with Context(pod, sinks) as ctx:
            return await run(ctx, command)

    done = asyncio.run(launch())
    assert done.fanout.first_failure is not None and done.fanout.first_failure.worker.id == 1
    closed = [worker for worker, text in seen if "Connection closed by peer" in text]
    assert sorted(closed) == [0] * 25 + [2] * 25


# -- a killed launcher ----------------------------------------------------------------

LAUNCHER_STAGES = {
    # killed at once: while preflight probes the workers, or just after
    "preflight": "echo never",
    # killed while workers wait at the pre_jax_init barrier for a worker that is late
    "barrier": (
        "import os, time, tpupod; me = tpupod.worker(); print('started', flush=True); "
        "time.sleep(30 if me.id == 1 else 0); tpupod.init_jax(); time.sleep(60)"
    ),
    # killed mid-run, JAX initialized everywhere (JAX ignores TERM)
    "mid-run": (
        "import time, tpupod; tpupod.init_jax(); import jax; jax.devices(); "
        "print('started', flush=True); time.sleep(60)"
    ),
}


@pytest.mark.parametrize("stage", sorted(LAUNCHER_STAGES))
@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_nothing_outlives_a_killed_launcher(
    kind: str,
    stage: str,
    request: pytest.FixtureRequest,
    leftovers: Callable[[Pod], list[str]],
    cli: Callable[..., CliResult],
) -> None:
    needs_jax()
    pod = make_jax_pod(kind, request)
    program = LAUNCHER_STAGES[stage]
    argv = [
        "run",
        "--pod",
        pod.name,
        "--",
        *([PYTHON, "-c", program] if stage != "preflight" else [program]),
    ]
    launcher = subprocess.Popen(
        tpupod_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert launcher.stdout is not None
    if stage == "preflight":
        time.sleep(0.3)
    else:
        assert "started" in launcher.stdout.readline()
        if stage == "mid-run":
            assert all("started" in launcher.stdout.readline() for _ in pod.workers[1:])
    launcher.send_signal(signal.SIGKILL)
    launcher.communicate()
    killed_at = time.monotonic()
    assert leftovers(pod) == []  # waits up to 3 s: the guard's grace is 3 s, JAX ignores TERM
    assert time.monotonic() - killed_at < 5
    again = cli("run", "--pod", pod.name, "--", "echo again", timeout=60)
    assert again.code == 0, again.err[-2000:]


def test_the_run_folder_records_the_reported_failure(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    needs_jax()
    pod = make_pod(2, devices=1)
    result, _ = run_failing(cli, pod, 1, "exception")
    assert result.code == 1
    logs = cli("logs", "--pod", pod.name, "--worker", "1")
    assert "ValueError: bad shard 7" in logs.out


def test_a_failure_ends_the_run_when_the_rendezvous_runs_on_worker_0(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult], sim: SimPod
) -> None:
    needs_jax()
    pod = make_ssh_pod(2, env=JAX_ENV)
    program = FAILING.format(worker=1, failure=FAILURES["exception"][0], in_collective=False)
    argv = ["run", "--pod", pod.name, "--rendezvous-on", "worker0", "--worker-python", PYTHON]
    result = cli(*argv, "--", PYTHON, "-c", program, timeout=120)
    failed_at = float(re.findall(r"failing at ([0-9.]+)", result.out)[0])
    check_summary(result, pod, 1, "exception")
    assert time.time() - failed_at < 5
    assert sim_leftovers(sim) == []
