"""Where pods come from. A provider creates and destroys pods and hands out transports."""

from __future__ import annotations

from typing import Protocol

from tpupod.errors import UsageError
from tpupod.pod import Pod, Worker
from tpupod.spec import PodSpec
from tpupod.state import StateDir
from tpupod.transport import Transport


class Provider(Protocol):
    def create(self, spec: PodSpec, state: StateDir) -> Pod:
        """Bring the pod's workers up and return its record (not yet saved)."""
        ...

    def destroy(self, pod: Pod, state: StateDir) -> None:
        """Take the pod's workers down; the caller forgets the record afterwards."""
        ...

    def transport(self, pod: Pod, worker: Worker) -> Transport: ...

    def worker_env(self, pod: Pod, worker: Worker) -> dict[str, str]:
        """Variables a process on this worker sees, beyond the pod's identity variables."""
        ...


def provider_for(name: str) -> Provider:
    if name == "local":
        from tpupod.providers.local import LocalProvider

        return LocalProvider()
    raise UsageError(f"unknown provider {name!r}", hint="supported providers: local")
