"""What the Kubernetes runner sends: a JobSet that gang-runs one attempt of a job on a GKE
TPU slice. (The tests check every manifest it renders: ``tests/fakes/jobset_schema.py``.)

One JobSet per attempt, named ``tpupod-<store>-<job>-<attempt>`` and labelled with the job, the
attempt and the store it came from, so a runner can tell a live attempt's JobSet from one a
lost runner left behind. It holds one replicated Job of N pods (one per TPU VM of the
slice) with completion mode Indexed: pod ``i`` is worker ``i``. Every pod asks for its
VM's chips (``google.com/tpu``) and lands on the slice's node pool through GKE's
``cloud.google.com/gke-tpu-accelerator`` and ``-topology`` node labels.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tpupod.errors import UsageError
from tpupod.jobs.execute import job_command, job_env
from tpupod.jobs.models import Job, JobStatus
from tpupod.jobs.store import Store
from tpupod.pod import accelerators

GROUP = "jobset.x-k8s.io"
VERSION = "v1alpha2"
PLURAL = "jobsets"
API_VERSION = f"{GROUP}/{VERSION}"
REPLICATED_JOB = "workers"
CONTAINER = "job"
COORDINATOR_PORT = 8476  # tpupod.init_jax's default

MANAGED_BY = "app.kubernetes.io/managed-by"
JOB_LABEL = "tpupod.dev/job-id"
ATTEMPT_LABEL = "tpupod.dev/attempt"
STORE_LABEL = "tpupod.dev/store"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
ACCELERATOR_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_SELECTOR = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"

# GKE's node label value for each generation tpupod knows (v2 and v3 are not on GKE).
GKE_ACCELERATORS = {
    "v4": "tpu-v4-podslice",
    "v5p": "tpu-v5p-slice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v6e": "tpu-v6e-slice",
}
THREE_D = {"v4", "v5p"}  # these write 3-D topologies (2x2x1), the others 2-D (4x4)
TOPOLOGY_RE = re.compile(r"^\d+(x\d+){1,2}$")


@dataclass(frozen=True)
class TpuSlice:
    """A GKE TPU slice: what the node selectors name, and how many pods of how many chips."""

    tpu_type: str  # tpupod's name, e.g. v5litepod-16
    accelerator: str  # GKE's, e.g. tpu-v5-lite-podslice
    topology: str  # e.g. 4x4
    hosts: int
    chips_per_host: int


def tpu_slice(tpu_type: str, topology: str | None = None) -> TpuSlice:
    """The slice for a TPU type (``v5litepod-16``), with GKE's topology for it unless given."""
    found = accelerators.lookup(tpu_type)
    accelerator = GKE_ACCELERATORS.get(found.generation)
    if accelerator is None:
        known = ", ".join(GKE_ACCELERATORS)
        raise UsageError(f"GKE has no {found.generation} TPU node pools", hint=f"use {known}")
    shape = topology or _default_topology(found.generation, found.chips)
    if shape is None or not TOPOLOGY_RE.match(shape):
        raise UsageError(
            f"give the topology of {found.name} ({found.chips} chips)",
            hint="--topology AxB (v5e, v6e) or AxBxC (v4, v5p), as the node pool has it",
        )
    dims = [int(d) for d in shape.split("x")]
    if math.prod(dims) != found.chips or (len(dims) == 3) != (found.generation in THREE_D):
        raise UsageError(
            f"topology {shape} does not fit {found.name} ({found.chips} chips)",
            hint="a product of the dimensions equal to the chips; 3-D for v4 and v5p",
        )
    return TpuSlice(found.name, accelerator, shape, found.workers, found.chips_per_worker)


