"""The variables that tell a process which worker of which pod it is: one builder for the
pod record (``Pod.identity_env``) and the local fast path (``localexec``), which reads the
record as plain JSON. A light module: no pydantic, so the fast path stays fast."""

from __future__ import annotations

from collections.abc import Sequence


def identity_env(
    pod: str,
    uid: str,
    worker_id: int,
    addresses: Sequence[str],
    slices: Sequence[int | None] = (),
) -> dict[str, str]:
    """``TPUPOD_*`` and the TPU variables for worker ``worker_id`` of ``pod``.

    ``TPUPOD_POD_UID`` tells this pod from a same-named one of another state directory, or
    an earlier one of this: what a local pod's ``down`` looks for among the machine's
    processes. A record from before uids has none: its name stands in.

    ``TPUPOD_WORKER_HOSTNAMES`` lists, in worker order, the names peers use to reach each
    worker: its internal address, which always resolves. The TPU variables mirror what a GKE
    TPU worker sees; JAX only reads them when libtpu is installed and TPU chips are present,
    so on a CPU host they are inert (checked in tests/test_local_env.py).

    ``slices``: each worker's slice, in worker order (empty, or all None: one slice). On a
    pod of several, ``TPUPOD_SLICE_ID``, ``_NUM_SLICES`` and ``_WORKERS_PER_SLICE`` say
    where the worker is, and the TPU variables are its slice's, as on a multislice GKE
    JobSet: JAX's TPU cluster takes ``TPU_WORKER_ID`` as the id within the slice and
    ``TPU_WORKER_HOSTNAMES`` as the slice's workers, and makes the process id
    ``TPU_WORKER_ID + MEGASCALE_SLICE_ID * workers per slice``: the global id again.
    """
    hostnames = ",".join(addresses)
    env = {
        "TPUPOD_POD": pod,
        "TPUPOD_POD_UID": uid or pod,
        "TPUPOD_WORKER_ID": str(worker_id),
        "TPUPOD_NUM_WORKERS": str(len(addresses)),
        "TPUPOD_WORKER_HOSTNAMES": hostnames,
        "TPU_WORKER_ID": str(worker_id),
        "TPU_WORKER_HOSTNAMES": hostnames,
    }
    count = len(set(slices))
    if count > 1:
        mine = slices[worker_id]
        members = [i for i, s in enumerate(slices) if s == mine]
        env |= {
            "TPUPOD_SLICE_ID": str(mine),
            "TPUPOD_NUM_SLICES": str(count),
            "TPUPOD_WORKERS_PER_SLICE": str(len(members)),
            "TPU_WORKER_ID": str(members.index(worker_id)),
            "TPU_WORKER_HOSTNAMES": ",".join(addresses[i] for i in members),
        }
    return env


def megascale_env(slice_id: int, slices: int, coordinator: str, port: int) -> dict[str, str]:
    """What JAX's TPU cluster (``jax/_src/clusters/cloud_tpu_cluster.py``) and libtpu read to
    join slices over the data-center network, environment first: the coordinator (slice 0's
    worker 0, ``host:port``), the slice count, this worker's slice and the port."""
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator}:{port}",
        "MEGASCALE_NUM_SLICES": str(slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
        "MEGASCALE_PORT": str(port),
    }
