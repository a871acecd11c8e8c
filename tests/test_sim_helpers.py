"""The conftest helpers other SSH tests trust are not blind: ``sim_leftovers`` lists what
runs on each simulated host (asked of every host at once), and ``reset_sim`` (the
``sim_hosts_up`` teardown) ends it on every host."""

from __future__ import annotations

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
