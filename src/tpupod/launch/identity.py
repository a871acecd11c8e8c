"""Which worker of which pod this process is, from the most reliable source available.

Sources, in order: tpupod's own variables (set by ``tpupod run``), GKE's
``TPU_WORKER_ID`` + ``TPU_WORKER_HOSTNAMES`` (with ``MEGASCALE_*`` on a multislice
JobSet, where they are the slice's: the global id is then JAX's), the GCE metadata server
(``agent-worker-number``, ``worker-network-endpoints``; only tried on a GCE
VM, with a short timeout), and last ``CLOUD_TPU_TASK_ID``. A machine with none
of them is worker 0 of 1. Never a silent guess: conflicting or incomplete
sources raise an error that lists what was tried.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tpupod import settings
from tpupod.errors import IdentityError

METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
METADATA_TIMEOUT_S = 1.0
GCE_PRODUCT_FILE = Path("/sys/class/dmi/id/product_name")


@dataclass(frozen=True)
class WorkerIdentity:
    id: int
    count: int
    hostnames: tuple[str, ...]
    source: str
    coordinator: str | None = None  # host:port of JAX's coordinator (worker 0)
    launch_id: str | None = None
    pod: str | None = None
    slice: int = 0  # on a pod of slices (tpupod's TPUPOD_SLICE_ID), else 0
    slices: int = 1
    first_host: str | None = None  # worker 0's host where ``hostnames`` are one slice's

    @property
    def is_coordinator(self) -> bool:
        return self.id == 0


Metadata = Callable[[str], str | None]


def worker(
    environ: Mapping[str, str] | None = None, metadata: Metadata | None = None
) -> WorkerIdentity:
    """This process's worker identity (see the module docstring for the order of sources)."""
    env = settings.environment() if environ is None else environ
    tried: list[str] = []
    for source in (_from_tpupod, _from_gke):
        found = source(env, tried)
        if found is not None:
            return found
    found = _from_metadata(metadata if metadata is not None else _gce_metadata(), tried)
    if found is not None:
        return found
    return _from_task_id(env, tried)


def _from_tpupod(env: Mapping[str, str], tried: list[str]) -> WorkerIdentity | None:
    if "TPUPOD_WORKER_ID" not in env:
        tried.append("TPUPOD_WORKER_ID (not set)")
        return None
    hostnames = _split(env.get("TPUPOD_WORKER_HOSTNAMES", ""))
    count = _int(env, "TPUPOD_NUM_WORKERS", tried)
    worker_id = _int(env, "TPUPOD_WORKER_ID", tried)
    if hostnames and len(hostnames) != count:
        raise IdentityError(
            f"TPUPOD_NUM_WORKERS={count} but TPUPOD_WORKER_HOSTNAMES lists {len(hostnames)} hosts",
            hint="these are set by 'tpupod run'; start the program with it",
        )
    return _checked(worker_id, count, hostnames, "tpupod", env)


def _from_gke(env: Mapping[str, str], tried: list[str]) -> WorkerIdentity | None:
    if "TPU_WORKER_ID" not in env or "TPU_WORKER_HOSTNAMES" not in env:
        tried.append("TPU_WORKER_ID + TPU_WORKER_HOSTNAMES (not both set)")
        return None
    hostnames = _split(env["TPU_WORKER_HOSTNAMES"])
    in_slice = _int(env, "TPU_WORKER_ID", tried)
    if "MEGASCALE_NUM_SLICES" not in env:
        return _checked(in_slice, len(hostnames), hostnames, "gke", env)
    # A multislice JobSet: the TPU variables are the slice's; the global id is JAX's
    # (cloud_tpu_cluster.py): id in the slice + slice id x workers per slice.
    slices, slice_id = (
        _int(env, "MEGASCALE_NUM_SLICES", tried),
        _int(env, "MEGASCALE_SLICE_ID", tried),
    )
    if not 0 <= slice_id < slices:
        raise IdentityError(
            f"MEGASCALE_SLICE_ID={slice_id} is not in 0..{slices - 1} (gke)",
            hint="the JobSet set inconsistent variables",
        )
    found = _checked(in_slice, len(hostnames), hostnames, "gke", env)
    first = env.get("MEGASCALE_COORDINATOR_ADDRESS", "").rsplit(":", 1)[0] or None
    return replace(
        found,
        id=slice_id * len(hostnames) + in_slice,
        count=slices * len(hostnames),
        slice=slice_id,
        slices=slices,
        first_host=first,
    )


def _from_metadata(metadata: Metadata | None, tried: list[str]) -> WorkerIdentity | None:
    if metadata is None:
        tried.append("GCE metadata (not a GCE VM)")
        return None
    number = metadata("agent-worker-number")
    endpoints = metadata("worker-network-endpoints")
    if number is None or endpoints is None:
        tried.append("GCE metadata (no agent-worker-number / worker-network-endpoints)")
        return None
    # Each endpoint is "name:id:ip" (older) or a bare address (newer).
    hostnames = tuple(e.split(":")[-1] for e in _split(endpoints))
    try:
        worker_id = int(number)
    except ValueError:
        raise IdentityError(
            f"GCE metadata agent-worker-number is {number!r}, not a number"
        ) from None
    return _checked(worker_id, len(hostnames), hostnames, "gce-metadata", {})


def _from_task_id(env: Mapping[str, str], tried: list[str]) -> WorkerIdentity:
    for name in ("CLOUD_TPU_TASK_ID", "TPU_WORKER_ID"):
        if name in env:
            raise IdentityError(
                f"only {name}={env[name]} says which worker this is, and nothing says how many "
                f"there are (tried: {'; '.join(tried)})",
                hint="start the program with 'tpupod run', which sets TPUPOD_WORKER_ID, "
                "TPUPOD_NUM_WORKERS and TPUPOD_WORKER_HOSTNAMES",
            )
    return WorkerIdentity(0, 1, ("localhost",), "single-host")


def _checked(
    worker_id: int, count: int, hostnames: tuple[str, ...], source: str, env: Mapping[str, str]
) -> WorkerIdentity:
    if count < 1 or not 0 <= worker_id < count:
        raise IdentityError(
            f"worker id {worker_id} is not in 0..{count - 1} ({source})",
            hint="the launcher set inconsistent variables; start the program with 'tpupod run'",
        )
    return WorkerIdentity(
        id=worker_id,
        count=count,
        hostnames=hostnames,
        source=source,
        coordinator=env.get("TPUPOD_COORDINATOR"),
        launch_id=env.get("TPUPOD_LAUNCH_ID"),
        pod=env.get("TPUPOD_POD"),
        slice=_int(env, "TPUPOD_SLICE_ID", []) if "TPUPOD_SLICE_ID" in env else 0,
        slices=_int(env, "TPUPOD_NUM_SLICES", []) if "TPUPOD_NUM_SLICES" in env else 1,
    )


def _int(env: Mapping[str, str], name: str, tried: list[str]) -> int:
    try:
        return int(env.get(name, ""))
    except ValueError:
        raise IdentityError(
            f"{name}={env.get(name)!r} is not a number (tried: {'; '.join(tried) or name})",
            hint="start the program with 'tpupod run'",
        ) from None


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _gce_metadata() -> Metadata | None:
    """A metadata reader on a GCE VM (told by its DMI product name), else None: no network wait."""
    try:
        if "Google" not in GCE_PRODUCT_FILE.read_text():
            return None
    except OSError:
        return None

    def read(key: str) -> str | None:
        request = urllib.request.Request(METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT_S) as response:
                return str(response.read().decode())
        except (urllib.error.URLError, OSError):
            return None

    return read
