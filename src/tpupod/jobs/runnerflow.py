"""``tpupod jobs worker`` as a library call: from what was asked (``RunnerOptions``) to an
executor (here, with or without the warm pool; a pod through ``tpupod run``; a GKE slice
through JobSets) and a ``Runner`` serving it until it is done or told to stop (SIGINT,
SIGTERM: it gives its jobs back), with the pool warm before the first job and closed after
the last.

Deferred imports: each executor's modules are imported when it is chosen: the warm pool, a
pod's executor (``tpupod run``'s launcher), the Kubernetes one (the kubernetes client, the
slowest import here); ``--preview`` only the manifest.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpupod.errors import PodNotFound, UsageError
from tpupod.jobs.rows import START_WAIT_S
from tpupod.jobs.runner import DEFAULT_LEASE_S, Runner
from tpupod.jobs.service import open_store
from tpupod.jobs.store import Store
from tpupod.pod.state import StateDir

if TYPE_CHECKING:
    from tpupod.jobs.attempt import Executor
    from tpupod.jobs.k8s_manifest import Target
    from tpupod.jobs.models import Job
    from tpupod.jobs.pool import Pool
    from tpupod.pod.record import Pod


@dataclass(frozen=True)
class K8sOptions:
    """Where a ``--k8s`` runner sends its JobSets."""

    tpu: str | None = None
    image: str | None = None
    topology: str | None = None
    namespace: str = "default"
    kubeconfig: str | None = None
    context: str | None = None
    service_account: str | None = None


@dataclass(frozen=True)
class RunnerOptions:
    """A runner: here (``local``), on a pod (the default), or on a GKE slice (``k8s``)."""

    db: str | None = None
    pod: str | None = None
    local: bool = False
    k8s: K8sOptions | None = None
    lease_s: float = DEFAULT_LEASE_S
    until_empty: bool = False
    max_jobs: int | None = None
    worker_python: str | None = None
    concurrency: int | None = None  # local only (default: the CPU count)
    pool: bool = True  # local: code jobs in warm Python processes

    def check(self) -> None:
        if self.local and self.k8s is not None:
            raise UsageError("--local and --k8s", hint="a runner runs jobs in one place")
        if not self.local and self.concurrency not in (None, 1):
            raise UsageError(
                "--concurrency is for --local runners",
                hint="a pod runs one gang job at a time: start a runner per pod",
            )

    @property
    def slots(self) -> int:
        return (self.concurrency or os.cpu_count() or 1) if self.local else 1


def run_runner(options: RunnerOptions, on_event: Callable[[str], None] | None = None) -> int:
    """Run jobs until the queue is empty (``until_empty``), ``max_jobs`` have run, or SIGINT
    or SIGTERM (in the main thread; elsewhere a caller stops it with ``max_jobs`` or
    ``until_empty``); how many attempts it ran (a retry is one more). ``on_event`` hears
    a line per attempt."""
    options.check()
    # a runner started beside a database restart (or before its server) waits for it
    store = Store.open_waiting(options.db, create=True, wait_s=START_WAIT_S, say=on_event)
    try:
        pool = None
        if options.local and options.pool:
            from tpupod.jobs.pool import Pool

            pool = Pool(options.slots)
        executor, target = _executor(store, options, pool, on_event)
        runner = Runner(
            store,
            executor,
            pod=target,
            lease_s=options.lease_s,
            on_event=on_event,
            concurrency=options.slots,
        )
        return asyncio.run(_serve(runner, options, pool))
    finally:
        store.close()


def preview_jobset(options: RunnerOptions) -> tuple[Job, dict[str, Any]]:
    """The JobSet a ``k8s`` runner would send next (for the next queued job, else a sample
    job); nothing is sent."""
    from tpupod.jobs.k8s_manifest import preview

    if options.k8s is None:
        raise UsageError("--dry-run is for --k8s runners", hint="it prints a JobSet")
    options.check()
    store = open_store(options.db, create=True)
    try:
        return preview(store, _k8s_target(store, options, options.k8s), options.pod)
    finally:
        store.close()


def _executor(
    store: Store,
    options: RunnerOptions,
    pool: Pool | None,
    on_event: Callable[[str], None] | None,
) -> tuple[Executor, str | None]:
    """The executor and the pod whose jobs it takes (None: jobs of no pod only)."""
    from tpupod.jobs.execute import LocalExecutor, PodExecutor

    if options.local:
        return LocalExecutor(pool=pool), None
    if options.k8s is not None:
        from tpupod.jobs.k8s import KubernetesExecutor, connect

        target = _k8s_target(store, options, options.k8s)
        cluster = connect(
            kubeconfig=options.k8s.kubeconfig,
            context=options.k8s.context,
            namespace=target.namespace,
            pool=target.slice.hosts + 8,
        )
        return KubernetesExecutor(cluster, target, on_event=on_event), options.pod
    found = runner_pod(options.pod)
    return PodExecutor(found, worker_python=found.worker_python(options.worker_python)), found.name


def runner_pod(pod: str | None) -> Pod:
    """The pod a runner serves; without a name, a hint that also offers ``--local``."""
    try:
        return StateDir().resolve(pod)
    except PodNotFound as exc:
        if pod is not None:
            raise
        also = "or run jobs on this machine: 'tpupod jobs worker --local'"
        raise PodNotFound(exc.message, hint=f"{exc.hint}; {also}") from exc


def _k8s_target(store: Store, options: RunnerOptions, k8s: K8sOptions) -> Target:
    from tpupod.jobs.k8s_manifest import Target, tpu_slice
    from tpupod.jobs.store import store_label

    if k8s.tpu is None or k8s.image is None:
        raise UsageError(
            "--k8s needs --tpu and --image",
            hint="e.g. --k8s --tpu v5litepod-16 --image us-docker.pkg.dev/P/R/worker:1",
        )
    return Target(
        tpu_slice(k8s.tpu, k8s.topology),
        image=k8s.image,
        namespace=k8s.namespace,
        store=store_label(store.url),
        worker_python=options.worker_python or "python3",
        service_account=k8s.service_account,
    )


async def _serve(runner: Runner, options: RunnerOptions, pool: Pool | None) -> int:
    if threading.current_thread() is threading.main_thread():  # signals reach only it
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, runner.shutdown.set)
    try:
        if pool is not None:
            await pool.start()  # warm before the first job
        return await runner.serve(until_empty=options.until_empty, max_jobs=options.max_jobs)
    finally:
        if pool is not None:
            await pool.close()
