"""Lockstep launch: identity, rendezvous, and `tpupod run` of a real multi-process JAX program."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, require, sim_leftovers, tpupod_argv
from tpupod.base import limits
from tpupod.errors import IdentityError
from tpupod.launch.identity import worker
from tpupod.launch.rendezvous import AsyncMember, RendezvousServer
from tpupod.pod.record import Pod
from tpupod.sim import SimPod

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "lockstep_sum.py"
PYTHON = sys.executable


# -- identity -------------------------------------------------------------------------


def no_metadata(key: str) -> str | None:
    return None


def test_identity_from_tpupod_variables() -> None:
    env = {
        "TPUPOD_WORKER_ID": "2",
        "TPUPOD_NUM_WORKERS": "4",
        "TPUPOD_WORKER_HOSTNAMES": "a,b,c,d",
        "TPUPOD_LAUNCH_ID": "L1",
        "TPUPOD_COORDINATOR": "a:8476",
        "TPUPOD_POD": "dev",
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "x",
    }
    found = worker(env, no_metadata)
    assert (found.id, found.count, found.hostnames, found.source) == (
        2,
        4,
        ("a", "b", "c", "d"),
        "tpupod",
    )
    assert (found.launch_id, found.coordinator, found.pod) == ("L1", "a:8476", "dev")


def test_identity_from_gke() -> None:
    found = worker({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "h0,h1,h2"}, no_metadata)
    assert (found.id, found.count, found.source) == (1, 3, "gke")


def test_identity_on_a_multislice_gke_jobset_is_global() -> None:
    """A multislice JobSet gives each worker its slice's TPU_WORKER_ID and hostnames, and
    MEGASCALE_*: the global id is JAX's (id in slice + slice x workers per slice), worker
    0 is slice 0's first, at MEGASCALE_COORDINATOR_ADDRESS's host."""
    env = {
        "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "s1-h0,s1-h1",
        "MEGASCALE_SLICE_ID": "1",
        "MEGASCALE_NUM_SLICES": "3",
        "MEGASCALE_COORDINATOR_ADDRESS": "s0-h0:8080",
    }
    found = worker(env, no_metadata)
    assert (found.id, found.count, found.slice, found.slices) == (3, 6, 1, 3)
    assert found.first_host == "s0-h0" and not found.is_coordinator
    with pytest.raises(IdentityError, match=r"MEGASCALE_SLICE_ID=3 is not in 0\.\.2"):
        worker({**env, "MEGASCALE_SLICE_ID": "3"}, no_metadata)


def test_identity_from_gce_metadata() -> None:
    data = {
        "agent-worker-number": "3",
        "worker-network-endpoints": "n:0:10.0.0.2,n:1:10.0.0.3,n:2:10.0.0.4,n:3:10.0.0.5",
    }
    found = worker({}, data.get)
    assert (found.id, found.count, found.source) == (3, 4, "gce-metadata")
    assert found.hostnames[3] == "10.0.0.5"


def test_a_single_host_is_worker_0_of_1() -> None:
    found = worker({}, None)
    assert (found.id, found.count, found.source) == (0, 1, "single-host")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CLOUD_TPU_TASK_ID": "0"}, "only CLOUD_TPU_TASK_ID=0 says which worker"),
        ({"TPU_WORKER_ID": "1"}, "only TPU_WORKER_ID=1 says which worker"),
        (
            {"TPUPOD_WORKER_ID": "x", "TPUPOD_NUM_WORKERS": "2"},
            "TPUPOD_WORKER_ID='x' is not a number",
        ),
        ({"TPUPOD_WORKER_ID": "4", "TPUPOD_NUM_WORKERS": "4"}, "worker id 4 is not in 0..3"),
        (
            {"TPUPOD_WORKER_ID": "0", "TPUPOD_NUM_WORKERS": "3", "TPUPOD_WORKER_HOSTNAMES": "a,b"},
            "TPUPOD_NUM_WORKERS=3 but TPUPOD_WORKER_HOSTNAMES lists 2 hosts",
        ),
    ],
)
def test_ambiguous_identity_is_an_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(IdentityError, match=message) as info:
        worker(env, no_metadata)
    assert info.value.hint


# -- rendezvous -----------------------------------------------------------------------


def registration(
    worker_id: int, launch_id: str = "L", token: str = "t", digest: str = "d"
) -> dict[str, object]:
    return {
        "token": token,
        "launch_id": launch_id,
        "worker": worker_id,
        "hostname": f"h{worker_id}",
        "pid": 100 + worker_id,
        "digest": digest,
    }


async def serve(
    count: int, events: list[str] | None = None
) -> tuple[RendezvousServer, tuple[str, int]]:
    server = RendezvousServer(
        "L", "t", count, on_event=(events.append if events is not None else None)
    )
    return server, await server.start("127.0.0.1")


def test_refusals_are_clear_on_both_sides() -> None:
    async def go() -> list[str]:
        events: list[str] = []
        server, address = await serve(2, events)
        first, ok = await AsyncMember.join(address, registration(0))
        assert ok == {"ok": True, "count": 2}
        a, other_launch = await AsyncMember.join(address, registration(1, launch_id="OTHER"))
        b, taken = await AsyncMember.join(address, registration(0))
        c, bad_token = await AsyncMember.join(address, registration(1, token="nope"))
        for member in (first, a, b, c):
            await member.close()
        await server.close()
        return [other_launch["error"], taken["error"], bad_token["error"], *events]

    replies = asyncio.run(go())
    assert "has launch id OTHER, this launch is L" in replies[0]
    assert "worker id 0 is already taken by h0 pid 100" in replies[1]
    assert "wrong rendezvous token" in replies[2]
    assert len(replies) == 6 and all(r.startswith("refused a worker:") for r in replies[3:])


def test_a_barrier_timeout_names_who_is_missing() -> None:
    async def go() -> dict[str, object]:
        server, address = await serve(3)
        members = [(await AsyncMember.join(address, registration(i)))[0] for i in (0, 2)]
        replies = await asyncio.gather(
            *(m.request({"op": "barrier", "name": "b", "timeout": 0.3}) for m in members)
        )
        for member in members:
            await member.close()
        await server.close()
        return replies[0]

    assert asyncio.run(go()) == {"error": "timeout", "arrived": [0, 2], "missing": [1]}


def test_differing_digests_fail_the_barrier_naming_the_odd_worker() -> None:
    async def go() -> list[dict[str, object]]:
        server, address = await serve(3)
        members = [
            (await AsyncMember.join(address, registration(i, digest="x" if i == 1 else "d")))[0]
            for i in range(3)
        ]
        replies = await asyncio.gather(
            *(m.request({"op": "barrier", "name": "b", "timeout": 5}) for m in members)
        )
        for member in members:
            await member.close()
        await server.close()
        return list(replies)

    replies = asyncio.run(go())
    assert all(r["error"] == "differ" and r["workers"] == [1] for r in replies)
    assert "w1 (h1) will run something different" in str(replies[0]["message"])


# a client socket the event loop closes late may warn at collection; the barrier is the check
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_1024_clients_pass_one_barrier_twice() -> None:
    async def go() -> float:
        server, address = await serve(1024)
        members = [(await AsyncMember.join(address, registration(i)))[0] for i in range(1024)]
        started = time.perf_counter()
        for name in ("b", "b"):  # the same name twice is two barriers
            replies = await asyncio.gather(
                *(m.request({"op": "barrier", "name": name, "timeout": 30}) for m in members)
            )
            assert all(r == {"ok": True} for r in replies)
        elapsed = (time.perf_counter() - started) / 2
        await asyncio.gather(*(m.close() for m in members))
        await server.close()
        return elapsed

    assert asyncio.run(go()) < 5  # benchmarks/launch.py measures it; this only bounds it


async def barrier_cpu_s(clients: int, rounds: int) -> tuple[float, int]:
    """The best of ``rounds`` barriers of ``clients``, in this process's CPU seconds.

    CPU time, not wall time: the service and its clients share this process, so
    other load on the machine does not count. Also returns how many gatherings
    the service still keeps afterwards (none: its memory does not grow per barrier).
    """
    limits.open_files(2 * clients)
    server, address = await serve(clients)
    members = [(await AsyncMember.join(address, registration(i)))[0] for i in range(clients)]
    samples = []
    for _ in range(rounds):
        started = time.process_time()
        replies = await asyncio.gather(
            *(m.request({"op": "barrier", "name": "b", "timeout": 60}) for m in members)
        )
        samples.append(time.process_time() - started)
        assert all(r == {"ok": True} for r in replies)
    kept = len(server._gatherings)
    await asyncio.gather(*(m.close() for m in members))
    await server.close()
    return min(samples), kept


@pytest.mark.alone
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_4096_client_barrier_costs_at_most_6x_a_1024_client_one() -> None:
    """Before: every arrival re-checked every worker's digest (quadratic, 10x for 4x clients).

    Alone, after the other tests: beside them a CI run measured 7x (66 and 463 ms; 4.7x
    quiet): CPU time leaves out other processes' time but not what they do to this one's
    caches, and a 4,096-client barrier's working set is four times the size.
    """
    require(limits.open_files(2 * 4096) is None, "the hard limit on open files is below 8,300")
    small, kept_small = asyncio.run(barrier_cpu_s(1024, 5))
    large, kept_large = asyncio.run(barrier_cpu_s(4096, 5))
    assert (kept_small, kept_large) == (0, 0)
    assert large < 6 * small, f"1,024 clients: {small * 1000:.0f} ms, 4,096: {large * 1000:.0f} ms"


# -- tpupod run -------------------------------------------------------------------------


def needs_jax() -> None:
    require(
        importlib.util.find_spec("jax") is not None,
        "jax is not installed (pip install -e '.[test]')",
    )


@pytest.mark.parametrize("workers", [2, 4])
def test_run_a_lockstep_jax_program_on_a_local_pod(
    workers: int, make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    needs_jax()
    pod = make_pod(workers, devices=2)
    result = cli("run", "--pod", pod.name, "--", PYTHON, str(PROGRAM), timeout=120)
    assert result.code == 0, result.err[-2000:]
    n = 2 * workers
    lines = [line for line in result.out.splitlines() if "cross-host sum" in line]
    assert len(lines) == workers
    for i in range(workers):
        assert any(
            line.startswith(f"[w{i}]") and f"worker {i} of {workers}" in line for line in lines
        )
    assert all(
        f"{n} devices in the mesh, cross-host sum {n * (n + 1) // 2} " in line for line in lines
    )
    assert all(f"processes {list(range(workers))}" in line for line in lines)


def test_run_over_ssh_on_the_simulated_pod(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    needs_jax()
    pod = make_ssh_pod(2, env={"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"})
    result = cli("run", "--pod", pod.name, "--", PYTHON, str(PROGRAM), timeout=120)
    assert result.code == 0, result.err[-2000:]
    lines = [line for line in result.out.splitlines() if "cross-host sum 10 (expected 10)" in line]
    assert len(lines) == 2 and any("[w1]" in line for line in lines)


def test_a_worker_that_dies_ends_the_run_quickly(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    leftovers: Callable[[Pod], list[str]],
) -> None:
    needs_jax()
    pod = make_pod(3, devices=1)
    program = (
        "import os, time, tpupod; me = tpupod.init_jax(); import jax; jax.devices(); "
        "print('initialized', flush=True); "
        "os._exit(3) if me.id == 1 else time.sleep(120)"
    )
    result = cli("run", "--pod", pod.name, "--grace", "2", "--", PYTHON, "-c", program, timeout=120)
    assert result.code == 3
    assert result.seconds < 30  # JAX alone would wait out its 100 s heartbeat
    assert "first failure: w1" in result.err and "exit 3" in result.err
    assert leftovers(pod) == []


def test_logs_keep_every_workers_output(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(2)
    program = "import tpupod; me = tpupod.rendezvous('start'); print(f'hello from {me.id}')"
    result = cli("run", "--pod", pod.name, "--", PYTHON, "-c", program)
    assert result.code == 0, result.err
    logs = cli("logs", "--pod", pod.name)
    assert sorted(logs.out.splitlines()) == ["[w0] hello from 0", "[w1] hello from 1"]
    only = cli("logs", "--pod", pod.name, "--worker", "1")
    assert only.out.splitlines() == ["[w1] hello from 1"]
    run_dir = next((state_home / "pods" / pod.name / "runs").iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    assert record["exit_code"] == 0 and record["finished"]


def test_assert_same_names_the_odd_worker(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(3)
    program = (
        "import os, tpupod; me = tpupod.worker(); "
        "tpupod.assert_same({'lr': 0.1 if me.id != 2 else 0.2}, 'config')"
    )
    result = cli("run", "--pod", pod.name, "--on-fail", "wait", "--", PYTHON, "-c", program)
    assert result.code != 0
    assert result.err.count("workers disagree on 'config': w2: {'lr': 0.2}") >= 3


def test_run_with_sync_runs_the_shipped_commit(
    make_pod: Callable[..., Pod], state_home: Path, tmp_path: Path
) -> None:
    pod = make_pod(2)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "prog.py").write_text(
        "import os, tpupod\nme = tpupod.rendezvous('start')\n"
        "print(me.id, os.environ['TPUPOD_CODE_COMMIT'][:12], os.path.basename(os.getcwd()))\n"
    )
    git_env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@e",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@e",
    }
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "prog"]):
        subprocess.run(["git", "-C", str(repo), *argv], check=True, env=git_env)
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    proc = subprocess.run(
        tpupod_argv("run", "--pod", pod.name, "--sync", "code", "--", PYTHON, "prog.py"),
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"[w0] 0 {head[:12]} code",
        f"[w1] 1 {head[:12]} code",
    ]
    assert f"every worker at {head[:12]} in code" in proc.stderr


def test_preflight_refuses_a_busy_coordinator_port(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = cli(
            "run", "--pod", pod.name, "--coordinator-port", str(port), "--", "echo started"
        )
    assert result.code == 1
    assert f"port {port} (JAX's coordinator) is in use on w0" in result.err
    assert "started" not in result.out
    assert not (state_home / "pods" / pod.name / "runs").exists()


def test_preflight_refuses_when_the_accelerator_is_held(
    make_ssh_pod: Callable[..., Pod], sim: SimPod, cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod()
    sim.run_on(2, "sh -c 'exec 3>/tmp/fake-accel1; sleep 60' >/dev/null 2>&1 &")
    result = cli(
        "run",
        "--pod",
        pod.name,
        "--",
        "echo started",
        env={"TPUPOD_ACCELERATOR_DEVICES": "/tmp/fake-accel*"},
    )
    assert result.code == 1
    assert "the accelerator is in use on w2" in result.err and "tpupod free-tpu" in result.err
    assert "started" not in result.out


def start_quiet_run(pod: Pod, program: str, state_home: Path) -> subprocess.Popen[bytes]:
    """``tpupod run -q`` of a Python ``program`` in the background, returned once its run
    folder exists (so that ``logs`` finds it)."""
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "-q", "--", PYTHON, "-c", program),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    runs_dir = state_home / "pods" / pod.name / "runs"
    deadline = time.monotonic() + 10
    while not (runs_dir.exists() and any(runs_dir.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return run


def test_logs_follow_a_running_launch(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(2)
    program = "import time; print('one', flush=True); time.sleep(1.5); print('two', flush=True)"
    run = start_quiet_run(pod, program, state_home)
    follow = cli("logs", "--pod", pod.name, "--follow", timeout=30)
    run.wait(timeout=30)
    assert sorted(follow.out.splitlines()) == ["[w0] one", "[w0] two", "[w1] one", "[w1] two"]
    assert "ended with exit code 0" in follow.err and follow.code == 0


def test_logs_follow_ends_with_the_runs_exit_code(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    """A script that follows a run learns how it ended (a trial: -f exited 0 for a failed
    run as for one that went well)."""
    pod = make_pod(2)
    program = "import time; time.sleep(1); raise SystemExit(3)"
    run = start_quiet_run(pod, program, state_home)
    follow = cli("logs", "--pod", pod.name, "--follow", timeout=30)
    assert run.wait(timeout=30) == 3
    assert follow.code == 3 and "ended with exit code 3" in follow.err, follow
    assert cli("logs", "--pod", pod.name).code == 0  # without -f: the logs were shown


@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_a_killed_launcher_leaves_nothing_running(
    kind: str,
    request: pytest.FixtureRequest,
    leftovers: Callable[[Pod], list[str]],
    state_home: Path,
) -> None:
    make = request.getfixturevalue("make_pod" if kind == "local" else "make_ssh_pod")
    pod = make(2)
    # no chance to stop anything: the orphan guard on each worker does it
    kill_launcher_once_started(pod, "echo started; sleep 60 & sleep 60; wait")
    assert leftovers(pod) == []


def kill_launcher_once_started(pod: Pod, command: str) -> int:
    """Start ``tpupod run -- command`` (which prints 'started' on every worker first), kill
    its launcher with SIGKILL once every worker has started; the launcher's pid."""
    launcher = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--", command),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert launcher.stdout is not None
    assert all("started" in launcher.stdout.readline() for _ in pod.workers)
    launcher.kill()
    launcher.communicate()
    return launcher.pid


