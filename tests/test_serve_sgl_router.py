"""``serve up --router sgl``: sgl-router (the real ``sglang-router`` package) in front of the
fleet, started, watched and stopped through the agent's ctl like the builtin router.

The servers are ``tests/serve_stub.py`` run by the ``command`` backend (real processes, so
kill -9 and the agent's restarts are real); the client is the real ``openai`` package.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    CliResult,
    free_base_port,
    openai_client,
    pod_processes,
    tpupod_argv,
)
from tpupod.errors import UsageError
from tpupod.pod.record import Pod
from tpupod.serve.backends import Backend
from tpupod.serve.fleet.record import up_options
from tpupod.serve.router.sgl import RETRIES, sgl_argv

STUB = Path(__file__).parent / "serve_stub.py"
STUB_COMMAND = f"{{python}} {STUB} --host {{host}} --port {{port}} --tokens 8"


def run_cli(home: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    return subprocess.run(
        tpupod_argv(*args), capture_output=True, text=True, timeout=timeout, env=env
    )


def router_processes(pod: str, groups: frozenset[int] = frozenset()) -> dict[int, str]:
    """Live router processes of the local pod, read from /proc (pid: process group, command
    line): the ``tpupod.serve.router.sgl`` process carries TPUPOD_POD=<pod>; its sgl-router
    child renames itself ``sglang::router`` over its command line and environment, so it is
    found in the groups of those (``groups``: ones seen before)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            env = (entry / "environ").read_bytes().split(b"\0")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ours = f"TPUPOD_POD={pod}".encode() in env and "router" in argv
            if ours or int(fields[2]) in groups:
                found[int(entry.name)] = f"{fields[2]}: {argv}"
    return found


# -- unit: options and sgl-router's command line --------------------------------------------


def test_each_router_takes_its_own_policies_and_sgl_defaults_to_cache_aware() -> None:
    assert up_options("command", None, "sgl", model="m").policy == "cache_aware"
    assert up_options("command", None, model="m").policy == "least_outstanding"
    with pytest.raises(UsageError, match="the sgl router has no policy 'least_outstanding'"):
        up_options("command", "least_outstanding", "sgl", model="m")
    with pytest.raises(UsageError, match="no router 'nginx'"):
        up_options("command", None, "nginx", model="m")
    with pytest.raises(UsageError, match="--hold 5 is the builtin router's"):
        up_options("command", None, "sgl", model="m", hold=5.0)
    with pytest.raises(UsageError, match="--hold -1"):
        up_options("command", None, model="m", hold=-1.0)


