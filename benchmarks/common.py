"""What the benchmark scripts share: the tpupod command, how they call OpenSSH, and the
SSH pod over a simulated pod's hosts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tpupod.pod.lifecycle import up
from tpupod.pod.record import Pod
from tpupod.pod.spec import spec_from_mapping
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod

TPUPOD = str(Path(sys.executable).with_name("tpupod"))
# A throwaway simulated pod: no host-key prompts or files, no password fallback.
SSH_OPTIONS = [
    "-o", "BatchMode=yes",
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
]  # fmt: skip


def sim_pod(sim: SimPod, name: str, **options: Any) -> Pod:
    """An SSH pod (as root, with the simulated pod's key) of every host of ``sim``."""
    data = {
        "name": name,
        "provider": "ssh",
        "user": "root",
        "key": str(sim.key),
        "hosts": [h.address for h in sim.hosts],
        **options,
    }
    return up(spec_from_mapping(data, "bench"), StateDir()).pod
