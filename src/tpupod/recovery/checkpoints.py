"""``tpupod.latest_checkpoint(dir)``: the newest complete Orbax step in a checkpoint folder.

Orbax writes a step into ``STEP.orbax-checkpoint-tmp-N`` and renames it to ``STEP``
when it is complete (on a local disk); on Cloud Storage, where a rename is not
atomic, a complete step holds ``commit_success.txt``. A step a preemption cut short
is therefore a temporary folder, or (on gs://) a folder without that file, and is
skipped. Names may carry a prefix (``step_100``: ``step_prefix`` of the manager).

In a ``tpupod run`` of several workers every worker calls it (as every process
restores), and all get worker 0's answer: Orbax's primary, which commits each step (a
listing another worker got from a stale cache, NFS keeps one up to a minute, cannot make
it restore another step than the rest). A local folder is first checked to be one folder
for every worker. Multi-host Orbax needs that: worker 0 makes each step's folders and
commits it, the others write their shards into them. A path on each host's own disk
(``/tmp/ckpt`` on separate machines) looks the same in every program but is not one
folder: worker 1 polled (10 minutes, Orbax's timeout) for a folder worker 0 had made on
its own disk, worker 0 waited for it at a barrier, no step was ever committed, and
nothing was printed meanwhile. The check costs two exchanges through the launch's
rendezvous: worker 0 writes a probe file with a random token into the folder and lists
the steps; every other worker reads the probe; every worker hears who could not, and
all raise the same error, or all take worker 0's step. Object storage (gs://) is one
namespace for all hosts and is not probed.
"""

from __future__ import annotations

import re
import secrets
import socket
from pathlib import Path
from typing import Any

from tpupod import settings
from tpupod.base.files import write_atomic
from tpupod.errors import RendezvousError

STEP_RE = re.compile(r"^(?:.*_)?(\d+)$")
TMP_MARK = ".orbax-checkpoint-tmp"
COMMIT_FILE = "commit_success.txt"
PROBE_PREFIX = ".tpupod-shared-"  # hidden, and no step's name: nothing Orbax lists
CALL = "tpupod.latest_checkpoint"  # the exchanges' name: the n-th call on each worker meets


def latest_checkpoint(directory: str | Path) -> int | None:
    """The newest complete step under ``directory`` (a path, or an fsspec URL such as
    ``gs://bucket/ckpt``); None when there is none (a first attempt).

    In a ``tpupod run`` of several workers, call it on every worker: each gets worker 0's
    answer, and a local folder that is not one folder for every worker (a path on each
    host's own disk) raises ``RendezvousError`` on every worker, before any step."""
    fs, root = _filesystem(str(directory))
    address, _ = settings.rendezvous()
    if address is None:  # not started by `tpupod run`
        return _newest(fs, root)
    from tpupod.launch.client import client  # a run's worker: it connects

    connected = client()
    if connected.identity.count < 2:
        return _newest(fs, root)
    return _worker0s_step(connected, fs, root)


def _worker0s_step(connected: Any, fs: Any, root: str) -> int | None:
    """Worker 0's newest step on every worker, a local folder checked to be one for all."""
    me = connected.identity.id
    folder = Path(root) if _local(fs) else None
    probe = None if folder is None else folder / f"{PROBE_PREFIX}{connected.identity.launch_id}"
    try:
        offered = _worker0_offer(fs, root, probe) if me == 0 else None
        shared = _exchange(connected, CALL, offered)[0]
        seen = probe is None or me == 0 or _read(probe) == shared["token"]
        mine = {"seen": seen, "host": socket.gethostname(), "folder": root}
        answers = _exchange(connected, f"{CALL} (seen)", mine)
    finally:
        if probe is not None and me == 0:
            probe.unlink(missing_ok=True)
    blind = sorted(w for w, answer in answers.items() if not answer["seen"])
    if blind:
        raise _not_shared(blind, answers)
    step: int | None = shared["step"]
    return step


def _worker0_offer(fs: Any, root: str, probe: Path | None) -> dict[str, Any]:
    token = None
    if probe is not None:  # Orbax makes the folder anyway: worker 0 makes it first here
        token = secrets.token_hex(16)
        probe.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(probe, token)
    return {"token": token, "step": _newest(fs, root)}


def _exchange(connected: Any, name: str, value: Any) -> dict[int, Any]:
    try:
        values: dict[int, Any] = connected.exchange(name, value)
    except RendezvousError as exc:  # a timeout: a worker that never called
        raise RendezvousError(str(exc), hint=f"call {CALL} on every worker of the run") from exc
    return values


def _read(probe: Path) -> str | None:
    try:
        return probe.read_text()
    except OSError:  # not there (another disk), not a folder, not readable: not this folder
        return None


def _not_shared(blind: list[int], answers: dict[int, Any]) -> RendezvousError:
    """The same words on every worker, in full in the message (a worker's program shows it
    in a traceback, without the hint): worker 0's folder, and where the others looked."""
    folder = answers[0]["folder"]

    def looked(worker: int) -> str:
        there = answers[worker]["folder"]
        return f"w{worker} ({answers[worker]['host']}{'' if there == folder else ': ' + there})"

    remedy = "gs://BUCKET/PATH, or a shared filesystem (NFS) at the same path on every host"
    return RendezvousError(
        f"checkpoint folder {folder} is not one folder for every worker: "
        f"{', '.join(looked(w) for w in blind)} cannot see what w0 ({answers[0]['host']}) "
        f"wrote there (a path on each host's own disk?); give one that every worker sees: "
        f"{remedy}",
        hint=f"give a checkpoint folder every worker sees: {remedy}",
    )


def _newest(fs: Any, root: str) -> int | None:
    fs.invalidate_cache(root)  # a listing cached before the last attempt wrote is stale
    if not fs.exists(root):
        return None
    steps = []
    for entry in fs.ls(root, detail=True):
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        match = STEP_RE.match(name)
        if entry.get("type") != "directory" or TMP_MARK in name or match is None:
            continue
        if not _local(fs) and not fs.exists(f"{str(entry['name']).rstrip('/')}/{COMMIT_FILE}"):
            continue  # on object storage a step is complete once its commit file is there
        steps.append(int(match.group(1)))
    return max(steps, default=None)


def _filesystem(url: str) -> tuple[Any, str]:
    # an extra's: a remote checkpoint folder only
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    return fs, root


def _local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
