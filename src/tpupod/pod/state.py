"""The state directory: one folder per known pod, holding its record and its files.

Layout::

    $TPUPOD_HOME/pods/NAME/pod.json      the Pod record (written atomically)
    $TPUPOD_HOME/pods/NAME/workers/wN/   a local worker's working directory
    $TPUPOD_HOME/pods/NAME/holder.lock   flock'ed by the one process that may remake the
                                         pod's cloud resources (holder.json: who it is)

A pod folder exists only while its record does: ``up`` claims the folder with
an atomic ``mkdir``, so two concurrent ``up`` calls cannot both create a pod.

Deferred imports: exec's fast path reads pods through this module without pathlib, pydantic
(the pod record) or the file writers; those are imported by the calls that load or write a
whole record, fcntl and procfs by the holder's lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from tpupod import settings
from tpupod.base.plain import TYPE_CHECKING, Plain
from tpupod.errors import PodNotFound, StateError, UsageError
from tpupod.pod.choices import RECORD_VERSION
from tpupod.pod.names import POD_NAME_RE

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from tpupod.pod.record import Pod

RECORD_FILE = "pod.json"
HOLDER_LOCK = "holder.lock"
HOLDER_FILE = "holder.json"
HOLD_WAIT_S = 1.0  # a holder that has the lock but has not said who it is yet
_held: dict[str, int] = {}  # lock path -> its open descriptor, in this process


class WorkerBrief(Plain):
    """A worker as the fast paths know it: its id, host and slice (and in a run's record,
    its id in the pod, where the run had part of it and numbered its workers from 0)."""

    __slots__ = ("hostname", "id", "pod_id", "slice")

    def __init__(
        self, id: int, hostname: str, slice: int | None = None, pod_id: int | None = None
    ) -> None:
        self.id = id
        self.hostname = hostname
        self.slice = slice
        self.pod_id = pod_id

    @property
    def label(self) -> str:
        return f"w{self.id}"


class PodBrief(Plain):
    """A pod as the fast paths know it: its provider and workers."""

    __slots__ = ("name", "provider", "workers")

    def __init__(self, name: str, provider: str, workers: tuple[WorkerBrief, ...]) -> None:
        self.name = name
        self.provider = provider
        self.workers = workers


class StateDir:
    """Known pods, found by name.

    What the fast paths call (``resolve_name``, ``load_brief``, ``read_record``) works on
    plain strings: ``pathlib`` is imported only by what hands out a ``Path``.
    """

    def __init__(self, root: Path | str | None = None) -> None:
        self.home = os.fspath(root) if root is not None else settings.state_home_text()

    @property
    def root(self) -> Path:
        from pathlib import Path

        return Path(self.home)

    @property
    def pods_dir(self) -> Path:
        return self.root / "pods"

    def record_path(self, name: str) -> str:
        return os.path.join(self.home, "pods", name, RECORD_FILE)

    def pod_dir(self, name: str) -> Path:
        return self.pods_dir / name

    def claim(self, name: str) -> Path:
        """Create the pod's folder; raises FileExistsError when another pod holds the name."""
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        path = self.pod_dir(name)
        path.mkdir()
        return path

    def save(self, pod: Pod) -> None:
        from tpupod.base.files import write_atomic

        write_atomic(self.pod_dir(pod.name) / RECORD_FILE, pod.model_dump_json(indent=2) + "\n")

    def exists(self, name: str) -> bool:
        return (self.pod_dir(name) / RECORD_FILE).is_file()

    def load(self, name: str) -> Pod:
        from pydantic import ValidationError

        from tpupod.pod.record import Pod

        data = self.read_record(name)
        self._check_shape(name, data)
        data.setdefault("uid", "")  # a record from before uids: not a new one each load
        try:
            return Pod.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            parts = [str(part) for part in first["loc"]]
            if parts[:1] == ["spec"] and len(parts) > 2:  # pydantic names the spec's kind
                del parts[1]  # ("spec", "local", "workers"): spec.workers, as in the file
            raise self._unreadable(name, f"{'.'.join(parts)}: {first['msg']}") from exc

    def load_brief(self, name: str) -> PodBrief:
        """The little the CLI's fast path needs (provider, workers), without validating it all."""
        data = self.read_record(name)
        self._check_shape(name, data)
        try:
            workers = tuple(
                WorkerBrief(int(w["id"]), str(w["hostname"]), _slice(w.get("slice")))
                for w in data["workers"]
            )
            return PodBrief(name, str(data["spec"]["provider"]), workers)
        except (KeyError, TypeError, ValueError) as exc:
            raise self._unreadable(name) from exc

    def _check_shape(self, name: str, data: Any) -> None:
        """What the full model cannot say (and the fast path needs): a record of this pod,
        in a format this tpupod reads, with workers 0..N-1 in order. A hand edit that kept
        the JSON whole could break each (no workers made 'run' an internal error)."""
        if not isinstance(data, dict):
            raise self._unreadable(name, "it is not a JSON object")
        version, workers = data.get("version", RECORD_VERSION), data.get("workers")
        if not isinstance(version, int) or version > RECORD_VERSION:
            raise self._unreadable(
                name, f"it is version {version}, this tpupod reads up to {RECORD_VERSION}"
            )
        if data.get("name") != name:
            raise self._unreadable(name, f"it names pod {data.get('name')!r}")
        if not isinstance(workers, list) or not workers:
            raise self._unreadable(name, "it has no workers")
        ids = [w.get("id") if isinstance(w, dict) else None for w in workers]
        if ids != list(range(len(ids))):
            said = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
            raise self._unreadable(
                name, f"its workers' ids are {said}, not 0..{len(ids) - 1} in order"
            )

    def read_record(self, name: str) -> Any:
        """The pod's record as plain JSON (not validated)."""
        try:
            with open(self.record_path(name), encoding="utf-8") as file:
                return json.load(file)
        except FileNotFoundError:
            if not POD_NAME_RE.match(name):
                raise PodNotFound(f"{name!r} is not a pod name", hint=self._known_hint()) from None
            raise PodNotFound(f"no pod named {name!r}", hint=self._known_hint()) from None
        except ValueError as exc:
            raise self._unreadable(name) from exc

    def _unreadable(self, name: str, why: str | None = None) -> StateError:
        return StateError(
            f"the record of pod {name!r} is unreadable: {self.record_path(name)}"
            + (f" ({why})" if why else ""),
            hint="fix or delete that file (tpupod writes it whole, so a hand edit broke it)",
        )

    def names(self) -> list[str]:
        """The pods with a record (as ``glob("*/pod.json")``: hidden folders do not count)."""
        try:
            found = os.listdir(os.path.join(self.home, "pods"))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(
            n for n in found if not n.startswith(".") and os.path.isfile(self.record_path(n))
        )

    def pods(self) -> tuple[list[Pod], dict[str, StateError]]:
        """Every pod whose record reads, and by name the error of each that does not:
        one broken record does not hide the others."""
        pods, broken = [], {}
        for name in self.names():
            try:
                pods.append(self.load(name))
            except StateError as exc:
                broken[name] = exc
        return pods, broken

    def resolve(self, name: str | None) -> Pod:
        """The pod named ``name``, or the only pod when no name is given."""
        return self.load(self.resolve_name(name))

    def resolve_name(self, name: str | None) -> str:
        """``name``, or the only pod's name when no name is given."""
        if name is not None:
            return name
        names = self.names()
        if len(names) == 1:
            return names[0]
        if not names:
            raise PodNotFound(
                f"no pods yet (state directory {self.home})",
                hint="create one with 'tpupod up --name dev --local 2'",
            )
        raise PodNotFound(
            f"{len(names)} pods exist ({', '.join(names)}); say which one",
            hint=f"add --pod {names[0]}, for example",
        )

    def hold(self, name: str, what: str, stop: str) -> None:
        """Make this process the one that may delete and create pod ``name``'s cloud
        resources (a run with --retries, ``up --recreate``) until :meth:`release` or its
        end, ``kill -9`` included (an flock). Another holder: a UsageError naming it and
        ``stop``, how to stop it. Holding it again is a no-op."""
        import fcntl

        lock = os.path.join(self.home, "pods", name, HOLDER_LOCK)
        if lock in _held:
            return
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + HOLD_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = self._holder(name)
                if holder is not None or time.monotonic() > deadline:
                    os.close(fd)
                    raise self._held_by(name, holder) from None
                time.sleep(0.05)
        _held[lock] = fd
        self._write_holder(name, {"pid": os.getpid(), "what": what, "stop": stop})

    def release(self, name: str) -> None:
        """Let go of what :meth:`hold` took (nothing when this process does not hold it)."""
        fd = _held.pop(os.path.join(self.home, "pods", name, HOLDER_LOCK), None)
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.home, "pods", name, HOLDER_FILE))
            os.close(fd)

    def _write_holder(self, name: str, holder: dict[str, Any]) -> None:
        from tpupod.base.files import write_atomic

        write_atomic(self.pod_dir(name) / HOLDER_FILE, json.dumps(holder) + "\n")

    def _holder(self, name: str) -> dict[str, Any] | None:
        """Who holds the pod (its holder.json), when that process is alive."""
        from tpupod.base import procfs

        try:
            with open(os.path.join(self.home, "pods", name, HOLDER_FILE), encoding="utf-8") as f:
                holder = json.load(f)
            pid = int(holder["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return holder if pid != os.getpid() and procfs.alive(pid) else None

    def _held_by(self, name: str, holder: dict[str, Any] | None) -> UsageError:
        one = "one run with --retries or 'up --recreate' at a time on a pod"
        if holder is None:
            return UsageError(
                f"pod {name!r} is held by another process (a recovery, or up --recreate)",
                hint=f"{one}: wait for it ({self.pod_dir(name) / HOLDER_LOCK} is its lock)",
            )
        return UsageError(
            f"pod {name!r} is held by {holder.get('what')}, pid {holder['pid']}: it may "
            "delete and create the pod's TPU, or stop what holds its accelerator",
            hint=f"{one}: wait for it, or stop it: '{holder.get('stop')}'",
        )

    def remove(self, name: str) -> None:
        import shutil  # here: exec's fast path reads the state, and never removes

        shutil.rmtree(self.pod_dir(name), ignore_errors=True)

    def _known_hint(self) -> str:
        names = self.names()
        if not names:
            return "there are no pods yet: 'tpupod up --name dev --local 2' creates one"
        return f"known pods: {', '.join(names)} ('tpupod list' shows them)"


def get_pod(name: str | None = None) -> Pod:
    """The pod named ``name`` from the state directory (or the only one)."""
    return StateDir().resolve(name)


def _slice(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
