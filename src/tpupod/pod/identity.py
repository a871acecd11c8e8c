"""The variables that tell a process which worker of which pod it is: one builder for the
pod record (``Pod.identity_env``) and the local fast path (``localexec``), which reads the
record as plain JSON. A light module: no pydantic, so the fast path stays fast."""

from __future__ import annotations

from collections.abc import Sequence


def identity_env(pod: str, uid: str, worker_id: int, addresses: Sequence[str]) -> dict[str, str]:
    """``TPUPOD_*`` and the TPU variables for worker ``worker_id`` of ``pod``.

    ``TPUPOD_POD_UID`` tells this pod from a same-named one of another state directory, or
    an earlier one of this: what a local pod's ``down`` looks for among the machine's
    processes. A record from before uids has none: its name stands in.

    ``TPUPOD_WORKER_HOSTNAMES`` lists, in worker order, the names peers use to reach each
    worker: its internal address, which always resolves. The TPU variables mirror what a GKE
    TPU worker sees; JAX only reads them when libtpu is installed and TPU chips are present,
    so on a CPU host they are inert (checked in tests/test_local_env.py).
    """
    hostnames = ",".join(addresses)
    return {
        "TPUPOD_POD": pod,
        "TPUPOD_POD_UID": uid or pod,
        "TPUPOD_WORKER_ID": str(worker_id),
        "TPUPOD_NUM_WORKERS": str(len(addresses)),
        "TPUPOD_WORKER_HOSTNAMES": hostnames,
        "TPU_WORKER_ID": str(worker_id),
        "TPU_WORKER_HOSTNAMES": hostnames,
    }
