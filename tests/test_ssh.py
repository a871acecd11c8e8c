"""What only an SSH pod can do wrong: hosts that are down, hang, or change their keys."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, sim_leftovers
from tpupod.errors import TpupodError
from tpupod.fanout.execute import execute
from tpupod.fanout.results import Outcome
from tpupod.pod.lifecycle import up
from tpupod.pod.record import Pod
from tpupod.pod.spec import spec_from_mapping
from tpupod.pod.state import StateDir
from tpupod.providers import connect
from tpupod.sim import SimPod


def test_a_host_whose_sshd_is_stopped_is_named_while_the_others_complete(
    make_ssh_pod: Callable[..., Pod], sim_hosts_up: SimPod, cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod()
    sim_hosts_up.stop_host(2)
    result = cli("exec", "--pod", pod.name, "--", "echo alive")
    assert result.code == 255
    assert sorted(result.out.splitlines()) == ["[w0] alive", "[w1] alive", "[w3] alive"]
    assert "w2" in result.err and "cannot connect after 4 tries: connection refused" in result.err
    assert "3/4 ok" in result.err


def test_a_host_that_dies_mid_command_is_reported(
    make_ssh_pod: Callable[..., Pod], sim_hosts_up: SimPod
) -> None:
    pod = make_ssh_pod()

    async def go() -> list[Outcome]:
        from tpupod.fanout.execute import execute_async

        loop = asyncio.get_running_loop()
        loop.call_later(0.8, sim_hosts_up.stop_host, 1)
        result = await execute_async(pod, "sleep 3; echo done", timeout=20)
        return [r.outcome for r in result.workers]

    assert asyncio.run(go()) == [Outcome.OK, Outcome.UNREACHABLE, Outcome.OK, Outcome.OK]


def test_a_hanging_host_is_cut_off_by_the_timeout(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult], sim: SimPod
) -> None:
    pod = make_ssh_pod()
    command = 'if [ "$TPUPOD_WORKER_ID" = 3 ]; then sleep 60; fi; echo quick'
    result = cli("exec", "--pod", pod.name, "--timeout", "1.5", "--", command)
    assert result.code == 124
    assert result.seconds < 8
    assert "timed out: w3 did not finish" in result.err and "first failure" not in result.err
    assert sim_leftovers(sim) == []


def test_kill_minus_nine_on_the_host_is_reported(
    make_ssh_pod: Callable[..., Pod], sim: SimPod
) -> None:
    pod = make_ssh_pod()

    async def go() -> list[str]:
        from tpupod.fanout.execute import execute_async

        loop = asyncio.get_running_loop()
        loop.call_later(1.0, lambda: sim.run_on(0, "pkill -9 -f 'sleep 42'"))
        result = await execute_async(pod, "sleep 42", workers="0,1", timeout=10, grace=0.5)
        return [r.outcome_text() for r in result.workers]

    texts = asyncio.run(go())
    assert texts[0] == "killed by SIGKILL"
    assert texts[1].startswith("timed out")


def test_a_changed_host_key_is_refused(
    make_ssh_pod: Callable[..., Pod], state_home: Path, sim: SimPod
) -> None:
    pod = make_ssh_pod()
    known = state_home / "pods" / pod.name / "known_hosts"
    keys = dict(line.split(" ", 1) for line in known.read_text().splitlines())
    assert len(keys) == 4
    first, second = sim.hosts[0].address, sim.hosts[1].address
    keys[first] = keys[second]  # as if host-0 had been remembered with another key
    known.write_text("".join(f"{host} {key}\n" for host, key in keys.items()))
    result = execute(pod, "true")
    assert [r.outcome for r in result.workers][:2] == [Outcome.UNREACHABLE, Outcome.OK]
    assert "the host key has CHANGED" in (result.workers[0].error or "")


def test_strict_host_keys_refuse_unknown_hosts(state_home: Path, sim_hosts_up: SimPod) -> None:
    data = {
        "name": "strict",
        "provider": "ssh",
        "hosts": [sim_hosts_up.hosts[0].address],
        "user": "root",
        "key": str(sim_hosts_up.key),
        "host_keys": "strict",
    }
    with pytest.raises(TpupodError, match="no remembered host key and host keys are strict"):
        up(spec_from_mapping(data, "test"), StateDir())
    assert not (state_home / "pods" / "strict").exists()


def test_up_refuses_when_a_host_does_not_answer(
    cli: Callable[..., CliResult], sim_hosts_up: SimPod, state_home: Path
) -> None:
    sim_hosts_up.stop_host(1)
    hosts = ",".join(h.address for h in sim_hosts_up.hosts)
    result = cli(
        "up", "--name", "half", "--ssh", hosts, "--user", "root", "--key", str(sim_hosts_up.key)
    )
    assert result.code == 1
    assert "1 of 4 hosts did not answer, so the pod was not created" in result.err
    assert f"w1 (root@{sim_hosts_up.hosts[1].address})" in result.err
    assert not (state_home / "pods" / "half").exists()


def test_a_wrong_key_is_permission_denied_not_a_prompt(
    cli: Callable[..., CliResult], sim_hosts_up: SimPod, tmp_path: Path
) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    result = cli(
        "up",
        "--name",
        "nokey",
        "--ssh",
        sim_hosts_up.hosts[0].address,
        "--user",
        "root",
        "--key",
        str(other),
    )
    assert result.code == 1
    assert (
        "permission denied (publickey)" in result.err and "never asks for a password" in result.err
    )


def test_up_records_hostnames_and_addresses(
    cli: Callable[..., CliResult], sim_hosts_up: SimPod
) -> None:
    hosts = ",".join(h.address for h in sim_hosts_up.hosts)
    made = cli(
        "up", "--name", "lab", "--ssh", hosts, "--user", "root", "--key", str(sim_hosts_up.key)
    )
    assert made.code == 0, made.err
    rows = [line.split() for line in cli("hosts", "--pod", "lab").out.splitlines()[1:]]
    assert rows == [[str(h.index), h.hostname, h.address, "-"] for h in sim_hosts_up.hosts]


def test_the_environment_arrives_without_accept_env(make_ssh_pod: Callable[..., Pod]) -> None:
    pod = make_ssh_pod(env={"QUOTED": 'it\'s a "test" $HOME'})
    result = execute(pod, 'echo "$TPUPOD_WORKER_ID $TPUPOD_NUM_WORKERS $QUOTED"; echo "$SHLVL"')
    for r in result.workers:
        assert r.tail[0] == f'{r.worker.id} 4 it\'s a "test" $HOME'


def test_connections_are_reused_across_calls(make_ssh_pod: Callable[..., Pod]) -> None:
    pod = make_ssh_pod()

    async def go() -> tuple[float, float]:
        from tpupod.fanout.execute import execute_async

        connector = connect(pod)
        try:
            started = time.monotonic()
            await execute_async(pod, "true", connector=connector)
            cold = time.monotonic() - started
            started = time.monotonic()
            for _ in range(5):
                (await execute_async(pod, "true", connector=connector)).raise_for_failures()
            warm = (time.monotonic() - started) / 5
        finally:
            await connector.close()
        return cold, warm

    cold, warm = asyncio.run(go())
    assert warm < cold


@pytest.mark.unit
def test_the_ssh_transport_imports_without_a_warning() -> None:
    """cryptography 51 deprecated DSA and warns when asyncssh (2.24) builds its DSA keys at
    import: every command on an SSH pod printed two lines a user can do nothing about."""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import tpupod.transport.ssh"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, "")
