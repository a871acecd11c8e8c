"""What a real API server would check of a JobSet: ``validate_jobset``, used by the
Kubernetes stand-in (``k8s_standin.py``) and the tests of the manifests.

kubernetes-validate has no JobSet schema (it is a CRD): the replicated Job templates are
checked as ``batch/v1`` Jobs with ``--strict`` schemas; the JobSet's own fields are
checked here against those jobset.x-k8s.io/v1alpha2 defines (names, types, required parts).
"""

from __future__ import annotations

import re
from typing import Any

from tpupod.jobs.k8s_manifest import API_VERSION

KUBERNETES_VERSION = "1.30.0"  # the schemas a manifest is validated against
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# The JobSet fields (spec and replicated job) that jobset.x-k8s.io/v1alpha2 defines.
JOBSET_SPEC_FIELDS = {
    "replicatedJobs",
    "network",
    "successPolicy",
    "failurePolicy",
    "startupPolicy",
    "suspend",
    "coordinator",
    "managedBy",
    "ttlSecondsAfterFinished",
}
REPLICATED_JOB_FIELDS = {"name", "replicas", "template", "dependsOn"}


def validate_jobset(body: Any, kubernetes_version: str = KUBERNETES_VERSION) -> list[str]:
    """What is wrong with a JobSet manifest (empty: nothing found), each problem naming its
    field. Job templates: kubernetes-validate's strict ``batch/v1`` schema; the rest: the
    JobSet fields by hand (there is no schema to check them against offline)."""
    import kubernetes_validate

    if not isinstance(body, dict):
        return ["the body is not a JSON object"]
    problems = []
    if body.get("apiVersion") != API_VERSION or body.get("kind") != "JobSet":
        problems.append(f"apiVersion/kind: want {API_VERSION} JobSet")
    meta = body.get("metadata") or {}
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not DNS_LABEL.match(name) or len(name) > 63:
        problems.append(f"metadata.name: {name!r} is not a DNS label")
    spec = body.get("spec")
    if not isinstance(spec, dict):
        return [*problems, "spec: missing"]
    problems += [f"spec.{k}: unknown field" for k in sorted(set(spec) - JOBSET_SPEC_FIELDS)]
    rjobs = spec.get("replicatedJobs")
    if not isinstance(rjobs, list) or not rjobs:
        return [*problems, "spec.replicatedJobs: a non-empty list is required"]
    for i, rjob in enumerate(rjobs):
        where = f"spec.replicatedJobs[{i}]"
        if not isinstance(rjob, dict):
            problems.append(f"{where}: not an object")
            continue
        problems += [
            f"{where}.{k}: unknown field" for k in sorted(set(rjob) - REPLICATED_JOB_FIELDS)
        ]
        if not isinstance(rjob.get("name"), str) or not DNS_LABEL.match(rjob["name"]):
            problems.append(f"{where}.name: {rjob.get('name')!r} is not a DNS label")
        replicas = rjob.get("replicas", 1)
        if not isinstance(replicas, int) or replicas < 1:
            problems.append(f"{where}.replicas: {replicas!r} is not a positive integer")
        template = rjob.get("template")
        if not isinstance(template, dict):
            problems.append(f"{where}.template: missing")
            continue
        as_job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {**(template.get("metadata") or {}), "name": f"{name}-{rjob.get('name')}"},
            "spec": template.get("spec"),
        }
        try:
            kubernetes_validate.validate(as_job, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{where}.template.{path}: {exc.message}")
    return problems