def test_hold_given_with_the_sgl_router_is_refused_even_at_the_builtins_default(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    """A new user's trial: `serve up --router sgl --hold 30` was taken, 30 being the
    builtin router's default, though sgl-router holds nothing."""
    pod = make_pod(1)
    refused = cli("serve", "up", "--pod", pod.name, "--router", "sgl", "--hold", "30",
                  "--backend", "command", "--model", "m", "--command", "serve {port}")  # fmt: skip
    assert refused.code == 2, refused
    assert "--hold 30 is the builtin router's" in refused.err, refused.err
    assert up_options("command", None, "sgl", model="m").hold == 30.0  # not given: fine


def test_sgl_routers_command_line_retries_and_binds_metrics_to_the_internal_address() -> None:
    argv = sgl_argv(
        "10.0.0.2", 9100, metrics_port=9101, backends=["10.0.0.2:31000", "10.0.0.3:31000"],
        policy="round_robin", health_interval=0.5,
    )  # fmt: skip

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--prometheus-host") == "10.0.0.2" and value("--prometheus-port") == "9101"
    assert value("--retry-max-retries") == str(RETRIES)
    assert value("--health-check-interval-secs") == "1"  # whole seconds only
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == ["http://10.0.0.2:31000", "http://10.0.0.3:31000"]
    assert "--api-key" not in argv  # the token goes in the child's environment


def test_a_fleet_recorded_before_router_existed_reads_as_the_builtin_router() -> None:
    """A record written before --router: the same serve up is the same fleet, and one with
    --router sgl names the difference."""
    from tpupod.serve.fleet.record import FleetRecord, differences, settings_of

    options = up_options("command", None, model="m", command="c")
    old = settings_of(options)
    del old["router"]
    record = FleetRecord(
        pod="p", model="m", backend=Backend.COMMAND, python="py", servers=[], router_host="h",
        router_port=9, token="t", started=0.0, settings=old,
    )  # fmt: skip
    assert record.router == "builtin" and record.options == settings_of(options)
    sgl = settings_of(up_options("command", None, "sgl", model="m", command="c"))
    assert differences(record.options, sgl) == (
        "--policy least_outstanding, now cache_aware; --router builtin, now sgl"
    )


# -- a local pod of 2 workers x 2 stub servers behind sgl-router ---------------------------


@dataclass
class SglFleet:
    home: Path
    pod: str
    base_url: str
    token: str


@contextlib.contextmanager
def local_pod(home: Path, pod: str) -> Iterator[None]:
    """A local pod of 2 workers (their agents take any free port) for the test; after it,
    its fleet and the pod go down and whatever of it still runs is killed."""
    assert run_cli(home, "up", "--name", pod, "--local", "2").returncode == 0
    try:
        yield
    finally:
        run_cli(home, "serve", "down", "--pod", pod)
        run_cli(home, "down", "--pod", pod)
        for proc in pod_processes(pod):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def serve_up(home: Path, pod: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``serve up --router sgl`` of stub servers on the pod, with ``args`` besides."""
    return run_cli(
        home, "serve", "up", "--pod", pod, "--model", "stub-model", "--backend", "command",
        "--command", STUB_COMMAND, "--router", "sgl", "--base-port", str(free_base_port()),
        "--startup-timeout", "60", *args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sgl_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglFleet]:
    home = tmp_path_factory.mktemp("sgl") / "state"
    pod = f"sgl{os.getpid()}"
    with local_pod(home, pod):
        up = serve_up(
            home, pod, "--servers-per-worker", "2", "--policy", "round_robin",
            "--health-interval", "1", "--restart-backoff", "0.2",
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        assert "sgl-router on w0 at http://" in up.stderr
        exports = run_cli(home, "serve", "endpoint", "--pod", pod).stdout.splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        yield SglFleet(home, pod, values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"])


def status_of(fleet: SglFleet) -> str:
    done = run_cli(fleet.home, "serve", "status", "--pod", fleet.pod)
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_for_status(fleet: SglFleet, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in (out := status_of(fleet)) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert text in out, out
    return out


def test_status_shows_sgl_router_its_health_and_its_backends(sgl_fleet: SglFleet) -> None:
    client = openai_client(sgl_fleet.base_url, sgl_fleet.token)
    for _ in range(8):
        answer = client.chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert (answer.choices[0].message.content or "").startswith("stub")
    out = wait_for_status(sgl_fleet, "4/4 backends healthy")
    assert re.search(r"^router \(sgl-router\): http://\S+ \(4/4 backends healthy; its /health: "
                     r"HTTP 200 OK; 0 restarts\)$", out, re.M), out  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.startswith("w")]
    assert len(rows) == 4 and all(r[3] == "ready" for r in rows), out
    assert sum(int(r[6]) for r in rows) >= 8, out  # sgl-router's own counts, per backend


def test_fanout_is_refused_in_one_line_sgl_router_has_no_registry(sgl_fleet: SglFleet) -> None:
    done = run_cli(sgl_fleet.home, "fanout", "--pod", sgl_fleet.pod, "--prompt", "hi")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == [
        f"error: the fleet on pod {sgl_fleet.pod!r} runs sgl-router, which has no registry of "
        "backends (/backends) to fan out to",
        "hint: serve up --router builtin for tpupod fanout, or --registry-url URL",
    ]


def test_a_request_without_the_fleets_token_is_refused(sgl_fleet: SglFleet) -> None:
    import openai

    client = openai_client(sgl_fleet.base_url, "wrong")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "hi"}]
        )


def test_a_backend_killed_under_load_fails_no_request_and_comes_back(
    sgl_fleet: SglFleet,
) -> None:
    """kill -9 of one of 4 servers while 8 clients send requests: sgl-router's retries send
    the requests it had for that server elsewhere (0 failed), its health checks take the
    server out, and the agent's restart brings it back into sgl-router's view."""
    out = wait_for_status(sgl_fleet, "4/4 backends healthy")
    victim = int(next(line.split()[4] for line in out.splitlines() if line.startswith("w1")))
    ok, failed = [0], []
    stop = threading.Event()
    killed = threading.Event()

    def load() -> None:
        client = openai_client(sgl_fleet.base_url, sgl_fleet.token, timeout=30.0)
        while not stop.is_set():
            try:
                client.chat.completions.create(
                    model="stub-model", messages=[{"role": "user", "content": "hi"}]
                )
                ok[0] += 1
            except Exception as exc:  # every failure is counted, with its reason
                failed.append(f"{'after' if killed.is_set() else 'before'} the kill: {exc!r}")

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while ok[0] < 40 and time.monotonic() < deadline:  # the load flows: then the kill
            time.sleep(0.05)
        before = ok[0]
        os.kill(victim, signal.SIGKILL)
        killed.set()
        time.sleep(5.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert before > 0 and ok[0] > before, (before, ok[0], failed[:3])
    assert failed == [], f"{len(failed)} of {ok[0] + len(failed)} failed: {failed[:3]}"
    back = wait_for_status(sgl_fleet, "4/4 backends healthy", timeout=90.0)
    row = next(line.split() for line in back.splitlines() if line.startswith("w1"))
    assert int(row[4]) != victim and int(row[5]) >= 1, back  # restarted by its agent


def test_serve_down_leaves_no_router_process(tmp_path: Path) -> None:
    """Its own fleet: up with --router sgl, then down; /proc holds no router of the pod
    (neither the respawn parent, tpupod.serve.router.sgl nor its sgl-router child)."""
    home = tmp_path / "state"
    pod = f"sgd{os.getpid()}"
    with local_pod(home, pod):
        up = serve_up(home, pod)
        assert up.returncode == 0, up.stderr
        wrappers = router_processes(pod)
        groups = frozenset(int(line.split(":")[0]) for line in wrappers.values())
        running = router_processes(pod, groups)
        # the respawn parent, the tpupod.serve.router.sgl wrapper, its child: one group
        assert len(wrappers) == 2 and len(groups) == 1 and len(running) == 3, running
        assert any("-m tpupod.serve.agent.respawn" in line for line in running.values()), running
        assert any("sglang::router" in line for line in running.values()), running
        down = run_cli(home, "serve", "down", "--pod", pod)
        assert down.returncode == 0 and "w0 router stopped" in down.stderr, down.stderr
        assert router_processes(pod, groups) == {}


def test_a_worker_python_without_sglang_router_is_one_line_with_the_install_hint(
    tmp_path: Path,
) -> None:
    """Worker 0's Python cannot import sglang_router (a package on its path shadows it as
    missing): serve up's preflight says so in one line with the hint, before any agent or
    server starts (a trial: after the servers were ready), and leaves nothing running. The
    router's respawn parent does not start again a router that never listened: the
    failure is told at once, not after ctl's 30 s wait for the router to listen."""
    shadow = tmp_path / "shadow" / "sglang_router"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'x'\")\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={shadow.parent} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    home = tmp_path / "state"
    pod = f"sgm{os.getpid()}"
    with local_pod(home, pod):
        began = time.monotonic()
        up = serve_up(home, pod, "--worker-python", str(python))
        took = time.monotonic() - began
        assert up.returncode != 0 and "Traceback" not in up.stderr, up.stderr
        assert took < 25, took  # ctl waits 30 s for a router that keeps starting
        said = up.stderr.splitlines()
        # found by the preflight, before anything starts (it was after the servers were up)
        assert not [line for line in said if line.startswith("tpupod: ")], up.stderr
        errors = said
        assert errors == [
            f"error: w0: sglang_router is not installed for {python}: --router sgl runs "
            "sgl-router there",
            "hint: pip install 'tpupod[sgl]' on the workers (or --router builtin)",
        ], up.stderr
        assert pod_processes(pod) == []  # a failed serve up leaves nothing
