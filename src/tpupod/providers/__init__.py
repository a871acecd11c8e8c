"""Where pods come from. A provider creates and destroys pods and hands out transports.

Design notes: docs/gcp.md (the gcp provider).

Deferred imports: a provider's module is imported when a pod of its kind is used: the SSH
one brings asyncssh, the GCP one the gcp extra's client.
"""

from __future__ import annotations

from typing import Protocol

from tpupod.errors import UsageError
from tpupod.pod.record import Pod, Worker
from tpupod.pod.spec import PodSpec
from tpupod.pod.state import StateDir
from tpupod.providers.gcp_api import (
    GONE as GONE,  # live_state's word for a resource the cloud no longer has
)
from tpupod.transport import Transport


class Connector(Protocol):
    """The transports of one pod, sharing whatever connections they need (a transport
    implements it; it lives here, with the providers that hand it out, so that the
    transport seam needs nothing of the pod record)."""

    def transport(self, worker: Worker) -> Transport: ...

    async def reachback(self, worker: Worker) -> str:
        """The address at which ``worker`` reaches this machine (for services we run here)."""
        ...

    async def close(self) -> None:
        """Release connections; running commands are not touched."""
        ...


class Provider(Protocol):
    async def create(self, spec: PodSpec, state: StateDir, *, recreate: bool = False) -> Pod:
        """Bring the pod's workers up (or check they answer) and return its record, unsaved.

        ``recreate``: a cloud resource of that name that is broken (preempted,
        failed) is deleted and made again instead of being reported.
        """
        ...

    async def destroy(self, pod: Pod, state: StateDir) -> None:
        """Take the pod's workers down; the caller forgets the record afterwards."""
        ...

    async def live_state(self, pod: Pod) -> str | None:
        """What the cloud says of the pod (READY, PREEMPTED, ..., ``GONE`` when it has no such
        resource: deleted, or never made); None where there is no cloud."""
        ...

    async def slice_states(self, pod: Pod) -> list[str]:
        """The cloud state of each of the pod's cloud resources, in slice order: one, or
        one per slice where its slices are separate TPUs; empty where there is no cloud."""
        ...

    def connect(self, pod: Pod, state: StateDir) -> Connector:
        """Transports for the pod's workers; close the connector when done."""
        ...

    def worker_env(self, pod: Pod, worker: Worker) -> dict[str, str]:
        """Variables a process on this worker sees, beyond the pod's identity variables."""
        ...


def provider_for(name: str) -> Provider:
    if name == "local":
        from tpupod.providers.local import LocalProvider

        return LocalProvider()
    if name == "ssh":
        from tpupod.providers.ssh import SshProvider

        return SshProvider()
    if name == "gcp":
        from tpupod.providers.gcp import GcpProvider

        return GcpProvider()
    raise UsageError(f"unknown provider {name!r}", hint="supported providers: local, ssh, gcp")


def worker_environment(
    pod: Pod, worker: Worker, extra: dict[str, str] | None = None, provider: Provider | None = None
) -> dict[str, str]:
    """What a process tpupod starts on ``worker`` sees: the worker's identity, its provider's
    variables, then ``extra`` (the caller's own, which win)."""
    provider = provider or provider_for(pod.provider)
    return {**pod.identity_env(worker), **provider.worker_env(pod, worker), **(extra or {})}


def connect(pod: Pod, state: StateDir | None = None) -> Connector:
    """The pod's transports, from its provider."""
    return provider_for(pod.provider).connect(pod, state or StateDir())
