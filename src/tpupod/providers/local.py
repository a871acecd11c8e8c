"""The local provider: N simulated hosts on this machine.

Each worker is a working directory under the pod's state folder; its commands
are local subprocesses that see the environment a real pod worker would, with
JAX pinned to the CPU and showing ``devices_per_worker`` devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

from tpupod.base import procfs
from tpupod.pod.record import Pod, Worker, slice_of
from tpupod.pod.spec import LocalPodSpec, PodSpec
from tpupod.pod.state import StateDir
from tpupod.transport.local import LocalConnector

LOOPBACK = "127.0.0.1"
DOWN_GRACE_S = 5.0


class LocalProvider:
    async def create(self, spec: PodSpec, state: StateDir, *, recreate: bool = False) -> Pod:
        assert isinstance(spec, LocalPodSpec)
        hostname = socket.gethostname()
        workers = []
        for i in range(spec.workers):
            workdir = state.pod_dir(spec.name) / "workers" / f"w{i}"
            workdir.mkdir(parents=True, exist_ok=True)
            workers.append(
                Worker(
                    id=i,
                    hostname=hostname,
                    internal_address=LOOPBACK,
                    workdir=str(workdir),
                    slice=slice_of(i, spec.workers, spec.slices),
                )
            )
        return Pod(name=spec.name, spec=spec, workers=tuple(workers))

    async def destroy(self, pod: Pod, state: StateDir) -> None:
        """A local host going down takes its processes with it: kill what the pod left running."""
        await asyncio.to_thread(stop_processes, find_pod_processes(pod), DOWN_GRACE_S)

    async def live_state(self, pod: Pod) -> str | None:
        return None

    async def slice_states(self, pod: Pod) -> list[str]:
        return []

    def connect(self, pod: Pod, state: StateDir) -> LocalConnector:
        return LocalConnector()

    def worker_env(self, pod: Pod, worker: Worker) -> dict[str, str]:
        assert isinstance(pod.spec, LocalPodSpec)
        return {
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(pod.spec.devices_per_worker),
            **pod.spec.env,
        }


def find_pod_processes(pod: Pod) -> list[int]:
    """Pids of live processes started on this local pod: they carry its uid, which no
    same-named pod of another state directory (or earlier pod of this one) has."""
    marker = f"TPUPOD_POD_UID={pod.uid or pod.name}".encode()
    me = os.getpid()
    return [pid for pid in procfs.pids() if pid != me and marker in procfs.environ(pid)]


def stop_processes(pids: list[int], grace: float) -> None:
    """TERM each process, then KILL those still alive after ``grace`` seconds."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if procfs.alive(pid)]
        time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
