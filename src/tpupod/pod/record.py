"""Pod and Worker: what a pod is once it exists, as recorded in the state directory."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from tpupod.errors import UsageError
from tpupod.pod.choices import RECORD_VERSION
from tpupod.pod.selection import select_ids
from tpupod.pod.spec import PodSpec, SshHost


class Worker(BaseModel):
    """One host of a pod. ``id`` is the worker's rank; ids are 0..N-1 in order."""

    model_config = ConfigDict(frozen=True)

    id: int
    hostname: str
    internal_address: str
    external_address: str | None = None
    workdir: str | None = Field(default=None, description="the directory commands start in")
    slice: int | None = Field(
        default=None, description="its slice, on a pod of several (a multislice TPU, --slices)"
    )
    ssh: SshHost | None = Field(
        default=None, description="how to log in, for workers reached over SSH"
    )
    login_shell: str | None = Field(
        default=None, description="the shell an SSH login lands in (commands reach bash via it)"
    )

    @property
    def label(self) -> str:
        return f"w{self.id}"


def slice_of(worker: int, workers: int, slices: int) -> int | None:
    """The slice of worker ``worker`` when ``workers`` are split in order into ``slices``
    of the same size (slice 0's workers first); None on a pod of one slice."""
    return worker // (workers // slices) if slices > 1 else None


class Pod(BaseModel):
    """A pod that exists: its spec, its workers, and when it was made."""

    model_config = ConfigDict(frozen=True)

    version: int = RECORD_VERSION
    name: str
    spec: PodSpec
    workers: tuple[Worker, ...]
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    uid: str = Field(
        default_factory=lambda: secrets.token_hex(8),
        description="this pod, of this state directory, made at this time: what its processes "
        "carry (TPUPOD_POD_UID), so that 'down' finds them and no other's ('' in older records)",
    )

    @property
    def provider(self) -> str:
        return self.spec.provider

    def listing(self) -> tuple[str, str, str, str, str]:
        """Its row in 'tpupod list': name, provider, workers, created, details."""
        created = self.created_at.strftime("%Y-%m-%d %H:%M:%S UTC")
        return self.name, self.provider, str(len(self.workers)), created, self.spec.summary()

    @property
    def slices(self) -> int:
        """How many slices the pod has (1: no slices)."""
        return len({w.slice for w in self.workers})

    def slice_layout(self) -> str:
        """A pod of slices in one line, ``2 slices of 2 workers: w0-w1, w2-w3`` ("" for one
        slice)."""
        if self.slices < 2:
            return ""
        spans = []
        for found in dict.fromkeys(w.slice for w in self.workers):
            ids = [w.id for w in self.workers if w.slice == found]
            spans.append(f"w{ids[0]}-w{ids[-1]}" if len(ids) > 1 else f"w{ids[0]}")
        per = len(self.workers) // self.slices
        return f"{self.slices} slices of {per} worker{'s' if per != 1 else ''}: {', '.join(spans)}"

    @property
    def on_this_machine(self) -> bool:
        """The workers are processes here (a local pod): they share this machine's files,
        Python, ports and container engine, so what holds for one holds for all."""
        return self.provider == "local"

    def worker_python(self, given: str | None = None) -> str:
        """The Python the workers run tpupod with: ``given``, else this interpreter on a
        local pod (its workers are processes here), else the hosts' ``python3``."""
        return given or (sys.executable if self.on_this_machine else "python3")

    def select(self, selection: str | None) -> list[Worker]:
        """The workers a selection such as ``"0,2-3"`` or ``"s1"`` names (None, "all": all)."""
        slices = [w.slice for w in self.workers]
        return [self.workers[i] for i in select_ids(selection, len(self.workers), slices)]

    def subset(self, selected: Sequence[Worker]) -> Pod:
        """The pod a run on ``selected`` sees: just those workers, numbered 0..N-1 (JAX wants
        dense process ids), their slices too (itself when all are selected). Slices of
        different sizes are refused: JAX's process ids and a hybrid mesh need them equal."""
        if len(selected) == len(self.workers):
            return self
        order = list(dict.fromkeys(w.slice for w in selected))
        sizes = {s: sum(w.slice == s for w in selected) for s in order}
        if len(set(sizes.values())) > 1:
            said = ", ".join(f"{n} of slice {s}" for s, n in sizes.items())
            raise UsageError(
                f"the selected workers are {said}: a run over slices needs as many from each",
                hint="select whole slices (-w s0-1), or the same number of workers from each",
            )
        renumbered = tuple(
            w.model_copy(update={"id": i, "slice": order.index(w.slice) if order[1:] else None})
            for i, w in enumerate(selected)
        )
        return self.model_copy(update={"workers": renumbered})

    def identity_env(self, worker: Worker) -> dict[str, str]:
        """The variables that tell a process which worker of which pod it is (see
        ``tpupod.pod.identity``, which the local fast path shares)."""
        from tpupod.pod.identity import identity_env  # not for --help or a pod's reading

        addresses = [w.internal_address for w in self.workers]
        slices = [w.slice for w in self.workers]
        return identity_env(self.name, self.uid, worker.id, addresses, slices)
