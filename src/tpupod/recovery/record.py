"""A recovery's state, kept in its run directory (``runs/RUN_ID/recovery.json``).

Written (atomically) at every phase, so that ``tpupod run --resume RUN`` can go on
after the launcher died, ``tpupod status``/``logs`` can show the attempts, and
anything the recovery was creating when it was stopped can be deleted.

One recovery at a time on a pod: the launcher holds the pod (``StateDir.hold``) from
before its record is made (or from its resume) to its end, so that a second run with
--retries is refused, naming the first, instead of deleting and creating the same TPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpupod.base import procfs
from tpupod.base.files import write_atomic
from tpupod.errors import StateError, UsageError
from tpupod.pod import users as podusers
from tpupod.pod.names import new_launch_id
from tpupod.pod.state import StateDir
from tpupod.recovery.goodput import Goodput

RECORD_FILE = "recovery.json"
CANCEL_FILE = "cancel-requested"
RUNS_DIR = "runs"


@dataclass
class AttemptRecord:
    attempt: int
    started: float
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    launch_id: str | None = None
    cause: str | None = None  # why it ended (policy.Cause), None while it runs
    exit_code: int | None = None
    detail: str = ""
    ended: float | None = None
    launched: float | None = None  # when its launch began (wall time): goodput's start
    slices: list[int] | None = None  # --elastic: the slices it ran on (None: every one)


@dataclass
class RecoveryRecord:
    run_id: str
    pod: str
    command: list[str]
    options: dict[str, Any]  # what the run was started with (for --resume)
    started: float
    launcher_pid: int
    commit: str | None = None  # the code every attempt must run
    state: str = "running"  # running, recovering, done, failed, cancelled
    phase: str = ""  # what it does now: delete, create, setup, launch, run
    exit_code: int | None = None
    counters: dict[str, int] = field(default_factory=dict)
    attempts: list[AttemptRecord] = field(default_factory=list)
    goodput: dict[str, Any] | None = None  # at its end (recovery/goodput.py)
    path: Path = Path()

    @classmethod
    def new(
        cls, state: StateDir, pod: str, command: list[str], options: dict[str, Any]
    ) -> RecoveryRecord:
        run_id = new_launch_id()
        state.hold(pod, *_holding(pod, run_id))  # before anything is written
        folder = state.pod_dir(pod) / RUNS_DIR / run_id
        folder.mkdir(parents=True, exist_ok=False)
        record = cls(
            run_id=run_id,
            pod=pod,
            command=command,
            options=options,
            started=time.time(),
            launcher_pid=os.getpid(),
            path=folder / RECORD_FILE,
        )
        record.save()
        return record

    @staticmethod
    def exists(state: StateDir, pod: str, run_id: str) -> bool:
        """Whether the run has a recovery record (it was started with --retries)."""
        return (state.pod_dir(pod) / RUNS_DIR / run_id / RECORD_FILE).is_file()

    @classmethod
    def load(cls, state: StateDir, pod: str, run_id: str) -> RecoveryRecord:
        path = state.pod_dir(pod) / RUNS_DIR / run_id / RECORD_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UsageError(
                f"run {run_id!r} of pod {pod!r} has no recovery record",
                hint="RUN is the id that 'tpupod run --retries' printed first "
                "('tpupod logs --list' lists them)",
            ) from None
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot read {path}: {exc}", hint="it may be damaged") from exc
        attempts = [AttemptRecord(**a) for a in data.pop("attempts", [])]
        return cls(**data, attempts=attempts, path=path)

    def hold(self, state: StateDir) -> None:
        """Hold the pod for this run (a UsageError when another run or command holds it)."""
        state.hold(self.pod, *_holding(self.pod, self.run_id))

    @contextlib.contextmanager
    def using(self, state: StateDir) -> Iterator[None]:
        """This run is a user of its pod for the block (every phase: launch, run, recovery),
        so that ``tpupod down`` refuses it, naming the run and its cancel, and ``down
        --force`` cancels it (it writes the cancel file, then TERMs)."""
        what, stop = _holding(self.pod, self.run_id)
        with podusers.using(state, self.pod, what, stop=stop, request=self.cancel_file):
            yield

    def cancelled_by(self) -> str | None:
        """Who cancelled the run ("'tpupod cancel'", "'tpupod down --force' (pid N)"), from
        the cancel file; None when nobody did."""
        try:
            text = self.cancel_file.read_text().strip()
        except OSError:
            return None
        return text if text.startswith("'") else "'tpupod cancel'"  # it wrote its pid only

    @property
    def current(self) -> AttemptRecord:
        return self.attempts[-1]

    def begin_attempt(self) -> AttemptRecord:
        attempt = AttemptRecord(attempt=len(self.attempts) + 1, started=time.time())
        self.attempts.append(attempt)
        self.save()
        return attempt

    def to_json(self) -> dict[str, Any]:
        """The record as ``recovery.json`` holds it (``tpupod status --output json`` too)."""
        data = asdict(self)
        data.pop("path")
        return data

    def save(self) -> None:
        data = self.to_json()
        data["launcher_pid"] = os.getpid()
        write_atomic(self.path, json.dumps(data, indent=1) + "\n")

    @property
    def cancel_file(self) -> Path:
        """Left by 'tpupod cancel' (or 'tpupod down --force') before it interrupts the
        launcher: who stopped it."""
        return self.path.parent / CANCEL_FILE

    @property
    def ended(self) -> bool:
        return self.state not in ("running", "recovering")

    def headline(self) -> str:
        """Where the run stands: ``run RUN: done after 2 attempts``, ``run RUN: recovering
        (create), attempt 2``, or that its launcher is gone and how to go on."""
        count = len(self.attempts)
        if self.ended:
            return (
                f"run {self.run_id}: {self.state} after {count} attempt{'' if count == 1 else 's'}"
            )
        where = f"run {self.run_id}: {self.state} ({self.phase}), attempt {count}"
        if procfs.alive(self.launcher_pid):
            return where
        return f"{where}; its launcher is gone: 'tpupod run --resume {self.run_id}' goes on"

    def lines(self) -> list[str]:
        """The attempts, one line each: their launch, cause and phases' times."""
        rows = []
        for a in self.attempts:
            phases = ", ".join(f"{name} {secs:.1f}s" for name, secs in a.phases.items())
            cause = a.cause or f"running ({self.phase})"
            code = "" if a.exit_code is None else f", exit {a.exit_code}"
            on = f"on slice {', '.join(map(str, a.slices))}" if a.slices is not None else ""
            parts = [
                f"attempt {a.attempt}: {cause}{code}",
                f"launch {a.launch_id or '-'}",
                on,
                phases,
            ]
            rows.append("; ".join(part for part in parts if part))
        return rows

    def told(self) -> list[str]:
        """What status and logs show under the headline: the attempts, an elastic run's
        slices and events, the goodput."""
        goodput = self.goodput_line()
        return [*self.lines(), *self.elastic_lines(), *([goodput] if goodput else [])]

    def elastic_lines(self) -> list[str]:
        """An --elastic run's slices: those being made again, and its events with their
        times (``12:03:04 slice 2 is back after 64 s``)."""
        found = self.options.get("slices_state") or {}
        rows = []
        now = time.time()
        for k, since in sorted(found.get("regrowing", {}).items()):
            rows.append(f"slice {k} coming back ({now - since:.0f} s)")
        for event in found.get("events", []):
            rows.append(f"{time.strftime('%H:%M:%S', time.localtime(event['at']))} {event['what']}")
        return rows

    def goodput_line(self) -> str | None:
        """``goodput 71%: 998 steps in ...`` of a run that ended with heartbeats, else None."""
        return Goodput.from_json(self.goodput).describe() if self.goodput else None


