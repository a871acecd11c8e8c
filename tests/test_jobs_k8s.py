"""The Kubernetes runner: its JobSets (validated with kubernetes-validate's strict schemas),
and the whole path through the official ``kubernetes`` client against the stand-in API
(``tests/fakes/k8s_standin.py``, a real HTTP server in its own process whose pods are real
processes): a job claimed from the store becomes a JobSet, its pods' logs and result come
back fenced, a failed pod fails the attempt naming its worker, an evicted one retries it
until max_attempts, cancel and timeout delete the JobSet, and a runner killed with -9
leaves a JobSet the next runner deletes while the job runs again."""

from __future__ import annotations

import asyncio
import copy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.conftest import CliResult, tpupod_argv
from tests.fakes.jobset_schema import validate_jobset
from tests.test_jobs import db_url, postgres  # noqa: F401  (SQLite and PostgreSQL, as there)
from tpupod.errors import JobError, LeaseLost, UsageError
from tpupod.jobs import claims
from tpupod.jobs.k8s import Cluster, KubernetesExecutor, connect
from tpupod.jobs.k8s_manifest import (
    ACCELERATOR_SELECTOR,
    TOPOLOGY_SELECTOR,
    Target,
    jobset_name,
    render_jobset,
    tpu_slice,
)
from tpupod.jobs.models import Claim, Job, JobRequest, JobStatus
from tpupod.jobs.runner import Runner
from tpupod.jobs.store import Store, store_label

TOKEN = "standin-token"
REPO = Path(__file__).resolve().parents[1]  # where ``python -m tests.fakes...`` runs
NAMESPACE = "tpu-jobs"


def _job(**changes: Any) -> Job:
    values: dict[str, Any] = {
        "id": 7,
        "name": "",
        "status": JobStatus.SCHEDULED,
        "code": None,
        "command": "echo hi",
        "labels": {},
        "priority": 0,
        "timeout": None,
        "pod": None,
        "attempt": 1,
        "max_attempts": 3,
        "lease_owner": "me",
        "lease_expires_at": None,
        "cancel_requested": False,
        "created_at": 0.0,
        "scheduled_at": None,
        "started_at": None,
        "completed_at": None,
        "updated_at": 0.0,
        "result": None,
        "error": None,
    }
    return Job(**{**values, **changes})


# -- the manifest -------------------------------------------------------------------------


