"""The Cloud TPU API requests of a GCP pod, as plain data (for --dry-run and for the client).

One facade over two APIs: a plain single slice is a TPU VM (``nodes``);
multislice (``node_count > 1``), spot, reserved and best-effort capacity go
through Queued Resources (``api`` picks one on purpose). Bodies use the REST
(JSON) field names of ``tpu.googleapis.com`` v2 and are what gcloud sends
(``compute tpus tpu-vm create`` and ``compute tpus queued-resources create``):
a TPU VM's capacity is its ``schedulingConfig``; a queued resource's is its
tier at the top level (``spot: {}``, ``reservationName: .../reservations/-``,
v2alpha1's ``bestEffort: {}``), never the node's ``schedulingConfig``.
Best-effort exists only in v2alpha1, which names multislice ``multiNodeParams``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tpupod.errors import SpecError
from tpupod.pod.choices import Capacity
from tpupod.pod.spec import GcpPodSpec

GONE = "GONE"  # what live_state says of a cloud resource the cloud no longer has (a 404)
READY = {"READY", "ACTIVE"}
BROKEN = {"FAILED", "SUSPENDING", "SUSPENDED", "PREEMPTED", "TERMINATED", "STOPPED"}

API_ROOT = "https://tpu.googleapis.com"
NOT_TPU_VM = "--api tpu-vm (api: tpu-vm in a spec file)"
# A TPU VM's capacity, as its schedulingConfig (on-demand: none).
NODE_SCHEDULING = {
    Capacity.PREEMPTIBLE: {"preemptible": True},
    Capacity.RESERVED: {"reserved": True},
    Capacity.SPOT: {"spot": True},
}


@dataclass(frozen=True)
class ApiRequest:
    api: str  # which of the two APIs, in words
    version: str
    method: str
    path: str
    body: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return f"{API_ROOT}/{self.version}/{self.path}"


def parent(project: str, zone: str) -> str:
    return f"projects/{project}/locations/{zone}"


def check_api_choice(spec: GcpPodSpec) -> None:
    """Refuse what neither API makes: multislice or best-effort TPU VMs, preemptible
    queued resources (the Queued Resources API has no preemptible tier)."""
    if not spec.queued and spec.node_count > 1:
        raise SpecError(
            f"multislice ({spec.node_count} slices) needs a queued resource, not a TPU VM",
            hint=f"multislice goes through queued resources: drop {NOT_TPU_VM}",
        )
    if not spec.queued and spec.capacity is Capacity.BEST_EFFORT:
        raise SpecError(
            "best-effort capacity exists only for queued resources",
            hint=f"drop {NOT_TPU_VM}, or pick --capacity spot for a TPU VM",
        )
    if spec.queued and spec.capacity is Capacity.PREEMPTIBLE:
        raise SpecError(
            "preemptible capacity exists only for TPU VMs (one slice)",
            hint="--capacity spot (preemptible's successor) works for queued resources",
        )


def node_body(spec: GcpPodSpec, ssh_keys: str | None) -> dict[str, Any]:
    """A Node: type, runtime, network, scheduling (TPU VMs only), tags, labels and SSH key."""
    body: dict[str, Any] = {
        "acceleratorType": spec.tpu_type,
        "runtimeVersion": spec.runtime_version or spec.accelerator.default_runtime,
        "networkConfig": {"enableExternalIps": not spec.internal},
    }
    if spec.network:
        body["networkConfig"]["network"] = spec.network
    if spec.subnetwork:
        body["networkConfig"]["subnetwork"] = spec.subnetwork
    scheduling = NODE_SCHEDULING.get(spec.capacity)
    if scheduling and not spec.queued:
        body["schedulingConfig"] = scheduling
    if spec.tags:
        body["tags"] = list(spec.tags)
    labels = {"created-by": "tpupod", **spec.labels}
    body["labels"] = labels
    if ssh_keys:
        body["metadata"] = {"ssh-keys": ssh_keys}
    return body


def queued_tier(capacity: Capacity, where: str) -> dict[str, Any]:
    """A queued resource's tier, as gcloud sends it (on-demand: none)."""
    if capacity is Capacity.SPOT:
        return {"spot": {}}
    if capacity is Capacity.BEST_EFFORT:
        return {"bestEffort": {}}
    if capacity is Capacity.RESERVED:
        return {"reservationName": f"{where}/reservations/-"}  # any reservation that fits
    return {}


def create_request(spec: GcpPodSpec, project: str, ssh_keys: str | None) -> ApiRequest:
    check_api_choice(spec)
    node = node_body(spec, ssh_keys)
    where = parent(project, spec.zone)
    if not spec.queued:
        return ApiRequest("TPU VM (nodes)", "v2", "POST", f"{where}/nodes?nodeId={spec.name}", node)
    version = "v2alpha1" if spec.capacity is Capacity.BEST_EFFORT else "v2"
    node_spec: dict[str, Any] = {"parent": where, "node": node}
    if spec.node_count > 1:
        params = "multiNodeParams" if version == "v2alpha1" else "multisliceParams"
        node_spec[params] = {"nodeCount": spec.node_count, "nodeIdPrefix": spec.name}
    else:
        node_spec["nodeId"] = spec.name
    body = {"tpu": {"nodeSpec": [node_spec]}, **queued_tier(spec.capacity, where)}
    return ApiRequest(
        "Queued Resources",
        version,
        "POST",
        f"{where}/queuedResources?queuedResourceId={spec.name}",
        body,
    )


def delete_request(spec: GcpPodSpec, project: str) -> ApiRequest:
    where = parent(project, spec.zone)
    if spec.queued:
        return ApiRequest(
            "Queued Resources", "v2", "DELETE", f"{where}/queuedResources/{spec.name}?force=true"
        )
    return ApiRequest("TPU VM (nodes)", "v2", "DELETE", f"{where}/nodes/{spec.name}")


def worst_state(states: Sequence[str]) -> str:
    """One state for a pod of several TPUs: a preempted or broken slice's first, then a
    gone one's, then one not yet ready, else READY (the first's, for one TPU)."""
    for wanted in (BROKEN, {GONE}):
        found = [state for state in states if state in wanted]
        if found:
            return found[0]
    return next((state for state in states if state not in READY), states[0])
