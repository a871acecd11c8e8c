"""``tpupod.init_jax()``: meet the other workers, then start JAX's distributed runtime."""

from __future__ import annotations

import socket
import time

from tpupod import settings
from tpupod.extras import exit_unless_installed
from tpupod.launch.client import rendezvous
from tpupod.launch.identity import WorkerIdentity, worker

# Google Cloud's default TPU firewall rule opens 8476, while JAX's own default moved to 8482
# (jax-ml/jax#35905): always pass the port explicitly.
DEFAULT_COORDINATOR_PORT = 8476
DEFAULT_TIMEOUT_S = 300.0


def init_jax(timeout: float = DEFAULT_TIMEOUT_S) -> WorkerIdentity:
    """Rendezvous at ``pre_jax_init``, then ``jax.distributed.initialize`` from the identity.

    Without a rendezvous service (the identity set by a scheduler, not ``tpupod run``) it
    goes straight to JAX's initialize at the identity's coordinator.

    On CPU pods, cross-process collectives use gloo. A single-host machine
    (worker 0 of 1) skips both and just returns its identity, so the same
    program runs on a laptop, a local pod, an SSH pod and a TPU pod.
    """
    identity = worker()
    if identity.count == 1:
        return identity
    exit_unless_installed("'tpupod.init_jax()'", "jax")
    import jax  # importing starts no backend; every worker does it at once, before the barrier

    if settings.rendezvous()[0]:  # started by tpupod run: meet (and be supervised) first
        rendezvous("pre_jax_init", timeout)
    # else started by a scheduler (a Kubernetes JobSet) with the identity alone: JAX's own
    # initialize, at the coordinator, is the barrier.
    if settings.jax_on_cpu():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    first = identity.first_host or identity.hostnames[0]
    coordinator = identity.coordinator or f"{first}:{DEFAULT_COORDINATOR_PORT}"
    if not identity.is_coordinator:
        _wait_for_port(coordinator, timeout)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=identity.count,
        process_id=identity.id,
        initialization_timeout=int(timeout),
    )
    return identity


def _wait_for_port(address: str, timeout: float) -> None:
    """Wait until worker 0's coordinator listens: JAX's own client backs off ~1 s on a refusal."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            time.sleep(0.01)