def test_jobset_gang_runs_one_pod_per_tpu_vm_of_the_slice() -> None:
    target = Target(tpu_slice("v5litepod-16"), image="img:1", namespace=NAMESPACE, store="s1")
    body = render_jobset(_job(code="result = 1", command=None), 2, target)
    assert body["metadata"]["name"] == "tpupod-s1-7-2"
    labels = body["metadata"]["labels"]
    assert labels["tpupod.dev/job-id"] == "7" and labels["tpupod.dev/attempt"] == "2"
    (rjob,) = body["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 1
    job_spec = rjob["template"]["spec"]
    assert job_spec["completionMode"] == "Indexed"
    assert job_spec["parallelism"] == job_spec["completions"] == 4  # 16 chips, 4 per VM
    assert job_spec["backoffLimit"] == 0  # retries are the store's
    pod = job_spec["template"]["spec"]
    assert pod["nodeSelector"] == {
        ACCELERATOR_SELECTOR: "tpu-v5-lite-podslice",
        TOPOLOGY_SELECTOR: "4x4",
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": "4"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TPUPOD_NUM_WORKERS"] == "4" and env["TPUPOD_JOB_ATTEMPT"] == "2"
    assert len(env["TPUPOD_WORKER_HOSTNAMES"].split(",")) == 4
    assert "TPUPOD_JOB_CODE" in env
    assert validate_jobset(body) == []
    assert tpu_slice("v4-16").topology == "2x2x2" and tpu_slice("v4-16").hosts == 2
    assert tpu_slice("v6e-8").hosts == 1 and tpu_slice("v6e-8").chips_per_host == 8


@pytest.mark.parametrize(
    ("tpu", "topology", "said"),
    [
        ("v3-8", None, "GKE has no v3"),
        ("v5litepod-16", "2x4", "does not fit"),
        ("v4-16", "2x4", "does not fit"),  # v4 writes 3-D topologies
        ("v5litepod-3", None, "unknown TPU type"),
    ],
)
def test_a_slice_that_cannot_be_is_refused(tpu: str, topology: str | None, said: str) -> None:
    with pytest.raises(UsageError, match=said):
        tpu_slice(tpu, topology)


def test_validation_names_the_field_that_is_wrong() -> None:
    target = Target(tpu_slice("v4-8"), image="img")
    good = render_jobset(_job(), 1, target)
    bad = copy.deepcopy(good)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "bogus"
    ] = 1
    (problem,) = validate_jobset(bad)
    assert "containers.0" in problem and "'bogus' was unexpected" in problem
    bad = copy.deepcopy(good)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = "four"
    (problem,) = validate_jobset(bad)
    assert "template.spec.parallelism" in problem
    bad = copy.deepcopy(good)
    bad["spec"]["replicatedJob"] = bad["spec"].pop("replicatedJobs")
    assert "spec.replicatedJob: unknown field" in validate_jobset(bad)
    bad = copy.deepcopy(good)
    bad["metadata"]["name"] = "Tpupod_7"
    assert any("metadata.name" in p for p in validate_jobset(bad))


# -- against the stand-in -----------------------------------------------------------------


