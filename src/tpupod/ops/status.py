"""A pod's health: what its cloud says of it, and whether every worker answers.

``tpupod status`` prints it; the Python API returns it (``tpupod.pod_status``). A pod
whose TPU the cloud no longer has (``GONE``) is a status too, with how to bring it back;
its workers are not asked (they went with it).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult, slice_of
from tpupod.pod.record import Pod
from tpupod.providers import GONE, provider_for

PROBE_TIMEOUT_S = 10.0
PROBE_GRACE_S = 1.0
UNREACHABLE = 255


@dataclass(frozen=True)
class WorkerStatus:
    """One worker's answer to ``hostname`` (or why there was none)."""

    worker: int
    hostname: str
    reachable: bool
    answer: str
    seconds: float
    slice: int | None = None  # on a pod of slices


@dataclass(frozen=True)
class PodStatus:
    """A pod as its cloud reports it (None where there is no cloud) and as its workers answer."""

    pod: Pod
    cloud_state: str | None
    workers: tuple[WorkerStatus, ...]
    exit_code: int = 0  # as every fan-out's: 255 when a worker could not be reached

    @property
    def healthy(self) -> bool:
        return self.cloud_state != GONE and all(w.reachable for w in self.workers)

    @property
    def advice(self) -> str | None:
        """What to do about the pod's state, where there is something to do."""
        if self.cloud_state != GONE:
            return None
        name = self.pod.name
        return (
            f"its TPU no longer exists (deleted, or taken back): 'tpupod up --recreate "
            f"--name {name}' makes it again, as does 'tpupod run --pod {name} --retries N' "
            f"before it runs; 'tpupod down --pod {name}' forgets the pod"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "pod": self.pod.name,
            "provider": self.pod.provider,
            "slices": self.pod.slices,
            "workers": [asdict(w) for w in self.workers],
            "cloud_state": self.cloud_state,
            "healthy": self.healthy,
            "advice": self.advice,
        }


async def pod_status_async(pod: Pod, *, timeout: float = PROBE_TIMEOUT_S) -> PodStatus:
    """Ask the cloud, then every worker; a worker that does not answer is not an error, and
    the workers of a TPU that is gone are not asked."""
    live = await provider_for(pod.provider).live_state(pod)
    if live == GONE:
        return PodStatus(pod, live, _gone(pod), UNREACHABLE)
    probe = await execute_async(pod, "hostname", timeout=timeout, grace=PROBE_GRACE_S)
    return PodStatus(pod, live, _answers(probe), probe.exit_code())


def pod_status(pod: Pod, *, timeout: float = PROBE_TIMEOUT_S) -> PodStatus:
    """:func:`pod_status_async`, for code that is not async."""
    return asyncio.run(pod_status_async(pod, timeout=timeout))


def _gone(pod: Pod) -> tuple[WorkerStatus, ...]:
    return tuple(
        WorkerStatus(w.id, w.hostname, False, "its TPU is gone", 0.0, w.slice) for w in pod.workers
    )


def _answers(probe: FanoutResult) -> tuple[WorkerStatus, ...]:
    return tuple(
        WorkerStatus(
            worker=r.worker.id,
            hostname=r.worker.hostname,
            reachable=r.ok,
            answer=r.last_line if r.ok else f"{r.outcome_text()}: {r.last_line}",
            seconds=round(r.duration, 3),
            slice=slice_of(r.worker),
        )
        for r in probe.workers
    )
