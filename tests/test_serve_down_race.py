"""``serve down`` against a ``serve up`` that begins while it runs (issue 41's new-user
trial: the chaos harness's `serve up`, run again after an agent kill, registered itself
after `serve down` had looked for starters; down stopped the old fleet and the new
`serve up` went on to start another, which `down` then refused to take from under it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.serve.fleet.control import Fleet

# A stand-in `serve up`: registers itself as the pod's `serve up` user, then waits
STARTER = """
import sys, time
from tpupod.pod import users
from tpupod.pod.state import StateDir
from tpupod.serve.fleet.remote import SERVE_UP
with users.using(StateDir(), sys.argv[1], SERVE_UP):
    print("registered", flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_serve_up_that_begins_during_serve_down_is_stopped_too(
    make_pod: Callable[..., Pod], state_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = make_pod(1)
    fleet = Fleet(pod, StateDir())
    started: list[subprocess.Popen[str]] = []

    def remote(python: str, use: Any) -> None:  # while down stops the fleet: an up begins
        up = subprocess.Popen([sys.executable, "-c", STARTER, pod.name], text=True,
                              stdout=subprocess.PIPE, env={**os.environ})  # fmt: skip
        started.append(up)
        assert up.stdout is not None and up.stdout.readline() == "registered\n"

    monkeypatch.setattr(fleet, "_remote", remote)
    said: list[str] = []
    try:
        fleet.down(said.append)
        [up] = started
        up.wait(timeout=10)  # TERMed by down, not left to start a fleet
        assert any(f"stopping tpupod serve up (pid {up.pid}" in line for line in said), said
    finally:
        for up in started:
            up.kill()
            up.communicate()
