"""The Kubernetes runner: each attempt of a job is a JobSet on a GKE TPU slice.

``KubernetesExecutor`` is an ``Executor`` like the local and pod ones, so the runner's
loop (claim, lease, heartbeats, fenced writes, reaping) is the same: it creates the
attempt's JobSet (``k8s_manifest``), polls its pods, follows every pod's log (one thread a
pod: the client's log stream blocks) and ends in an ``Outcome``:

- every pod printed the start marker: the job is ``running``; all pods succeeded:
  ``completed`` with worker 0's result;
- a pod that failed on its own (its program exited non-zero) fails the attempt, naming the
  worker and its last line; a pod the cluster took away (evicted, preempted, its node
  lost) ends the attempt with ``retry``: the job runs again until ``max_attempts``;
- a timeout (counted from the moment every pod started: waiting for TPU nodes is not
  running), a cancel, a lost lease or the runner stopping delete the JobSet.

Every attempt's JobSet is deleted when the attempt ends, and the runner waits until its
pods are gone. A runner killed outright leaves its JobSet behind: ``tidy``, which every
Kubernetes runner calls when it reaps, deletes the JobSets of this store whose attempt is
no longer the job's leased one.

All API calls go through ``Cluster`` (the official client, blocking, in threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tpupod import settings
from tpupod.errors import JobError, JobNotFound, UsageError
from tpupod.jobs.attempt import Hooks, Marks, Outcome
from tpupod.jobs.code import MARK
from tpupod.jobs.k8s_manifest import (
    ATTEMPT_LABEL,
    COMPLETION_INDEX,
    CONTAINER,
    GROUP,
    JOB_LABEL,
    JOBSET_NAME_LABEL,
    MANAGED_BY,
    PLURAL,
    STORE_LABEL,
    VERSION,
    Target,
    render_jobset,
)
from tpupod.jobs.models import LEASED, Job, JobStatus

if TYPE_CHECKING:
    from tpupod.jobs.store import Store

POLL_S = 0.5
LOG_RECONNECT_S = 0.5
LOG_SLACK_S = 10  # a reconnect asks for this much more than it lost (clock skew)
GONE_WAIT_S = 15.0  # beyond the pods' grace period, for them to go after a delete
DRAIN_S = 5.0  # for a finished pod's log to arrive in full
NO_PODS_S = 60.0  # then say once that the JobSet has made no pods
REQUEST_TIMEOUT = (10.0, 60.0)  # connect, read (a quiet log stream reconnects after this)

# A pod the cluster took away, not one whose program failed: the attempt is retried.
DISRUPTIONS = {"Evicted", "Preempted", "Shutdown", "Terminated", "NodeLost", "NodeShutdown"}
# A container that cannot start: waiting for these never ends, so the attempt fails.
STUCK = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
}


class KubernetesError(JobError):
    """An API call that failed; ``status`` is the HTTP status (None: no answer at all)."""

    def __init__(self, message: str, *, hint: str, status: int | None) -> None:
        super().__init__(message, hint=hint)
        self.status = status

    @property
    def refused(self) -> bool:
        """The API server answered no (4xx): asking again will not help."""
        return self.status is not None and 400 <= self.status < 500


class Cluster:
    """The Kubernetes API calls the runner makes, in one namespace. Blocking (call from a
    thread); an error is a ``JobError`` with Kubernetes' own message."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)

    def create(self, body: dict[str, Any]) -> None:
        with _translated("create JobSet"):
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, body, _request_timeout=REQUEST_TIMEOUT
            )

    def get(self, name: str) -> dict[str, Any] | None:
        """The JobSet, or None when there is none of that name."""
        with _translated("read JobSet"):
            try:
                found = self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, name, _request_timeout=REQUEST_TIMEOUT
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
        return cast(dict[str, Any], found)

    def jobsets(self, selector: str) -> list[dict[str, Any]]:
        with _translated("list JobSets"):
            found = self.custom.list_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                label_selector=selector,
                _request_timeout=REQUEST_TIMEOUT,
            )
        return list(cast(dict[str, Any], found).get("items") or [])

    def delete(self, name: str) -> bool:
        """Delete a JobSet and, in the background, its Jobs and pods; False if it was gone."""
        with _translated("delete JobSet"):
            try:
                self.custom.delete_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    name,
                    propagation_policy="Background",
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
        return True

    def pods(self, selector: str) -> list[dict[str, Any]]:
        """Pods as plain JSON (the client's models are not needed, and reject little)."""
        with _translated("list pods"):
            response = self.core.list_namespaced_pod(
                self.namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
            data = cast(Any, response).data  # _preload_content=False: the raw response
            items: list[dict[str, Any]] = json.loads(data).get("items") or []
        return items

    def log_stream(self, pod: str, since_seconds: int | None) -> Any:
        """A pod's log, followed, with a timestamp on every line (an urllib3 response)."""
        with _translated("read pod log"):
            return self.core.read_namespaced_pod_log(
                pod,
                self.namespace,
                container=CONTAINER,
                follow=True,
                timestamps=True,
                since_seconds=since_seconds,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )


@contextlib.contextmanager
def _translated(what: str) -> Any:
    try:
        yield
    except ApiException as exc:
        raise KubernetesError(
            f"Kubernetes: {what}: {exc.status} {_reason(exc)}",
            hint="check the runner's kubeconfig, namespace and permissions",
            status=exc.status,
        ) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise KubernetesError(
            f"Kubernetes: {what}: {exc}",
            hint="is the cluster's API server reachable from here?",
            status=None,
        ) from exc


def _reason(exc: Any) -> str:
    """Kubernetes' message from a Status body, else the HTTP reason."""
    try:
        body = json.loads(exc.body)
        return str(body.get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)


def connect(
    *, kubeconfig: str | None, context: str | None, namespace: str, pool: int = 16
) -> Cluster:
    """A ``Cluster`` from a kubeconfig (``--kubeconfig``, $KUBECONFIG, ~/.kube/config), or
    the pod's service account when the runner itself runs in the cluster."""

    configuration = client.Configuration()
    try:
        if kubeconfig is None and context is None and settings.in_kubernetes_pod():
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
    except (config.ConfigException, OSError) as exc:
        raise UsageError(
            f"no Kubernetes cluster to use: {exc}",
            hint="--kubeconfig FILE and --context NAME, or run the runner inside the cluster",
        ) from exc
    # the log followers hold a connection each while a job runs
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, pool)
    return Cluster(client.ApiClient(configuration), namespace)