@dataclass
class StandIn:
    url: str
    kubeconfig: Path
    proc: subprocess.Popen[str]

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"})

    def live(self) -> dict[str, int]:
        """Pod processes still running."""
        with self.http() as client:
            live: dict[str, int] = client.get("/standin/processes").json()["live"]
        return live

    def evict(self, pod: str) -> None:
        with self.http() as client:
            path = f"/standin/namespaces/{NAMESPACE}/pods/{pod}/evict"
            client.post(path).raise_for_status()


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    kubeconfig = tmp_path_factory.mktemp("k8s") / "kubeconfig"
    argv = [sys.executable, "-m", "tests.fakes.k8s_standin", "--kubeconfig", str(kubeconfig)]
    argv += ["--token", TOKEN, "--pending", "0.3"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # bounded by the test's timeout
        assert first.startswith("Kubernetes stand-in on "), first
        yield StandIn(first.split()[-1], kubeconfig, proc)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


@pytest.fixture
def store(tmp_path: Path, state_home: Path) -> Iterator[Store]:
    """A store of the test's own; its runners keep their journals in its state directory."""
    opened = Store.open(f"sqlite:///{tmp_path / 'jobs.db'}")
    yield opened
    opened.close()


def _cluster(standin: StandIn) -> Cluster:
    return connect(kubeconfig=str(standin.kubeconfig), context=None, namespace=NAMESPACE)


def _runner(store: Store, standin: StandIn, tpu: str, events: list[str]) -> Runner:
    target = Target(
        tpu_slice(tpu),
        image="tpupod-worker:test",
        namespace=NAMESPACE,
        store=store_label(store.url),
        worker_python=sys.executable,
    )
    executor = KubernetesExecutor(_cluster(standin), target, poll_s=0.2, on_event=events.append)
    return Runner(store, executor, lease_s=3.0, on_event=events.append)


async def _until(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


async def _with_runner(runner: Runner, scenario: Callable[[], Awaitable[None]]) -> None:
    """Serve jobs while ``scenario`` runs, then stop the runner."""
    serving = asyncio.create_task(runner.serve())
    try:
        await scenario()
    finally:
        runner.shutdown.set()
        await asyncio.wait_for(serving, 20)


def _name(store: Store, job_id: int, attempt: int) -> str:
    return jobset_name(job_id, attempt, store_label(store.url))


def _pods(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return cluster.pods(f"jobset.sigs.k8s.io/jobset-name={name}")


def _is(store: Store, job_id: int, *statuses: JobStatus) -> Callable[[], bool]:
    return lambda: store.get(job_id).status in statuses


def _gone(standin: StandIn, cluster: Cluster, name: str) -> None:
    """The attempt's JobSet, pods and processes are all gone."""
    assert cluster.get(name) is None
    assert _pods(cluster, name) == []
    assert not [p for p in standin.live() if p.startswith(f"{name}-")]


@pytest.mark.local
def test_the_standin_refuses_what_kubernetes_would(standin: StandIn) -> None:
    cluster = _cluster(standin)
    body = render_jobset(_job(id=900), 1, Target(tpu_slice("v4-8"), image="img"))
    body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelector"] = [
        "not-a-map"
    ]
    with pytest.raises(JobError, match=r"422 .*is invalid: .*nodeSelector"):
        cluster.create(body)
    assert cluster.get(jobset_name(900, 1)) is None
    with httpx.Client(base_url=standin.url) as anonymous:
        assert anonymous.get(f"/api/v1/namespaces/{NAMESPACE}/pods").status_code == 401


@pytest.mark.local
@pytest.mark.timeout(40)
def test_a_job_runs_on_every_pod_and_its_logs_and_result_come_back(
    standin: StandIn, store: Store
) -> None:
    code = (
        "import os, time\n"
        "me = os.environ['TPUPOD_WORKER_ID']\n"
        "logger.info('worker %s of %s (gke %s)', me, os.environ['TPUPOD_NUM_WORKERS'],"
        " os.environ['TPU_WORKER_ID'])\n"
        "time.sleep(1.0)\n"
        "logger.info('done %s', me)\n"
        "result = {'sum': 42, 'worker': me}\n"
    )
    job_id = store.submit(JobRequest(code=code, name="gang"))
    cluster = _cluster(standin)
    seen: dict[str, Any] = {}
    events: list[str] = []
    accepted = _accepted(standin)

    async def scenario() -> None:
        await _until(_is(store, job_id, JobStatus.RUNNING, *_ENDED))
        seen["status"] = store.get(job_id).status  # every pod printed its start marker
        seen["jobset"] = cluster.get(_name(store, job_id, 1))
        seen["pods"] = _pods(cluster, _name(store, job_id, 1))
        await _until(_is(store, job_id, *_ENDED))

    asyncio.run(_with_runner(_runner(store, standin, "v5litepod-16", events), scenario))
    job = store.get(job_id)
    assert job.status is JobStatus.COMPLETED, (job.error, events)
    assert job.attempt == 1 and job.started_at is not None
    assert job.result == {"sum": 42, "worker": "0"}  # worker 0's
    assert seen["status"] is JobStatus.RUNNING
    pod_spec = seen["jobset"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"][TOPOLOGY_SELECTOR] == "4x4"
    assert len(seen["pods"]) == 4
    lines = {(line.worker, line.line) for line in store.logs(job_id)}
    assert len(store.logs(job_id)) == 8  # each line once
    for w in range(4):
        assert (w, f"INFO worker {w} of 4 (gke {w})") in lines
        assert (w, f"INFO done {w}") in lines
    assert [line.seq for line in store.logs(job_id)] == list(range(1, 9))
    assert _accepted(standin) == accepted + 1
    _gone(standin, cluster, _name(store, job_id, 1))  # deleted when the attempt ended


_ENDED = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


def _accepted(standin: StandIn) -> int:
    with standin.http() as client:
        return int(client.get("/standin/processes").json()["accepted"])


@pytest.mark.local
@pytest.mark.timeout(40)
def test_a_failed_pod_fails_the_attempt_naming_its_worker(standin: StandIn, store: Store) -> None:
    script = 'echo "w$TPUPOD_WORKER_ID up"; '
    script += 'if [ "$TPUPOD_WORKER_ID" = 1 ]; then sleep 0.5; echo "boom on 1"; exit 3; fi; '
    script += "sleep 60"
    job_id = store.submit(JobRequest(command=script, max_attempts=3))
    cluster = _cluster(standin)
    events: list[str] = []
    began = time.monotonic()

    async def scenario() -> None:
        await _until(_is(store, job_id, *_ENDED))

    asyncio.run(_with_runner(_runner(store, standin, "v4-16", events), scenario))
    job = store.get(job_id)
    assert job.status is JobStatus.FAILED, events
    assert job.attempt == 1  # the program failed: no retry
    assert job.error is not None
    assert job.error.startswith(f"w1 ({_name(store, job_id, 1)}-workers-0-1-")
    assert job.error.endswith("exit 3: boom on 1")
    assert time.monotonic() - began < 20  # w0's sleep 60 was killed
    _gone(standin, cluster, _name(store, job_id, 1))


@pytest.mark.local
@pytest.mark.timeout(50)
def test_an_evicted_pod_retries_the_attempt_until_max_attempts(
    standin: StandIn, store: Store
) -> None:
    cluster = _cluster(standin)
    events: list[str] = []
    script = (
        'echo "attempt $TPUPOD_JOB_ATTEMPT"; [ "$TPUPOD_JOB_ATTEMPT" = 1 ] && sleep 60; echo ok'
    )
    again = store.submit(JobRequest(command=script, max_attempts=2))
    once = 0

    async def evict_when_running(job_id: int) -> None:
        await _until(_is(store, job_id, JobStatus.RUNNING))
        attempt = store.get(job_id).attempt
        (pod, *_) = sorted(
            p["metadata"]["name"] for p in _pods(cluster, _name(store, job_id, attempt))
        )
        await asyncio.to_thread(standin.evict, pod)

    async def scenario() -> None:
        await evict_when_running(again)
        await _until(_is(store, again, *_ENDED))
        nonlocal once
        once = store.submit(JobRequest(command="echo up; sleep 60", max_attempts=1))
        await evict_when_running(once)
        await _until(_is(store, once, *_ENDED))

    asyncio.run(_with_runner(_runner(store, standin, "v4-16", events), scenario))
    job = store.get(again)
    assert job.status is JobStatus.COMPLETED, (job.error, events)
    assert job.attempt == 2
    assert job.error is None
    said = [line.line for line in store.logs(again)]
    assert said.count("attempt 1") == 2 and said.count("attempt 2") == 2
    assert said.count("ok") == 2
    job = store.get(once)
    assert job.status is JobStatus.FAILED and job.attempt == 1
    assert job.error is not None and "Evicted" in job.error
    assert job.error.endswith("gave up after 1 attempts")
    for job_id, attempt in ((again, 1), (again, 2), (once, 1)):
        _gone(standin, cluster, _name(store, job_id, attempt))


@pytest.mark.local
@pytest.mark.timeout(40)
def test_cancel_and_timeout_delete_the_jobset_and_end_every_pod(
    standin: StandIn, store: Store
) -> None:
    cluster = _cluster(standin)
    events: list[str] = []
    slow = "echo up; sleep 60"
    timed = store.submit(JobRequest(command=slow, timeout=1.0))
    cancelled = store.submit(JobRequest(command=slow, priority=-1))

    async def scenario() -> None:
        await _until(_is(store, timed, *_ENDED))
        await _until(_is(store, cancelled, JobStatus.RUNNING))
        assert len(standin.live()) == 2  # both pods of the v4-16 slice
        await asyncio.to_thread(store.cancel, cancelled)
        await _until(_is(store, cancelled, *_ENDED))

    asyncio.run(_with_runner(_runner(store, standin, "v4-16", events), scenario))
    job = store.get(timed)
    assert job.status is JobStatus.FAILED and job.error == "timed out after 1 s", events
    job = store.get(cancelled)
    assert job.status is JobStatus.CANCELLED and job.error == "cancelled by request"
    for job_id in (timed, cancelled):
        _gone(standin, cluster, _name(store, job_id, 1))
    assert standin.live() == {}


@pytest.mark.local
@pytest.mark.timeout(120)
def test_a_killed_runners_jobset_is_deleted_and_the_job_runs_again(
    standin: StandIn, store: Store, state_home: Path
) -> None:
    cluster = _cluster(standin)
    script = (
        'echo "attempt $TPUPOD_JOB_ATTEMPT"; [ "$TPUPOD_JOB_ATTEMPT" = 1 ] && sleep 60; echo ok'
    )
    job_id = store.submit(JobRequest(command=script, max_attempts=3))
    argv = tpupod_argv(
        "jobs", "worker", "--k8s", "--db", store.url, "--kubeconfig", str(standin.kubeconfig),
        "--namespace", NAMESPACE, "--tpu", "v4-16", "--image", "img",
        "--worker-python", sys.executable, "--lease", "2",
    )  # fmt: skip
    runner = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60  # a runner's start (the CLI, kubernetes): 20 s at load 15
        while store.get(job_id).status is not JobStatus.RUNNING:
            assert runner.poll() is None, runner.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held = store.get(job_id)
        orphans = {
            n: pid
            for n, pid in standin.live().items()
            if n.startswith(_name(store, job_id, 1) + "-")
        }
        assert len(orphans) == 2
        runner.send_signal(signal.SIGKILL)
    finally:
        runner.kill()
        runner.communicate(timeout=10)
    assert cluster.get(_name(store, job_id, 1)) is not None  # left behind, pods running
    late = Claim(job=held, attempt=1, owner=held.lease_owner or "", next_seq=100)
    events: list[str] = []

    async def scenario() -> None:
        await _until(_is(store, job_id, *_ENDED), timeout=25)

    asyncio.run(_with_runner(_runner(store, standin, "v4-16", events), scenario))
    job = store.get(job_id)
    assert job.status is JobStatus.COMPLETED and job.attempt == 2, (job.error, events)
    assert any(f"deleted JobSet {_name(store, job_id, 1)}" in e for e in events)
    _gone(standin, cluster, _name(store, job_id, 1))
    _gone(standin, cluster, _name(store, job_id, 2))
    assert not [pid for pid in orphans.values() if _alive(pid)]
    with pytest.raises(LeaseLost):  # the dead runner's late writes change nothing
        claims.append_logs(store, late, 100, [(0, "late line")])
    with pytest.raises(LeaseLost):
        claims.finish(store, late, JobStatus.FAILED, error="late")
    assert store.get(job_id).status is JobStatus.COMPLETED
    assert "late line" not in [line.line for line in store.logs(job_id)]


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.mark.local
def test_the_cli_refuses_a_slice_gke_does_not_have(cli: Callable[..., CliResult]) -> None:
    done = cli("jobs", "worker", "--k8s", "--tpu", "v3-8", "--image", "img")
    assert done.code != 0
    assert "error: GKE has no v3 TPU node pools" in done.err
    assert "Traceback" not in done.err
    done = cli("jobs", "worker", "--k8s", "--tpu", "v4-8")
    assert "error: --k8s needs --tpu and --image" in done.err


@pytest.mark.local
def test_dry_run_prints_the_jobset_of_the_next_job_and_sends_nothing(
    cli: Callable[..., CliResult], cli_in_process: Callable[..., CliResult], tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    argv = ("jobs", "worker", "--db", db, "--k8s", "--tpu", "v5litepod-16", "--image", "img:1")
    # no cluster: a kubeconfig naming nothing would fail any call the runner made
    env = {"KUBECONFIG": str(tmp_path / "absent")}
    sample = cli_in_process(*argv, "--dry-run", env=env)
    assert sample.code == 0, sample.err
    assert sample.out.startswith("# the JobSet for a sample job (none is queued)")
    assert validate_jobset(yaml.safe_load(sample.out)) == []
    assert cli("jobs", "submit", "--db", db, "--", "echo", "low").code == 0
    assert cli("jobs", "submit", "--db", db, "--priority", "5", "--", "echo", "high").code == 0
    shown = cli_in_process(*argv, "--dry-run", env=env)
    assert shown.code == 0, shown.err
    body = yaml.safe_load(shown.out)
    assert validate_jobset(body) == []
    assert body["metadata"]["labels"]["tpupod.dev/job-id"] == "2"  # higher priority first
    pods = body["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert pods["parallelism"] == 4  # v5litepod-16: four TPU VMs
    assert "echo high" in pods["template"]["spec"]["containers"][0]["command"][-1]
    jobs = cli_in_process("jobs", "ls", "--db", db)
    assert jobs.code == 0 and jobs.out.count(" pending ") == 2, jobs.out  # nothing claimed
    refused = cli_in_process("jobs", "worker", "--db", db, "--local", "--dry-run")
    assert refused.code == 2 and "--dry-run is for --k8s runners" in refused.err


@pytest.mark.local
@pytest.mark.timeout(30)
def test_an_api_server_that_does_not_answer_retries_the_attempt(
    store: Store, tmp_path: Path
) -> None:
    from tests.fakes.k8s_standin import kubeconfig_text

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kubeconfig_text(f"http://127.0.0.1:{port}", TOKEN, NAMESPACE))
    target = Target(tpu_slice("v4-8"), image="img", namespace=NAMESPACE)
    cluster = connect(kubeconfig=str(kubeconfig), context=None, namespace=NAMESPACE)
    events: list[str] = []
    runner = Runner(store, KubernetesExecutor(cluster, target), lease_s=3.0, on_event=events.append)
    job_id = store.submit(JobRequest(command="echo hi", max_attempts=2))
    asyncio.run(runner.serve(max_jobs=2))
    job = store.get(job_id)
    assert job.status is JobStatus.FAILED and job.attempt == 2, events
    assert job.error is not None and "not created" in job.error
    assert job.error.endswith("gave up after 2 attempts")


@pytest.mark.local  # on PostgreSQL too: the runner's retry is one fenced update
def test_a_retried_attempt_waits_its_backoff_then_fails_at_max_attempts(
    db_url: str,  # noqa: F811  (the fixture imported above)
) -> None:
    store = Store.open(db_url)
    try:
        job_id = store.submit(JobRequest(command="true", max_attempts=2))
        first = claims.claim(store, "k8s-a", pod=None, lease_s=30)
        assert first is not None
        assert claims.retry(store, first, "w0 (p) Evicted: gone") is JobStatus.PENDING
        job = store.get(job_id)
        assert job.status is JobStatus.PENDING and job.error == "w0 (p) Evicted: gone"
        assert job.lease_owner is None
        assert claims.claim(store, "k8s-b", pod=None, lease_s=30) is None  # backoff: 1 s
        with pytest.raises(LeaseLost):  # the first attempt's runner can no longer end it
            claims.finish(store, first, JobStatus.COMPLETED)
        time.sleep(claims.backoff_s(1) + 0.05)
        second = claims.claim(store, "k8s-b", pod=None, lease_s=30)
        assert second is not None and second.attempt == 2
        with pytest.raises(LeaseLost):
            claims.retry(store, first, "late")
        assert claims.retry(store, second, "w1 (q) Preempted: gone") is JobStatus.FAILED
        job = store.get(job_id)
        assert job.status is JobStatus.FAILED and job.completed_at is not None
        assert job.error == "w1 (q) Preempted: gone; gave up after 2 attempts"
    finally:
        store.close()
