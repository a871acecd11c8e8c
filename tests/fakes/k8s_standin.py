"""A stand-in for the Kubernetes API paths the Kubernetes runner calls, on one machine.

For the tests (run from the repository's root; a user who wants to see what the runner
sends has ``tpupod jobs worker --k8s ... --dry-run``)::

    python -m tests.fakes.k8s_standin --port 8100 --kubeconfig /tmp/standin.kubeconfig
    tpupod jobs worker --k8s --kubeconfig /tmp/standin.kubeconfig --tpu v5litepod-16 \
        --image IMG --worker-python "$(which python)"   # a Python that has tpupod

It serves create/get/list/delete of ``jobset.x-k8s.io/v1alpha2`` JobSets, the pod list and
pod logs (followed, with timestamps, ``sinceSeconds``), nothing else. Every JobSet it is
sent is checked with ``jobset_schema.validate_jobset`` (kubernetes-validate's strict
``batch/v1`` Job schema for each replicated Job; the JobSet's own fields by hand) and
refused with Kubernetes' 422 ``Invalid`` Status if anything is wrong.

Each replicated Job becomes its pods (Indexed: ``parallelism`` pods, completion index
in the annotation and label Kubernetes uses), each ``Pending`` for ``--pending`` seconds
(waiting for a TPU node), then ``Running``: the container's command runs here, as a
process group of its own, with the container's environment over this process's (the
image is not pulled: it is the local Python that runs), plus what GKE would add
(``JOB_COMPLETION_INDEX``, ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``). Its output is the
pod's log; its exit makes the pod ``Succeeded`` or ``Failed`` (``exitCode``). Deleting a
JobSet TERMs its pods' process groups, KILLs them after ``terminationGracePeriodSeconds``
and removes the pods once their processes are gone. Not simulated: a failed pod does not
end its sibling pods (the Job controller would; the runner deletes the JobSet anyway),
JobSet restarts, node pools and scheduling (every pod starts).

A test can take a pod away as a cluster would (``POST /standin/namespaces/NS/pods/NAME/evict``:
``Failed``, reason ``Evicted``, condition ``DisruptionTarget``) and see the processes
still alive (``GET /standin/processes``); those two paths are not Kubernetes'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.fakes.jobset_schema import KUBERNETES_VERSION, validate_jobset
from tpupod.jobs.k8s_manifest import (
    COMPLETION_INDEX,
    GROUP,
    JOBSET_NAME_LABEL,
    PLURAL,
    VERSION,
    worker_hostnames,
)
from tpupod.transport.base import Stream
from tpupod.transport.lines import read_lines

JOBSETS = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}"
FOLLOW_POLL_S = 0.05
DEFAULT_GRACE_S = 30


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> JSONResponse:
    """An error as the API server writes it (a ``Status`` object)."""
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return JSONResponse(body, status_code=code)


def _selected(labels: dict[str, str], selector: str | None) -> bool:
    """Kubernetes' equality-based label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class LogLine:
    at: float
    stamp: str
    text: str


@dataclass
class PodSim:
    """One simulated pod and the process that is its container."""

    namespace: str
    name: str
    jobset: str
    index: int
    labels: dict[str, str]
    spec: dict[str, Any]
    env: dict[str, str]
    created: str = field(default_factory=_now)
    phase: str = "Pending"
    reason: str | None = None
    message: str | None = None
    disruption: str | None = None  # DisruptionTarget's reason
    exit_code: int | None = None
    started: str | None = None
    finished: str | None = None
    deleting: bool = False
    proc: asyncio.subprocess.Process | None = None
    task: asyncio.Task[None] | None = None
    lines: list[LogLine] = field(default_factory=list)
    ended: bool = False  # the process exited and its output is all in ``lines``
    last_ns: int = 0

    @property
    def grace_s(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))

    def add_line(self, text: str) -> None:
        now = max(time.time_ns(), self.last_ns + 1)  # strictly increasing, as kubelet's are
        self.last_ns = now
        seconds, nanos = divmod(now, 1_000_000_000)
        when = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
        stamp = when.strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos:09d}Z"
        self.lines.append(LogLine(now / 1e9, stamp, text))

    def to_json(self) -> dict[str, Any]:
        container = self.spec["containers"][0]
        state: dict[str, Any]
        if self.phase == "Pending":
            state = {"waiting": {"reason": "ContainerCreating"}}
        elif self.phase == "Running":
            state = {"running": {"startedAt": self.started}}
        else:
            state = {
                "terminated": {
                    "exitCode": self.exit_code if self.exit_code is not None else 137,
                    "reason": "Completed" if self.exit_code == 0 else "Error",
                    "startedAt": self.started,
                    "finishedAt": self.finished,
                }
            }
        conditions = [{"type": "PodScheduled", "status": "True"}]
        if self.disruption:
            conditions.append(
                {"type": "DisruptionTarget", "status": "True", "reason": self.disruption}
            )
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container.get("image", ""),
                    "imageID": "",
                    "ready": self.phase == "Running",
                    "restartCount": 0,
                    "state": state,
                }
            ],
        }
        if self.reason:
            status["reason"], status["message"] = self.reason, self.message
        meta: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": self.labels,
            "annotations": {COMPLETION_INDEX: str(self.index)},
            "creationTimestamp": self.created,
        }
        if self.deleting:
            meta["deletionTimestamp"] = _now()
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": self.spec,
            "status": status,
        }


