"""The conftest helpers other SSH tests trust are not blind: ``sim_leftovers`` lists what
runs on each simulated host (asked of every host at once), and ``reset_sim`` (the
``sim_hosts_up`` teardown) ends it on every host."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import reset_sim, sim_leftovers
from tpupod.sim import SimPod


def test_leftovers_are_seen_on_each_host_and_the_reset_ends_them(sim_hosts_up: SimPod) -> None:
    sim = sim_hosts_up
    for index in (1, 3):
        sim.run_on(index, "nohup sleep 60 >/dev/null 2>&1 &")
    left = sim_leftovers(sim, timeout=0.2)
    assert sorted(line.split(":")[0] for line in left) == ["host-1", "host-3"], left
    assert all(line.endswith("sleep 60") for line in left), left
    reset_sim(sim)
    assert sim_leftovers(sim, timeout=0.2) == []


def test_a_command_over_ssh_shares_the_suites_jax_compilation_cache(sim_hosts_up: SimPod) -> None:
    """The hosts run on this machine, so a session's JAX programs find the cache the suite
    gives every process it starts (tests/conftest.py), as a local pod's do."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not cache:
        pytest.skip("the suite's JAX compilation cache is off (TPUPOD_TESTS_NO_JAX_CACHE)")
    host = sim_hosts_up.hosts[0]
    login = ["ssh", "-i", str(sim_hosts_up.key), "-o", "StrictHostKeyChecking=no"]
    login += ["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    shown = subprocess.run(
        [*login, f"root@{host.address}", "printenv JAX_COMPILATION_CACHE_DIR"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == cache
