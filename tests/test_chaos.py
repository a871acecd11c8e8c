"""The chaos harness for 2 minutes with a fixed seed (issue 41): training, serving and
jobs at once on one state directory while processes, a host's network, PostgreSQL and the
disk fail at random; nothing lost, nothing run twice, every injection named, nothing left.

``benchmarks/chaos.py`` runs as a user's commands do (the CLI, default options, the real
``openai`` client); its 60-minute run's figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tpupod.sim import missing_prerequisites

CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"
SEED = 7
Verdict = dict[str, Any]

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def verdict(tmp_path_factory: pytest.TempPathFactory) -> Verdict:
    require(os.geteuid() == 0, "the harness mounts a tmpfs and makes network namespaces")
    missing = missing_prerequisites()
    require(not missing, f"a simulated pod needs {', '.join(missing)}")
    out = tmp_path_factory.mktemp("chaos") / "verdict.json"
    argv = [sys.executable, str(CHAOS), "--minutes", "2", "--seed", str(SEED)]
    argv += ["--every", "10", "20", "--clients", "2", "--drain", "420", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1100, check=False)
    assert done.returncode == 0 and out.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    print(done.stdout)  # the injections and the verdict, shown when a test below fails
    found: Verdict = json.loads(out.read_text())
    return found


def test_training_ends_bit_identical_to_an_undisturbed_run(verdict: Verdict) -> None:
    for pod, training in verdict["training"].items():
        assert training["identical"], (pod, training)


def test_every_acknowledged_job_ran_exactly_once_with_its_log(verdict: Verdict) -> None:
    jobs = verdict["jobs"]
    assert jobs["acknowledged"] > 10, jobs
    assert (jobs["lost"], jobs["duplicated"], jobs["unexpected"]) == ([], [], []), jobs
    assert jobs["statuses"] == {"completed": jobs["acknowledged"]}, jobs
    assert jobs["logs_incomplete"] == [], jobs


def test_requests_succeed_and_no_gap_is_long(verdict: Verdict) -> None:
    requests = verdict["requests"]
    failed = sum(requests["failed"].values())
    assert requests["ok"] > 100, requests
    assert failed <= 0.001 * (requests["ok"] + failed), requests
    assert requests["longest_gap_s"] <= 10, requests


# A host whose network is down sends nothing back, not even a reset: the launcher knows it
# when the SSH keepalive gives up, after keepalive_interval x keepalive_count (the pod's
# own settings, 5 s x 3 by default) and one more interval for the first to be missed.
NAMED_WITHIN_S = {"network": 5.0 * (3 + 1) + 5.0}


def test_every_injection_is_named_within_10_s(verdict: Verdict) -> None:
    injections = verdict["injections"]
    assert len(injections) >= 4, injections
    late = [
        i
        for i in injections
        if i["named_s"] is None or i["named_s"] > NAMED_WITHIN_S.get(i["kind"], 10.0)
    ]
    assert late == [], late


def test_nothing_is_left_and_a_new_up_works(verdict: Verdict) -> None:
    assert verdict["leftovers"] == []