class StandIn:
    """The stand-in's objects and the pods' lifecycle."""

    def __init__(self, *, pending_s: float = 0.5, kubernetes_version: str = KUBERNETES_VERSION):
        self.pending_s = pending_s
        self.kubernetes_version = kubernetes_version
        self.jobsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], PodSim] = {}
        self.accepted = 0
        self.rejected: list[str] = []
        self.version = 1

    def _next_version(self) -> str:
        self.version += 1
        return str(self.version)

    def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        meta.update(
            namespace=namespace,
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            resourceVersion=self._next_version(),
        )
        body["status"] = {}
        self.jobsets[(namespace, meta["name"])] = body
        self.accepted += 1
        for rjob in body["spec"]["replicatedJobs"]:
            for job_index in range(int(rjob.get("replicas", 1))):
                self._make_pods(namespace, body, rjob, job_index)
        return body

    def _make_pods(
        self, namespace: str, jobset: dict[str, Any], rjob: dict[str, Any], job_index: int
    ) -> None:
        name = jobset["metadata"]["name"]
        job_spec = rjob["template"]["spec"]
        count = int(job_spec.get("parallelism", 1))
        template = job_spec["template"]
        hostnames = ",".join(worker_hostnames(name, count))
        for index in range(count):
            pod_name = f"{name}-{rjob['name']}-{job_index}-{index}-{secrets.token_hex(3)[:5]}"
            labels = {
                **(template.get("metadata") or {}).get("labels", {}),
                JOBSET_NAME_LABEL: name,
                "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                "jobset.sigs.k8s.io/job-index": str(job_index),
                "job-name": f"{name}-{rjob['name']}-{job_index}",
                COMPLETION_INDEX: str(index),
            }
            gke = {
                "JOB_COMPLETION_INDEX": str(index),
                "TPU_WORKER_ID": str(index),
                "TPU_WORKER_HOSTNAMES": hostnames,
                "HOSTNAME": pod_name,
            }
            pod = PodSim(namespace, pod_name, name, index, labels, template["spec"], gke)
            self.pods[(namespace, pod_name)] = pod
            pod.task = asyncio.get_running_loop().create_task(self._run(pod))

    def _environment(self, pod: PodSim, container: dict[str, Any]) -> dict[str, str]:
        env = {**os.environ, **pod.env}
        refs = {
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            f"metadata.annotations['{COMPLETION_INDEX}']": str(pod.index),
            f"metadata.labels['{COMPLETION_INDEX}']": str(pod.index),
        }
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
            else:
                path = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
                if path in refs:
                    env[item["name"]] = refs[path]
        return env

    async def _run(self, pod: PodSim) -> None:
        await asyncio.sleep(self.pending_s)  # waiting for a TPU node
        if pod.deleting:
            return
        container = pod.spec["containers"][0]
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        pod.started = _now()
        if not argv:
            pod.reason, pod.message = "StandIn", "the stand-in runs a container's command only"
            pod.phase, pod.exit_code, pod.finished, pod.ended = "Failed", 127, _now(), True
            return
        pod.proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self._environment(pod, container),
            start_new_session=True,
        )
        pod.phase = "Running"
        assert pod.proc.stdout is not None
        async for line in read_lines([(Stream.STDOUT, pod.proc.stdout)]):
            pod.add_line(line.text)
        code = await pod.proc.wait()
        pod.exit_code = 128 - code if code < 0 else code  # a signal: 128 + its number
        pod.finished = _now()
        pod.phase = "Succeeded" if code == 0 and not pod.disruption else "Failed"
        pod.ended = True
        if pod.deleting:
            self.pods.pop((pod.namespace, pod.name), None)

    def _signal(self, pod: PodSim, signum: int) -> None:
        if pod.proc is not None and pod.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.proc.pid, signum)

    async def _stop(self, pod: PodSim) -> None:
        """TERM the pod's processes, KILL them after its grace period."""
        self._signal(pod, signal.SIGTERM)
        deadline = time.monotonic() + pod.grace_s
        while pod.proc is not None and pod.proc.returncode is None:
            if time.monotonic() > deadline:
                self._signal(pod, signal.SIGKILL)
            await asyncio.sleep(0.05)
        # what the command left in its group goes too, as a container's would
        self._signal(pod, signal.SIGKILL)
        if pod.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.proc.pid, signal.SIGKILL)

    def delete(self, namespace: str, name: str) -> dict[str, Any] | None:
        jobset = self.jobsets.pop((namespace, name), None)
        if jobset is None:
            return None
        for pod in [p for p in self.pods.values() if (p.namespace, p.jobset) == (namespace, name)]:
            pod.deleting = True
            if pod.proc is None:  # not started: it goes at once
                if pod.task is not None:
                    pod.task.cancel()
                self.pods.pop((namespace, pod.name), None)
            elif pod.ended:
                self.pods.pop((namespace, pod.name), None)
            else:
                asyncio.get_running_loop().create_task(self._stop(pod))
        return jobset

    def evict(self, pod: PodSim, reason: str) -> None:
        pod.reason = reason
        pod.message = f"the stand-in {reason.lower()} this pod"
        pod.disruption = (
            "PreemptionByScheduler" if reason == "Preempted" else "EvictionByEvictionAPI"
        )
        if pod.proc is None:
            if pod.task is not None:
                pod.task.cancel()
            pod.phase, pod.finished, pod.ended = "Failed", _now(), True
        else:
            asyncio.get_running_loop().create_task(self._stop(pod))

    def jobset_json(self, body: dict[str, Any]) -> dict[str, Any]:
        """The JobSet with a status as JobSet's controller would write it."""
        meta = body["metadata"]
        pods = [
            p
            for p in self.pods.values()
            if (p.namespace, p.jobset) == (meta["namespace"], meta["name"])
        ]
        conditions = []
        failed = [p for p in pods if p.phase == "Failed"]
        if failed:
            conditions.append(
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "FailedJobs",
                    "message": failed[0].name,
                }
            )
        elif pods and all(p.phase == "Succeeded" for p in pods):
            conditions.append({"type": "Completed", "status": "True", "reason": "AllJobsCompleted"})
        return {**body, "status": {"conditions": conditions}}

    async def close(self) -> None:
        for pod in list(self.pods.values()):
            if pod.task is not None and pod.proc is None:
                pod.task.cancel()
            self._signal(pod, signal.SIGKILL)