def test_exec_leaves_deliberate_background_processes_alone(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult], sim: SimPod
) -> None:
    pod = make_ssh_pod(1)
    result = cli("exec", "--pod", pod.name, "--", "nohup sleep 30 >/dev/null 2>&1 &")
    assert result.code == 0
    assert sim.run_on(0, "pgrep -f 'slee[p] 30'").stdout.strip()


def test_the_rendezvous_can_run_on_worker_0(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult], sim: SimPod
) -> None:
    pod = make_ssh_pod(3)
    program = (
        "import os, tpupod; me = tpupod.rendezvous('start'); "
        "print(me.id, os.environ['TPUPOD_RENDEZVOUS'])"
    )
    result = cli(
        "run",
        "--pod",
        pod.name,
        "--rendezvous-on",
        "worker0",
        "--worker-python",
        PYTHON,
        "--",
        PYTHON,
        "-c",
        program,
        timeout=60,
    )
    assert result.code == 0, result.err
    lines = sorted(line.split()[1:] for line in result.out.splitlines())
    assert [line[0] for line in lines] == ["0", "1", "2"]
    assert all(line[1].startswith(sim.hosts[0].address + ":") for line in lines)
    assert sim_leftovers(sim) == []  # the service went away with the run


def test_a_rendezvous_that_cannot_start_on_worker_0_says_why(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod(2)
    result = cli(
        "run",
        "--pod",
        pod.name,
        "--rendezvous-on",
        "worker0",
        "--worker-python",
        "/nonexistent/python",
        "--",
        "true",
        timeout=60,
    )
    assert result.code == 1
    assert (
        "the rendezvous service did not start on w0" in result.err
        and "--worker-python" in result.err
    )


def test_run_starts_local_workers_where_the_launcher_stands(
    make_pod: Callable[..., Pod], state_home: Path, tmp_path: Path
) -> None:
    pod = make_pod(2)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "prog.py").write_text(
        "import os, tpupod\nme = tpupod.rendezvous('start')\nprint(me.id, os.getcwd())\n"
    )
    proc = subprocess.run(
        tpupod_argv("run", "--pod", pod.name, "--", PYTHON, "examples/prog.py"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"[w0] 0 {tmp_path}", f"[w1] 1 {tmp_path}"]


def test_gloo_chatter_stays_in_the_logs(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    needs_jax()
    pod = make_pod(2, devices=2)
    result = cli("run", "--pod", pod.name, "--", PYTHON, str(PROGRAM), timeout=120)
    assert result.code == 0, result.err[-2000:]
    assert "[Gloo]" not in result.out + result.err
    rows = [line for line in result.err.splitlines() if line.startswith(("w0 ", "w1 "))]
    assert len(rows) == 2 and all("cross-host sum 10" in row for row in rows)
    logs = cli("logs", "--pod", pod.name)
    assert "[Gloo] Rank" in logs.out
    verbose = cli("run", "--pod", pod.name, "--verbose", "--", PYTHON, str(PROGRAM), timeout=120)
    assert "[Gloo] Rank" in verbose.out + verbose.err


def test_quiet_run_prints_only_the_programs_output_and_errors(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    ok = cli("run", "-q", "--pod", pod.name, "--", "echo out; echo err >&2")
    assert ok.code == 0, ok.err
    assert sorted(ok.out.splitlines()) == ["[w0] out", "[w1] out"]
    assert sorted(ok.err.splitlines()) == ["[w0] err", "[w1] err"]
    program = 'if [ "$TPUPOD_WORKER_ID" = 1 ]; then sleep 0.5; echo bad >&2; exit 3; fi; echo fine'
    failed = cli("run", "-q", "--pod", pod.name, "--", program)
    assert failed.code == 3
    assert failed.out.splitlines() == ["[w0] fine"]
    lines = failed.err.splitlines()
    assert len(lines) == 2 and lines[0] == "[w1] bad", failed.err
    assert lines[1].startswith("first failure: w1 (") and ") exit 3" in lines[1], failed.err


def test_the_summary_never_shows_tpupods_own_marker_lines(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    # What an extract or bench worker prints last: its final progress marker, its results.
    program = (
        "from tpupod.fanout.progress import marker; from tpupod.bench.wire import MARKER; "
        "print('the real last line'); print(marker(8, 8, 'samples', 'done')); "
        "print(MARKER + '1/1 eJyrVgoBAAD/AHs=')"
    )
    result = cli("run", "--pod", pod.name, "--", PYTHON, "-c", program)
    assert result.code == 0, result.err
    assert "tpupod-progress" in result.out  # the terminal (and a live view) still gets them
    rows = [line for line in result.err.splitlines() if line.startswith(("w0 ", "w1 "))]
    assert len(rows) == 2, result.err
    assert all(row.endswith("the real last line") for row in rows), result.err


@pytest.mark.local
@pytest.mark.timeout(90)
def test_init_jax_without_tpupod_run_meets_at_the_coordinator(tmp_path: Path) -> None:
    """Started by a scheduler (a Kubernetes JobSet: the identity in the environment, no
    rendezvous service), init_jax still joins every process into one JAX runtime."""
    needs_jax()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    program = (
        "import tpupod\nme = tpupod.init_jax()\nimport jax, jax.numpy as jnp\n"
        "from jax.experimental import multihost_utils\n"
        "ids = multihost_utils.process_allgather(jnp.array([jax.process_index()]))\n"
        "print(me.id, jax.process_count(), ids.ravel().tolist())\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPUPOD_")}
    env = {
        **base,
        "JAX_PLATFORMS": "cpu",
        "TPUPOD_NUM_WORKERS": "2",
        "TPUPOD_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1",
        "TPUPOD_COORDINATOR": f"127.0.0.1:{port}",
    }
    procs = [
        subprocess.Popen(
            [PYTHON, "-c", program],
            env={**env, "TPUPOD_WORKER_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [proc.communicate(timeout=80) for proc in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-2000:]
    assert [out.strip().splitlines()[-1] for out, _ in outs] == ["0 2 [0, 1]", "1 2 [0, 1]"]
