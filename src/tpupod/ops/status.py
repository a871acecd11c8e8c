"""A pod's health: what its cloud says of it, and whether every worker answers.

``tpupod status`` prints it; the Python API returns it (``tpupod.pod_status``). A pod
whose TPU the cloud no longer has (``GONE``) is a status too, with how to bring it back;
its workers are not asked (they went with it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult, slice_of
from tpupod.pod.record import Pod, Worker
from tpupod.providers import GONE, provider_for
from tpupod.providers.gcp_api import worst_state

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
    slice_states: tuple[str, ...] = ()  # each slice's, where its slices are separate TPUs

    @property
    def healthy(self) -> bool:
        return GONE not in (self.cloud_state, *self.slice_states) and all(
            w.reachable for w in self.workers
        )

    @property
    def cloud_text(self) -> str | None:
        """The cloud's state in words: one, or each slice's (``two-0 READY, two-1 GONE``)."""
        if not self.slice_states:
            return self.cloud_state
        return ", ".join(
            f"{self.pod.name}-{k} {found}" for k, found in enumerate(self.slice_states)
        )

    @property
    def advice(self) -> str | None:
        """What to do about the pod's state, where there is something to do."""
        gone = [k for k, found in enumerate(self.slice_states) if found == GONE]
        if self.cloud_state != GONE and not gone:
            return None
        name = self.pod.name
        what = (
            "its TPU no longer exists"
            if not gone or len(gone) == len(self.slice_states)
            else (f"the TPU of slice {', '.join(map(str, gone))} no longer exists")
        )
        return (
            f"{what} (deleted, or taken back): 'tpupod up --recreate "
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
            "slice_states": list(self.slice_states),
            "healthy": self.healthy,
            "advice": self.advice,
        }


async def pod_status_async(pod: Pod, *, timeout: float = PROBE_TIMEOUT_S) -> PodStatus:
    """Ask the cloud, then every worker; a worker that does not answer is not an error, and
    the workers of a TPU that is gone (of a slice, on a pod of separate TPUs) are not asked."""
    provider = provider_for(pod.provider)
    states = await provider.slice_states(pod) if pod.slices > 1 else []
    each = tuple(states) if len(states) > 1 else ()
    live = worst_state(states) if states else await provider.live_state(pod)
    all_gone = all(found == GONE for found in each) if each else live == GONE
    if all_gone:
        return PodStatus(pod, live, _gone(pod.workers), UNREACHABLE, each)
    gone = [w for w in pod.workers if each and each[w.slice or 0] == GONE]
    asked = [w for w in pod.workers if w not in gone]
    probe = await execute_async(
        pod, "hostname", workers=asked, timeout=timeout, grace=PROBE_GRACE_S
    )
    workers = sorted(_gone(gone) + _answers(probe), key=lambda w: w.worker)
    code = UNREACHABLE if gone else probe.exit_code()
    return PodStatus(pod, live, tuple(workers), code, each)


def pod_status(pod: Pod, *, timeout: float = PROBE_TIMEOUT_S) -> PodStatus:
    """:func:`pod_status_async`, for code that is not async."""
    return asyncio.run(pod_status_async(pod, timeout=timeout))


def _gone(workers: Sequence[Worker]) -> tuple[WorkerStatus, ...]:
    return tuple(
        WorkerStatus(w.id, w.hostname, False, "its TPU is gone", 0.0, w.slice) for w in workers
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