def _pod_index(pod: dict[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    found = (meta.get("annotations") or {}).get(COMPLETION_INDEX) or (meta.get("labels") or {}).get(
        COMPLETION_INDEX
    )
    try:
        return int(str(found))
    except ValueError:
        return None


def _timestamp_key(stamp: str) -> tuple[int, int] | None:
    """An RFC 3339 UTC timestamp (kubelet's, nanoseconds at most) as (seconds, nanoseconds)."""
    try:
        whole = datetime.datetime.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
    fraction = stamp[20:].rstrip("Z") if len(stamp) > 20 and stamp[19] == "." else ""
    if not fraction.isdigit() and fraction:
        return None
    seconds = int(whole.replace(tzinfo=datetime.UTC).timestamp())
    return seconds, int((fraction or "0").ljust(9, "0")[:9])


class _LogFollower(threading.Thread):
    """Follows one pod's log into ``push(worker, line)``; a dropped stream is resumed from
    the last line's time (lines at or before it are skipped), so no line comes twice. Ends
    after one full read that began once the pod had finished."""

    def __init__(
        self, cluster: Cluster, pod: str, worker: int, push: Callable[[int, str], None]
    ) -> None:
        super().__init__(name=f"log {pod}", daemon=True)
        self.cluster, self.pod, self.worker, self.push = cluster, pod, worker, push
        self.finished = threading.Event()  # the pod has finished: the next read is the last
        self.stopped = threading.Event()  # give up now (the attempt ended)
        self.last: tuple[int, int] | None = None

    def run(self) -> None:
        while not self.stopped.is_set():
            final = self.finished.is_set()
            try:
                self._read_once()
            except Exception:
                if final and self.stopped.wait(LOG_RECONNECT_S):
                    return
            if final:
                return
            self.stopped.wait(LOG_RECONNECT_S)

    def _read_once(self) -> None:
        since = None
        if self.last is not None:
            since = max(1, int(time.time()) - self.last[0] + LOG_SLACK_S)
        response = self.cluster.log_stream(self.pod, since)
        try:
            pending = b""
            for chunk in response.stream(65536, decode_content=True):
                if self.stopped.is_set():
                    return
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._line(raw)
            if pending:
                self._line(pending)
        finally:
            response.release_conn()

    def _line(self, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        stamp, _, rest = text.partition(" ")
        key = _timestamp_key(stamp)
        if key is None:  # no timestamp: keep the line whole
            self.push(self.worker, text)
            return
        if self.last is not None and key <= self.last:
            return
        self.last = key
        self.push(self.worker, rest)


class KubernetesExecutor:
    """Runs each attempt as a JobSet (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        target: Target,
        *,
        poll_s: float = POLL_S,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.cluster, self.target, self.poll_s = cluster, target, poll_s
        self.say = on_event or (lambda text: None)

    async def execute(self, job: Job, attempt: int, hooks: Hooks, stop: asyncio.Event) -> Outcome:
        body = render_jobset(job, attempt, self.target)
        name = body["metadata"]["name"]
        try:
            await asyncio.to_thread(self.cluster.create, body)
        except KubernetesError as exc:  # refused: failed; the API server away: run it again
            error = f"JobSet {name} not created: {exc.message}"
            return Outcome(JobStatus.FAILED, error=error, retry=not exc.refused)
        followers: dict[str, _LogFollower] = {}
        try:
            return await _Attempt(
                self, job, name, hooks=hooks, stop=stop, followers=followers
            ).watch()
        finally:
            await self._remove(name, followers)

    async def _remove(self, name: str, followers: dict[str, _LogFollower]) -> None:
        """Delete the JobSet and wait (bounded) until its pods are gone."""
        try:
            await asyncio.to_thread(self.cluster.delete, name)
            deadline = time.monotonic() + self.target.grace_s + GONE_WAIT_S
            while time.monotonic() < deadline:
                if not await asyncio.to_thread(self.cluster.pods, _pods_of(name)):
                    break
                await asyncio.sleep(self.poll_s / 2)
            else:
                self.say(f"JobSet {name}: pods still there {GONE_WAIT_S:g} s after the delete")
        except JobError as exc:  # tidy() deletes it later
            self.say(f"JobSet {name}: {exc.message}")
        finally:
            for follower in followers.values():
                follower.stopped.set()
            for follower in followers.values():
                await asyncio.to_thread(follower.join, 1.0)

    async def tidy(self, store: Store) -> int:
        """Delete this store's JobSets whose attempt is not the job's leased one (a lost
        runner's, or one whose delete failed); returns how many."""
        selector = f"{MANAGED_BY}=tpupod,{STORE_LABEL}={self.target.store or 'none'}"
        removed = 0
        for jobset in await asyncio.to_thread(self.cluster.jobsets, selector):
            meta = jobset.get("metadata") or {}
            labels = meta.get("labels") or {}
            try:
                job_id, attempt = int(labels[JOB_LABEL]), int(labels[ATTEMPT_LABEL])
            except (KeyError, ValueError):
                continue
            try:
                job: Job | None = await asyncio.to_thread(store.get, job_id)
            except JobNotFound:
                job = None
            if job is not None and job.status in LEASED and job.attempt == attempt:
                continue
            if await asyncio.to_thread(self.cluster.delete, meta["name"]):
                removed += 1
                self.say(f"deleted JobSet {meta['name']}: its attempt is over (runner lost)")
        return removed


def _pods_of(name: str) -> str:
    return f"{JOBSET_NAME_LABEL}={name}"


class _Attempt:
    """One attempt's watch: pods, their logs, the outcome."""

    def __init__(
        self,
        executor: KubernetesExecutor,
        job: Job,
        name: str,
        *,
        hooks: Hooks,
        stop: asyncio.Event,
        followers: dict[str, _LogFollower],
    ) -> None:
        self.executor, self.cluster = executor, executor.cluster
        self.job, self.name, self.stop, self.followers = job, name, stop, followers
        self.hosts = executor.target.slice.hosts
        self.marks = Marks(self.hosts, hooks)
        self.last: dict[int, str] = {}
        self.lines: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.started_at: float | None = None
        self.created_at = time.monotonic()
        self.hinted = False

    def _push(self, worker: int, text: str) -> None:  # from the follower threads
        self.loop.call_soon_threadsafe(self.lines.put_nowait, (worker, text))

    def _drain(self) -> None:
        while not self.lines.empty():
            worker, text = self.lines.get_nowait()
            self.marks.line(worker, text)
            if text.strip() and not text.startswith(MARK):
                self.last[worker] = text
        if self.started_at is None and len(self.marks.started) == self.hosts:
            self.started_at = time.monotonic()

    async def watch(self) -> Outcome:
        while True:
            self._drain()
            if self.stop.is_set():
                return Outcome(JobStatus.CANCELLED, error="stopped")
            timeout = self.job.timeout
            if timeout and self.started_at and time.monotonic() - self.started_at > timeout:
                return Outcome(JobStatus.FAILED, error=f"timed out after {timeout:g} s")
            try:
                pods = await asyncio.to_thread(self.cluster.pods, _pods_of(self.name))
                jobset = await asyncio.to_thread(self.cluster.get, self.name)
            except JobError as exc:  # the API server is away: the lease covers a while
                self.executor.say(f"job {self.job.id}: {exc.message}; retrying")
                pods, jobset = None, {}
            if jobset is None:
                return Outcome(JobStatus.FAILED, error=f"JobSet {self.name} deleted outside tpupod")
            if pods is not None and (outcome := await self._judge(pods)) is not None:
                return outcome
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.executor.poll_s)

    async def _judge(self, pods: list[dict[str, Any]]) -> Outcome | None:
        """Follow the logs of pods that run; an outcome once the pods say how it ended."""
        by_worker: dict[int, dict[str, Any]] = {}
        for pod in pods:
            index = _pod_index(pod)
            if index is None:
                continue
            by_worker[index] = pod
            name = pod["metadata"]["name"]
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Running", "Succeeded", "Failed") and name not in self.followers:
                follower = _LogFollower(self.cluster, name, index, self._push)
                self.followers[name] = follower
                follower.start()
            if phase in ("Succeeded", "Failed") and name in self.followers:
                self.followers[name].finished.set()
        if not by_worker and not self.hinted and time.monotonic() - self.created_at > NO_PODS_S:
            self.hinted = True  # JobSet's controller makes the pods: is it installed?
            self.executor.say(
                f"JobSet {self.name}: no pods after {NO_PODS_S:g} s "
                "(is the JobSet controller installed in the cluster?)"
            )
        failed = sorted(w for w, p in by_worker.items() if _phase(p) == "Failed")
        if failed:
            worker = failed[0]
            pod = by_worker[worker]
            await self._drained([pod["metadata"]["name"]])
            return self._failure(worker, pod)
        for worker, pod in sorted(by_worker.items()):
            if (reason := _stuck(pod)) is not None:
                where = f"w{worker} ({pod['metadata']['name']})"
                return Outcome(JobStatus.FAILED, error=f"{where} cannot start: {reason}")
        done = [w for w, p in by_worker.items() if _phase(p) == "Succeeded"]
        if len(done) == self.hosts:
            await self._drained([p["metadata"]["name"] for p in by_worker.values()])
            return Outcome(JobStatus.COMPLETED, result=self.marks.result)
        return None

    async def _drained(self, names: list[str]) -> None:
        deadline = time.monotonic() + DRAIN_S
        for name in names:
            follower = self.followers.get(name)
            if follower is not None:
                await asyncio.to_thread(follower.join, max(0.0, deadline - time.monotonic()))
        self._drain()

    def _failure(self, worker: int, pod: dict[str, Any]) -> Outcome:
        status = pod.get("status") or {}
        where = f"w{worker} ({pod['metadata']['name']})"
        reason = status.get("reason") or ""
        disrupted = reason in DISRUPTIONS or any(
            c.get("type") == "DisruptionTarget" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if disrupted:
            said = status.get("message") or reason or "disrupted"
            return Outcome(
                JobStatus.FAILED, error=f"{where} {reason or 'lost'}: {said}", retry=True
            )
        terminated = _terminated(status)
        if terminated is None:
            ended = reason or "failed"
        else:
            code = terminated.get("exitCode")
            ended = f"exit {code}" if terminated.get("signal") is None else "killed"
        last = self.last.get(worker, "(no output)")
        return Outcome(JobStatus.FAILED, error=f"{where} {ended}: {last}")


def _phase(pod: dict[str, Any]) -> str | None:
    phase = (pod.get("status") or {}).get("phase")
    return str(phase) if phase is not None else None


def _terminated(status: dict[str, Any]) -> dict[str, Any] | None:
    for container in status.get("containerStatuses") or []:
        if container.get("name") == CONTAINER:
            found = (container.get("state") or {}).get("terminated")
            return dict(found) if found else None
    return None


def _stuck(pod: dict[str, Any]) -> str | None:
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK:
            return f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return None
