"""The SSH provider: a pod of hosts that already exist, reached over SSH.

``up`` checks that every host answers and records its hostname and address;
if any host does not, nothing is recorded and the error names each one.
"""

from __future__ import annotations

import asyncio

from tpupod.errors import TpupodError, WorkerError
from tpupod.pod import Pod, Worker
from tpupod.spec import GcpPodSpec, PodSpec, SshHost, SshPodSpec
from tpupod.state import StateDir
from tpupod.transport.ssh import ConnectOptions, SshConnector, SshPool, probe

KNOWN_HOSTS_FILE = "known_hosts"


class SshProvider:
    async def create(self, spec: PodSpec, state: StateDir, *, recreate: bool = False) -> Pod:
        assert isinstance(spec, SshPodSpec)
        pool = SshPool(connect_options(spec, state))
        targets = [login_target(spec, host) for host in spec.hosts]
        try:
            answers = await asyncio.gather(
                *(probe(pool, target, i) for i, target in enumerate(targets)),
                return_exceptions=True,
            )
        finally:
            await pool.close()
        found = [a for a in answers if not isinstance(a, BaseException)]
        if len(found) < len(answers):
            failures = [a for a in answers if isinstance(a, BaseException)]
            raise _unreachable_hosts(failures, len(targets))
        workers = [
            Worker(id=i, hostname=hostname, internal_address=address, ssh=target)
            for i, (target, (hostname, address)) in enumerate(zip(targets, found, strict=True))
        ]
        return Pod(name=spec.name, spec=spec, workers=tuple(workers))

    async def destroy(self, pod: Pod, state: StateDir) -> None:
        """The hosts are not ours to delete: close the pod's held connections, and forget it."""
        from tpupod.holder.client import stop_holder

        await asyncio.to_thread(stop_holder, state, pod.name)

    async def live_state(self, pod: Pod) -> str | None:
        return None

    def connect(self, pod: Pod, state: StateDir) -> SshConnector:
        assert isinstance(pod.spec, SshPodSpec)
        return SshConnector(SshPool(connect_options(pod.spec, state)))

    def worker_env(self, pod: Pod, worker: Worker) -> dict[str, str]:
        return dict(pod.spec.env)


def login_target(spec: SshPodSpec, host: SshHost) -> SshHost:
    """The host with its login user settled (the host's own, else the pod's, else ours)."""
    return host if host.user or not spec.user else host.model_copy(update={"user": spec.user})


def connect_options(spec: SshPodSpec | GcpPodSpec, state: StateDir) -> ConnectOptions:
    return ConnectOptions(
        user=spec.user,
        key=spec.key,
        host_keys=spec.host_keys,
        known_hosts=state.pod_dir(spec.name) / KNOWN_HOSTS_FILE,
        concurrency=spec.connect_concurrency,
        stagger_s=spec.connect_stagger_ms / 1000,
        timeout_s=spec.connect_timeout,
        retries=spec.connect_retries,
    )


def _unreachable_hosts(failures: list[BaseException], total: int) -> TpupodError:
    for failure in failures:
        if not isinstance(failure, TpupodError):
            raise failure  # a bug, not a host: let it surface
    reasons = "; ".join(str(f) for f in failures)
    hints = {f.hint for f in failures if isinstance(f, WorkerError) and f.hint}
    return TpupodError(
        f"{len(failures)} of {total} hosts did not answer, so the pod was not created: {reasons}",
        hint=" / ".join(sorted(hints)) or "check the hosts and try again",
    )