def create_app(standin: StandIn, token: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await standin.close()

    def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        if token is not None and authorization != f"Bearer {token}":
            raise _Unauthorized

    app = FastAPI(title="tpupod Kubernetes stand-in", lifespan=lifespan)
    app.state.standin = standin
    guarded = [Depends(authorized)]

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        return _status(401, "Unauthorized", "Unauthorized")

    _jobset_routes(app, standin, guarded)
    _pod_routes(app, standin, guarded)
    return app


def _jobset_routes(app: FastAPI, standin: StandIn, guarded: list[Any]) -> None:
    @app.post(JOBSETS, dependencies=guarded)
    async def create(ns: str, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _status(400, "BadRequest", "the body is not JSON")
        problems = validate_jobset(body, standin.kubernetes_version)
        name = (body.get("metadata") or {}).get("name") if isinstance(body, dict) else None
        if problems:
            standin.rejected.append(str(name))
            message = f'JobSet.{GROUP} "{name}" is invalid: ' + "; ".join(problems)
            return _status(422, "Invalid", message)
        if (ns, name) in standin.jobsets:
            return _status(409, "AlreadyExists", f'jobsets.{GROUP} "{name}" already exists')
        return JSONResponse(standin.create(ns, body), status_code=201)

    @app.get(JOBSETS, dependencies=guarded)
    async def list_jobsets(ns: str, labelSelector: str | None = None) -> dict[str, Any]:
        items = [
            standin.jobset_json(body)
            for (where, _), body in standin.jobsets.items()
            if where == ns and _selected(body["metadata"].get("labels") or {}, labelSelector)
        ]
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "JobSetList",
            "metadata": {"resourceVersion": str(standin.version)},
            "items": items,
        }

    @app.get(JOBSETS + "/{name}", dependencies=guarded, response_model=None)
    async def get_jobset(ns: str, name: str) -> dict[str, Any] | JSONResponse:
        body = standin.jobsets.get((ns, name))
        if body is None:
            return _status(404, "NotFound", f'jobsets.{GROUP} "{name}" not found')
        return standin.jobset_json(body)

    @app.delete(JOBSETS + "/{name}", dependencies=guarded, response_model=None)
    async def delete_jobset(ns: str, name: str) -> dict[str, Any] | JSONResponse:
        if standin.delete(ns, name) is None:
            return _status(404, "NotFound", f'jobsets.{GROUP} "{name}" not found')
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}