def _default_topology(generation: str, chips: int) -> str | None:
    """GKE's topology for ``chips`` (powers of two: the shapes Google's tables list)."""
    if chips & (chips - 1):
        return None
    bits = chips.bit_length() - 1
    if generation in THREE_D:  # 4 -> 2x2x1, 8 -> 2x2x2, 16 -> 2x2x4, 32 -> 2x4x4 ...
        dims = [1, 1, 1]
        for i in range(bits):  # 2x2x1, 2x2x2, then the last dimension first: 2x2x4, 2x4x4
            dims[i if i < 3 else 2 - (i - 3) % 3] *= 2
        return "x".join(str(d) for d in dims)
    side = 2 ** (bits // 2)
    return f"{side}x{chips // side}"  # 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16


def jobset_name(job_id: int, attempt: int, store: str = "") -> str:
    """``tpupod-<store>-<job>-<attempt>``: stores sharing a namespace never collide."""
    return "-".join(["tpupod", *([store] if store else []), str(job_id), str(attempt)])


def worker_hostnames(name: str, hosts: int) -> list[str]:
    """The pods' DNS names (JobSet's headless service: ``<jobset>-<rjob>-<job>-<index>``)."""
    return [f"{name}-{REPLICATED_JOB}-0-{i}.{name}" for i in range(hosts)]


@dataclass(frozen=True)
class Target:
    """Where and how the runner's JobSets run."""

    slice: TpuSlice
    image: str
    namespace: str = "default"
    store: str = ""  # store_label() of the runner's store
    worker_python: str = "python3"
    grace_s: int = 3  # terminationGracePeriodSeconds: TERM, then KILL (JAX ignores TERM)
    service_account: str | None = None


def render_jobset(job: Job, attempt: int, target: Target) -> dict[str, Any]:
    """The JobSet for one attempt of ``job``."""
    name = jobset_name(job.id, attempt, target.store)
    hosts = target.slice.hosts
    names = worker_hostnames(name, hosts)
    labels = {
        MANAGED_BY: "tpupod",
        JOB_LABEL: str(job.id),
        ATTEMPT_LABEL: str(attempt),
        STORE_LABEL: target.store or "none",
    }
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in sorted(job_env(job, attempt).items())
    ]
    env += [
        {
            "name": "TPUPOD_WORKER_ID",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}},
        },
        {"name": "TPUPOD_NUM_WORKERS", "value": str(hosts)},
        {"name": "TPUPOD_WORKER_HOSTNAMES", "value": ",".join(names)},
        {"name": "TPUPOD_COORDINATOR", "value": f"{names[0]}:{COORDINATOR_PORT}"},
    ]
    chips = str(target.slice.chips_per_host)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": target.grace_s,
        "nodeSelector": {
            ACCELERATOR_SELECTOR: target.slice.accelerator,
            TOPOLOGY_SELECTOR: target.slice.topology,
        },
        "containers": [
            {
                "name": CONTAINER,
                "image": target.image,
                "command": ["/bin/bash", "-c", job_command(job, target.worker_python)],
                "env": env,
                "ports": [{"containerPort": COORDINATOR_PORT, "name": "coordinator"}],
                "resources": {"requests": {TPU_RESOURCE: chips}, "limits": {TPU_RESOURCE: chips}},
            }
        ],
    }
    if target.service_account:
        pod_spec["serviceAccountName"] = target.service_account
    annotations = {}
    if hosts > 1:  # one slice per JobSet: its pods may not spread over node pools
        annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] = "cloud.google.com/gke-nodepool"
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": target.namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {
            "failurePolicy": {"maxRestarts": 0},  # retries are the job store's, per attempt
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": dict(labels)},
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
                        },
                    },
                }
            ],
        },
    }


# What --dry-run renders when no job is queued: a gang job that shows the slice's devices.
SAMPLE_COMMAND = "python3 -c 'import jax; print(jax.process_index(), jax.devices())'"


def preview(store: Store, target: Target, pod: str | None) -> tuple[Job, dict[str, Any]]:
    """The JobSet a runner (for jobs of ``pod`` and of no pod) would create next: for the
    queued job it would claim first (highest priority, then oldest), or for a sample job
    when none is queued."""
    queued = store.find(statuses=[JobStatus.PENDING], limit=10_000)
    queued = [job for job in queued if job.pod in (None, pod)]
    job = min(queued, key=lambda j: (-j.priority, j.id), default=None) or _sample_job()
    return job, render_jobset(job, 1, target)


def _sample_job() -> Job:
    return Job(
        id=0,
        name="sample",
        status=JobStatus.PENDING,
        code=None,
        command=SAMPLE_COMMAND,
        labels={},
        priority=0,
        timeout=None,
        pod=None,
        attempt=0,
        max_attempts=1,
        retries=0,
        lease_owner=None,
        lease_expires_at=None,
        cancel_requested=False,
        created_at=0.0,
        scheduled_at=None,
        started_at=None,
        completed_at=None,
        updated_at=0.0,
        result=None,
        error=None,
    )
