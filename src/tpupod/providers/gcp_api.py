"""The Cloud TPU API requests of a GCP pod, as plain data (for --dry-run and for the client).

One facade over two APIs: a plain single slice is a TPU VM (``nodes``);
multislice (``node_count > 1``), spot, reserved and best-effort capacity go
through Queued Resources. Bodies use the REST (JSON) field names of
``tpu.googleapis.com`` v2 (best-effort exists only in v2alpha1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpupod.choices import Capacity
from tpupod.spec import GcpPodSpec

API_ROOT = "https://tpu.googleapis.com"


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


def node_body(spec: GcpPodSpec, ssh_keys: str | None) -> dict[str, Any]:
    """A Node: type, runtime, network, scheduling, tags, labels and the pod's SSH key."""
    body: dict[str, Any] = {
        "acceleratorType": spec.tpu_type,
        "runtimeVersion": spec.runtime_version or spec.accelerator.default_runtime,
        "networkConfig": {"enableExternalIps": not spec.internal},
    }
    if spec.network:
        body["networkConfig"]["network"] = spec.network
    if spec.subnetwork:
        body["networkConfig"]["subnetwork"] = spec.subnetwork
    scheduling = {
        Capacity.PREEMPTIBLE: {"preemptible": True},
        Capacity.RESERVED: {"reserved": True},
        Capacity.SPOT: {"spot": True},
    }.get(spec.capacity)
    if scheduling:
        body["schedulingConfig"] = scheduling
    if spec.tags:
        body["tags"] = list(spec.tags)
    labels = {"created-by": "tpupod", **spec.labels}
    body["labels"] = labels
    if ssh_keys:
        body["metadata"] = {"ssh-keys": ssh_keys}
    return body


def create_request(spec: GcpPodSpec, project: str, ssh_keys: str | None) -> ApiRequest:
    node = node_body(spec, ssh_keys)
    where = parent(project, spec.zone)
    if not spec.queued:
        return ApiRequest("TPU VM (nodes)", "v2", "POST", f"{where}/nodes?nodeId={spec.name}", node)
    node_spec: dict[str, Any] = {"parent": where, "node": node}
    if spec.node_count > 1:
        node_spec["multisliceParams"] = {"nodeCount": spec.node_count, "nodeIdPrefix": spec.name}
    else:
        node_spec["nodeId"] = spec.name
    body: dict[str, Any] = {"tpu": {"nodeSpec": [node_spec]}}
    version = "v2"
    if spec.capacity is Capacity.SPOT:
        body["spot"] = {}
    elif spec.capacity is Capacity.BEST_EFFORT:
        body["bestEffort"] = {}
        version = "v2alpha1"
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
