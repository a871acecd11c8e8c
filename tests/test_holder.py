"""The connection holder behind `tpupod exec` on SSH pods, and the fast path that reaches it."""

from __future__ import annotations

import gc
import os
import shlex
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, sim_leftovers, tpupod_argv
from tpupod.cli.flow.exec import ExecArgs, parse_plain, plan_exec, run_held
from tpupod.holder import socket_path
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod


def holder_pid(pod: Pod) -> int | None:
    path = socket_path(StateDir().pod_dir(pod.name))
    if not path.exists():
        return None
    out = subprocess.run(["fuser", str(path)], capture_output=True, text=True, check=False).stdout
    pids = [int(p) for p in out.split()]
    return pids[0] if pids else None


def test_exec_starts_one_holder_and_reuses_it(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod()
    first = cli("exec", "--pod", pod.name, "--", "hostname")
    assert first.code == 0, first.err
    pid = holder_pid(pod)
    assert pid is not None
    again = [cli("exec", "-q", "--pod", pod.name, "--", "true") for _ in range(3)]
    assert all(r.code == 0 for r in again)
    assert holder_pid(pod) == pid
    assert min(r.seconds for r in again) < first.seconds


def test_down_stops_the_holder(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod()
    assert cli("exec", "-q", "--pod", pod.name, "--", "true").code == 0
    pid = holder_pid(pod)
    assert pid is not None
    assert cli("down", "--pod", pod.name).code == 0
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


def test_an_idle_holder_exits(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod()
    assert (
        cli("exec", "-q", "--pod", pod.name, "--", "true", env={"TPUPOD_HOLDER_IDLE": "0.5"}).code
        == 0
    )
    pid = holder_pid(pod)
    assert pid is not None
    deadline = time.monotonic() + 8
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


def test_a_killed_client_leaves_nothing_running(
    make_ssh_pod: Callable[..., Pod], sim: SimPod, state_home: Path
) -> None:
    pod = make_ssh_pod()
    proc = subprocess.Popen(
        tpupod_argv("exec", "--pod", pod.name, "--grace", "1", "--", "echo started; sleep 60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert all("started" in proc.stdout.readline() for _ in range(4))
    proc.kill()  # no chance to say goodbye: the holder sees the socket close
    proc.communicate()
    assert sim_leftovers(sim) == []


def test_without_the_holder(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod()
    result = cli("exec", "--pod", pod.name, "--", "hostname", env={"TPUPOD_HOLDER": "0"})
    assert result.code == 0 and "4/4 ok" in result.err
    assert holder_pid(pod) is None


def test_a_stale_holder_is_replaced(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod()
    assert cli("exec", "-q", "--pod", pod.name, "--", "true").code == 0
    record = StateDir().pod_dir(pod.name) / "pod.json"
    os.utime(record, ns=(time.time_ns(), time.time_ns() + 10**9))  # the record changed
    result = cli("exec", "-q", "--pod", pod.name, "--", "true")
    assert result.code == 0, result.err


@pytest.mark.parametrize(
    "line",
    [
        "-- hostname",
        "-q -- echo hi",
        "--pod dev -w 0,2 --on-fail kill -t 5 --grace 1 -e A=1 -e B=x=y -- echo $A",
        "--pod=dev --worker=1-3 --timeout=2.5 ls -la /",
        "-w 0 python train.py --steps 3",
        "-v -q --verbose -- true",
    ],
)
def test_the_fast_parser_agrees_with_the_cli(line: str) -> None:
    args = parse_plain(shlex.split(line))
    assert args is not None
    from typer.testing import CliRunner

    from tpupod.cli import exec as exec_module
    from tpupod.cli.app import app

    seen: dict[str, ExecArgs] = {}

    def capture(parsed: ExecArgs, in_image: object = None) -> None:
        assert in_image is None
        seen["args"] = parsed

    original = exec_module.run_exec
    exec_module.run_exec = capture  # type: ignore[assignment]
    try:
        result = CliRunner().invoke(app, ["exec", *shlex.split(line)])
    finally:
        exec_module.run_exec = original
    assert result.exit_code == 0, result.output
    assert seen["args"] == args


@pytest.mark.parametrize(
    "line", ["--help", "-- ", "--bogus -- x", "-t 0 -- x", "-e NOPE -- x", "-w"]
)
def test_unusual_arguments_go_to_the_full_cli(line: str) -> None:
    assert parse_plain(shlex.split(line)) is None


@pytest.mark.timeout(60)
def test_a_forward_comes_back_on_its_port_after_its_connection_drops(
    make_ssh_pod: Callable[..., Pod], sim: SimPod, cli: Callable[..., CliResult]
) -> None:
    from tpupod.holder.client import close_forward, forward_port

    pod = make_ssh_pod(workers=1)
    assert cli("exec", "-q", "--pod", pod.name, "--", "true").code == 0  # starts the holder
    port = 18765  # inside host 0's own network namespace: nothing else listens there
    server = f"{sys.executable} -m http.server {port} --bind 127.0.0.1 --directory /"
    sim.run_on(0, f"setsid {server} </dev/null >/dev/null 2>&1 &")
    try:
        assert _eventually(lambda: _answers(sim, port)), "the test's server did not start"
        local = forward_port(StateDir(), pod.name, worker=0, host="127.0.0.1", port=port)
        assert _fetch(local) == 200
        # Every SSH session to the host ends at once (as when sshd restarts): the holder's
        # connection, and the forward over it, are gone.
        sim.run_on(0, "pkill -KILL -f '^sshd: '")
        assert _eventually(lambda: _fetch(local) == 200), "the forward did not come back"
        again = forward_port(StateDir(), pod.name, worker=0, host="127.0.0.1", port=port)
        assert again == local  # the same port, as the exported endpoint promised
        close_forward(StateDir(), pod.name, worker=0, host="127.0.0.1", port=port)
    finally:
        sim.run_on(0, f"pkill -f 'http.server {port}'")


def _answers(sim: SimPod, port: int) -> bool:
    probe = sim.run_on(0, f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}'", timeout=5)
    return probe.returncode == 0


def _fetch(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=3) as answer:
            return int(answer.status)
    except OSError:
        return 0


def _eventually(check: Callable[[], bool], within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_an_in_process_start_of_the_holder_leaves_no_running_popen_behind(
    make_ssh_pod: Callable[..., Pod],
) -> None:
    """The holder outlives the process that starts it. In a long-lived process (a test's,
    the dashboard's) its Popen used to be collected while the holder ran: a ResourceWarning
    ("subprocess N is still running") that failed whichever test the collection fell in."""
    pod = make_ssh_pod()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_plain(["-q", "--pod", pod.name, "--", "true"])
        assert args is not None
        state = StateDir()
        assert run_held(state, plan_exec(args, state), args).exit_code() == 0
        assert holder_pid(pod) is not None
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