def _holding(pod: str, run_id: str) -> tuple[str, str]:
    """What a run holding its pod says of itself, and how to stop it."""
    return f"run {run_id} (tpupod run --retries)", f"tpupod cancel --pod {pod} {run_id}"


def find_recovery(state: StateDir, pod: str, run_id: str | None) -> RecoveryRecord | None:
    """The recovery record of run ``run_id`` (a --retries run's id), if it is one."""
    if run_id is None or not (state.pod_dir(pod) / RUNS_DIR / run_id / RECORD_FILE).is_file():
        return None
    return RecoveryRecord.load(state, pod, run_id)


def recoveries(state: StateDir, pod: str) -> list[RecoveryRecord]:
    """The pod's ``--retries`` runs, oldest first (run ids sort by their start)."""
    found = sorted((state.pod_dir(pod) / RUNS_DIR).glob(f"*/{RECORD_FILE}"))
    return [RecoveryRecord.load(state, pod, path.parent.name) for path in found]


def latest_recovery(state: StateDir, pod: str) -> RecoveryRecord | None:
    """The pod's newest ``--retries`` run (run ids sort by their start), if it has one."""
    found = sorted((state.pod_dir(pod) / RUNS_DIR).glob(f"*/{RECORD_FILE}"))
    return RecoveryRecord.load(state, pod, found[-1].parent.name) if found else None