def _pod_routes(app: FastAPI, standin: StandIn, guarded: list[Any]) -> None:
    @app.get("/api/v1/namespaces/{ns}/pods", dependencies=guarded)
    async def list_pods(ns: str, labelSelector: str | None = None) -> dict[str, Any]:
        items = [
            pod.to_json()
            for (where, _), pod in standin.pods.items()
            if where == ns and _selected(pod.labels, labelSelector)
        ]
        meta = {"resourceVersion": str(standin.version)}
        return {"apiVersion": "v1", "kind": "PodList", "metadata": meta, "items": items}

    @app.get("/api/v1/namespaces/{ns}/pods/{name}/log", dependencies=guarded, response_model=None)
    async def pod_log(
        ns: str,
        name: str,
        *,
        container: str | None = None,
        follow: bool = False,
        timestamps: bool = False,
        since_seconds: Annotated[int | None, Query(alias="sinceSeconds", ge=1)] = None,
    ) -> Response:
        pod = standin.pods.get((ns, name))
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        wanted = pod.spec["containers"][0]["name"]
        if container not in (None, wanted):
            return _status(400, "BadRequest", f"container {container} is not valid for pod {name}")
        if pod.proc is None and pod.phase == "Pending":
            message = f'container "{wanted}" in pod "{name}" is waiting to start: ContainerCreating'
            return _status(400, "BadRequest", message)
        since = None if since_seconds is None else time.time() - since_seconds

        def shown(line: LogLine) -> str:
            return f"{line.stamp} {line.text}\n" if timestamps else f"{line.text}\n"

        def fresh(lines: list[LogLine]) -> list[LogLine]:
            return lines if since is None else [ln for ln in lines if ln.at >= since]

        if not follow:
            return PlainTextResponse("".join(shown(ln) for ln in fresh(pod.lines)))

        async def stream() -> AsyncIterator[str]:
            sent = 0
            while True:
                lines = pod.lines[sent:]
                sent += len(lines)
                if chunk := "".join(shown(ln) for ln in fresh(lines)):
                    yield chunk
                if pod.ended and sent == len(pod.lines):
                    return
                if standin.pods.get((ns, name)) is not pod and pod.ended:
                    return
                await asyncio.sleep(FOLLOW_POLL_S)

        return StreamingResponse(stream(), media_type="text/plain")

    @app.post(
        "/standin/namespaces/{ns}/pods/{name}/evict", dependencies=guarded, response_model=None
    )
    async def evict(ns: str, name: str, reason: str = "Evicted") -> dict[str, Any] | JSONResponse:
        pod = standin.pods.get((ns, name))
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        standin.evict(pod, reason)
        return {"evicted": name}

    @app.get("/standin/processes", dependencies=guarded)
    async def processes() -> dict[str, Any]:
        """Every pod process the stand-in started that has not exited."""
        live = {
            pod.name: pod.proc.pid
            for pod in standin.pods.values()
            if pod.proc is not None and pod.proc.returncode is None
        }
        return {"live": live, "accepted": standin.accepted, "rejected": standin.rejected}


class _Unauthorized(Exception):
    pass


def kubeconfig_text(url: str, token: str | None, namespace: str = "default") -> str:
    """A kubeconfig whose one context is the stand-in (JSON is YAML)."""
    import json

    user: dict[str, Any] = {"token": token} if token else {}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "standin", "cluster": {"server": url}}],
        "users": [{"name": "standin", "user": user}],
        "contexts": [
            {
                "name": "standin",
                "context": {"cluster": "standin", "user": "standin", "namespace": namespace},
            }
        ],
        "current-context": "standin",
    }
    return json.dumps(config, indent=2)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.k8s_standin", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="it runs the commands it is sent: loopback, or --token"
    )
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--pending", type=float, default=0.5, help="seconds a pod is Pending")
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for it here")
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    args = parser.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.token:
        parser.error(f"--host {args.host} without --token would run anyone's commands")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    if args.kubeconfig is not None:
        args.kubeconfig.write_text(kubeconfig_text(url, args.token))
    standin = StandIn(pending_s=args.pending, kubernetes_version=args.kubernetes_version)
    app = create_app(standin, args.token)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    print(f"Kubernetes stand-in on {url}", flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
