"""The state directory: one folder per known pod, holding its record and its files.

Layout::

    $TPUPOD_HOME/pods/NAME/pod.json      the Pod record (written atomically)
    $TPUPOD_HOME/pods/NAME/workers/wN/   a local worker's working directory

A pod folder exists only while its record does: ``up`` claims the folder with
an atomic ``mkdir``, so two concurrent ``up`` calls cannot both create a pod.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpupod import settings
from tpupod.errors import PodNotFound, StateError
from tpupod.files import write_atomic
from tpupod.names import POD_NAME_RE

if TYPE_CHECKING:
    from tpupod.pod import Pod

RECORD_FILE = "pod.json"


@dataclass(frozen=True)
class WorkerBrief:
    id: int
    hostname: str

    @property
    def label(self) -> str:
        return f"w{self.id}"


@dataclass(frozen=True)
class PodBrief:
    name: str
    provider: str
    workers: tuple[WorkerBrief, ...]


class StateDir:
    """Known pods, found by name."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else settings.state_home()

    @property
    def pods_dir(self) -> Path:
        return self.root / "pods"

    def pod_dir(self, name: str) -> Path:
        return self.pods_dir / name

    def claim(self, name: str) -> Path:
        """Create the pod's folder; raises FileExistsError when another pod holds the name."""
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        path = self.pod_dir(name)
        path.mkdir()
        return path

    def save(self, pod: Pod) -> None:
        write_atomic(self.pod_dir(pod.name) / RECORD_FILE, pod.model_dump_json(indent=2) + "\n")

    def exists(self, name: str) -> bool:
        return (self.pod_dir(name) / RECORD_FILE).is_file()

    def load(self, name: str) -> Pod:
        from pydantic import ValidationError

        from tpupod.pod import Pod

        data = self._read(name)
        try:
            return Pod.model_validate(data)
        except ValidationError as exc:
            raise self._unreadable(name) from exc

    def load_brief(self, name: str) -> PodBrief:
        """The little the CLI's fast path needs (provider, workers), without validating it all."""
        data = self._read(name)
        try:
            workers = tuple(WorkerBrief(int(w["id"]), str(w["hostname"])) for w in data["workers"])
            return PodBrief(name, str(data["spec"]["provider"]), workers)
        except (KeyError, TypeError, ValueError) as exc:
            raise self._unreadable(name) from exc

    def _read(self, name: str) -> Any:
        path = self.pod_dir(name) / RECORD_FILE
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            if not POD_NAME_RE.match(name):
                raise PodNotFound(f"{name!r} is not a pod name", hint=self._known_hint()) from None
            raise PodNotFound(f"no pod named {name!r}", hint=self._known_hint()) from None
        except ValueError as exc:
            raise self._unreadable(name) from exc

    def _unreadable(self, name: str) -> StateError:
        return StateError(
            f"the record of pod {name!r} is unreadable: {self.pod_dir(name) / RECORD_FILE}",
            hint="fix or delete that file (tpupod writes it whole, so a hand edit broke it)",
        )

    def names(self) -> list[str]:
        if not self.pods_dir.is_dir():
            return []
        return sorted(p.parent.name for p in self.pods_dir.glob(f"*/{RECORD_FILE}"))

    def pods(self) -> list[Pod]:
        return [self.load(name) for name in self.names()]

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
                f"no pods yet (state directory {self.root})",
                hint="create one with 'tpupod up --name dev --local 2'",
            )
        raise PodNotFound(
            f"{len(names)} pods exist ({', '.join(names)}); say which one",
            hint=f"add --pod {names[0]}, for example",
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
