"""The runs of ``tpupod run`` as typed records: listed, looked up, their logs read and followed.

``tpupod run`` keeps each launch in ``pods/NAME/runs/LAUNCH_ID/``: ``run.json``
(what ran, on which workers, when, how it ended) and one ``wN.log`` per worker,
written as the run goes (see ``launch/run.py``). While it runs, the launcher
holds a lock on ``launcher.lock``; a launcher killed with -9 never writes its
run's end, but the kernel drops its lock, so a record still "running" whose lock
is free belongs to a launcher that is gone (and its workers with it: nothing
outlives its launcher). Launch ids start with the
second the run started and end with random hex, so two launches in one second
do not sort by name: runs are ordered by their ``started`` time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpupod.errors import StateError, UsageError
from tpupod.fanout.results import Ending, RunState
from tpupod.pod.state import StateDir, WorkerBrief

RUNS_DIR = "runs"
RUN_FILE = "run.json"
STOP_FILE = "stop-request"  # who asks the launcher to stop (cancel, the dashboard), before SIGINT
# Held (flock) by the launcher while it runs: the kernel lets go when it dies, even by kill -9,
# so a reader can tell a running launch from one whose launcher is gone.
LAUNCHER_LOCK = "launcher.lock"

FOLLOW_POLL_S = 0.2


@dataclass(frozen=True)
class RunOutcome:
    """How one worker's program ended."""

    worker: int
    outcome: str
    last_line: str


@dataclass(frozen=True)
class Hung:
    """Why the hang watchdog stopped a run (``run --hang-timeout``): its words, the digest it
    printed, where the dump is, the workers not where the others were."""

    why: str
    digest: tuple[str, ...]
    stacks: str | None
    odd: tuple[int, ...]


@dataclass(frozen=True)
class RunRecord:
    """One launch, as its ``run.json`` describes it (``finished`` is None while it runs)."""

    folder: Path
    launch_id: str
    command: str
    workers: tuple[WorkerBrief, ...]
    coordinator: str
    started: float
    finished: float | None = None
    exit_code: int | None = None
    results: tuple[RunOutcome, ...] = ()
    launcher_pid: int | None = None
    logs_cut: str | None = None  # why its logs stopped early (a full disk), if they did
    written: Ending | None = None  # how it ended, as its launcher wrote it (None: running)
    job: tuple[int, int] | None = None  # (job id, attempt) when a job runner launched it
    hung: Hung | None = None  # the watchdog's record, when it stopped the run as hung

    @property
    def ending(self) -> Ending:
        """How the run stands or ended, typed: running, its launcher gone, or what its
        launcher wrote at the end (a record from before ``ending``: as its outcomes say)."""
        if not self.done:
            if self.launcher_gone():
                gone = "its launcher ended without writing the run's end (killed?)"
                return Ending(RunState.LAUNCHER_GONE, why=gone)
            return Ending(RunState.RUNNING)
        return self.written or _old_ending(self)

    @property
    def done(self) -> bool:
        return self.finished is not None

    def launcher_gone(self) -> bool:
        """Not done, and its launcher no longer holds the run's lock: it died without writing
        the end (kill -9, a crash). False while it runs, and for a record too old to say."""
        if self.done:
            return False
        try:
            lock = (self.folder / LAUNCHER_LOCK).open("rb")
        except FileNotFoundError:
            return False
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

    def ended(self) -> bool:
        """Over: its end recorded, or its launcher gone (then the record, read again, may
        have its end after all: the launcher wrote it just before letting go)."""
        return self.launcher_gone() or self.reread().done

    def state(self) -> str:
        """How the run stands, in a word or three: running, ok, failed (exit 3), stopped
        (exit 130), launcher gone."""
        ending = self.ending
        code = f" (exit {ending.exit_code})" if ending.exit_code not in (None, 0) else ""
        return ending.state.value + code

    def stop(self, wait_s: float = 0.0, by: str | None = None) -> bool:
        """Stop the run as Ctrl-C on its launcher does (it stops every worker: TERM, then
        KILL after the grace); with ``wait_s``, wait up to that long for its end. The
        launcher runs on this machine (it writes this state directory); ``by`` names who
        asks (its ending says "stopped by" that). True when it ended within the wait (always
        False without one); a run that is over is a UsageError."""
        if self.ended() or self.launcher_pid is None:
            raise UsageError(f"run {self.launch_id} is not running", hint="nothing to stop")
        if by is not None:  # the launcher names who stopped it in the run's ending
            with contextlib.suppress(OSError):
                (self.folder / STOP_FILE).write_text(by + "\n")
        try:
            os.kill(self.launcher_pid, signal.SIGINT)
        except ProcessLookupError:
            raise UsageError(
                f"run {self.launch_id}'s launcher is gone", hint="nothing to stop"
            ) from None
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.ended():
                return True
            time.sleep(0.1)
        return False

    def log_file(self, worker: int) -> Path:
        return self.folder / f"w{worker}.log"

    def reread(self) -> RunRecord:
        """The record as it is now (a running launch rewrites it when it ends)."""
        return run_record(self.folder)


def run_record(folder: Path) -> RunRecord:
    """The record in a run folder; a StateError when it is missing or unreadable."""
    try:
        data = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))
        return _from_json(folder, data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StateError(
            f"the record of run {folder.name} is unreadable: {folder / RUN_FILE}",
            hint="'tpupod run' writes it when a launch starts; a hand edit may have broken it",
        ) from exc


def _from_json(folder: Path, data: dict[str, Any]) -> RunRecord:
    exit_code, pid = data.get("exit_code"), data.get("launcher_pid")
    return RunRecord(
        folder=folder,
        launch_id=str(data["launch_id"]),
        command=str(data["command"]),
        workers=tuple(
            WorkerBrief(int(w["id"]), str(w["hostname"]), w.get("slice"), w.get("pod_id"))
            for w in data["workers"]
        ),
        coordinator=str(data["coordinator"]),
        started=float(data["started"]),
        finished=None if data.get("finished") is None else float(data["finished"]),
        exit_code=None if exit_code is None else int(exit_code),
        results=tuple(
            RunOutcome(int(r["worker"]), str(r["outcome"]), str(r["last_line"]))
            for r in data.get("results") or ()
        ),
        launcher_pid=None if pid is None else int(pid),
        logs_cut=None if data.get("logs_cut") is None else str(data["logs_cut"]),
        written=None if not data.get("ending") else Ending.from_json(data["ending"]),
        job=None if not data.get("job") else (int(data["job"]["id"]), int(data["job"]["attempt"])),
        hung=_hung(data.get("hung")),
    )


def _hung(data: dict[str, Any] | None) -> Hung | None:
    if not data:
        return None
    stacks = data.get("stacks")
    return Hung(
        why=str(data["why"]),
        digest=tuple(str(line) for line in data.get("digest") or ()),
        stacks=None if stacks is None else str(stacks),
        odd=tuple(int(w) for w in data.get("odd") or ()),
    )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def runs(pod_name: str, state: StateDir | None = None) -> list[RunRecord]:
    """The pod's runs, oldest first by start time (then launch id).

    A folder whose record is not written yet (a launch this instant) or is
    unreadable is left out. An unknown pod is a PodNotFound.
    """
    state = state or StateDir()
    state.load_brief(pod_name)  # the pod must exist
    folder = state.pod_dir(pod_name) / RUNS_DIR
    records = []
    for path in folder.iterdir() if folder.is_dir() else ():
        try:
            records.append(run_record(path))
        except StateError:
            continue
    return sorted(records, key=lambda r: (r.started, r.launch_id))


def get_run(
    pod_name: str, launch_id: str | None = None, state: StateDir | None = None
) -> RunRecord:
    """A run of the pod by launch id, or its latest run."""
    found = runs(pod_name, state)
    if not found:
        raise UsageError(
            f"pod {pod_name!r} has no runs yet", hint="start one with 'tpupod run -- CMD'"
        )
    if launch_id is None:
        return found[-1]
    for record in found:
        if record.launch_id == launch_id:
            return record
    recent = ", ".join(r.launch_id for r in found[-5:])
    raise UsageError(
        f"no run {launch_id!r} on pod {pod_name!r}",
        hint=f"recent runs: {recent} ('tpupod logs --list' lists them all)",
    )


def read_logs(
    record: RunRecord,
    workers: Sequence[int],
    *,
    follow: bool = False,
    poll_s: float = FOLLOW_POLL_S,
    stop: threading.Event | None = None,
) -> Iterator[tuple[WorkerBrief, str]]:
    """The selected workers' log lines, worker by worker as far as written; with ``follow``,
    again every ``poll_s`` seconds until the run has ended (or its launcher is gone) and
    everything is read, or until ``stop`` is set (the reader left). A pass opens only the
    logs that grew and reads ``run.json`` again only when it changed: a pass over 256
    workers' logs cost 3-4 ms of CPU when it opened each, about 0.5-0.9 ms as stats."""
    briefs = [w for w in record.workers if w.id in workers]
    paths = {b.id: record.log_file(b.id) for b in briefs}
    offsets = dict.fromkeys(workers, 0)
    ended = EndWatch(record)
    while True:
        # Ended before this pass: the pass reads all there is, and it is the last.
        last = not follow or ended()
        for brief in briefs:
            path, offset = paths[brief.id], offsets[brief.id]
            if not last and _size(path) in (offset, None):  # nothing new
                continue
            lines, offsets[brief.id] = _new_lines(path, offset, last)
            yield from ((brief, line) for line in lines)
        if last or (stop is not None and stop.wait(poll_s)):
            return
        if stop is None:
            time.sleep(poll_s)


class EndWatch:
    """``record.ended()``, with ``run.json`` read again only when the file changed (the
    launcher replaces it when the run ends)."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.seen: tuple[int, int, int] | None = None

    def __call__(self) -> bool:
        if self.record.launcher_gone():
            return self.record.ended()
        try:
            found = os.stat(self.record.folder / RUN_FILE)
        except FileNotFoundError:
            return self.record.ended()
        key = (found.st_ino, found.st_mtime_ns, found.st_size)
        if key == self.seen:
            return False
        self.seen = key
        return self.record.ended()


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _new_lines(path: Path, offset: int, last: bool) -> tuple[list[str], int]:
    """Whole lines written since ``offset`` (and, on the ``last`` pass, a final partial one)."""
    try:
        with path.open("rb") as file:
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return [], offset
    end = len(data) if last else data.rfind(b"\n") + 1
    text = data[:end].decode("utf-8", errors="replace")
    return text.splitlines(), offset + end


def _old_ending(record: RunRecord) -> Ending:
    """The ending of a record written before ``ending`` was kept, as far as its exit code and
    each worker's outcome text tell (the last place that reads an outcome from text)."""
    code = record.exit_code
    if code == 0:
        return Ending(RunState.OK, 0)
    failed = [r for r in record.results if r.outcome not in ("exit 0", "ok")]
    if failed and all(r.outcome.startswith("interrupted") for r in failed):
        return Ending(RunState.STOPPED, code, why="stopped by a signal")
    first = next(iter(failed), None)
    if first is None:
        return Ending(RunState.FAILED, code, why=f"exit {code}")
    said = f": {first.last_line}" if first.last_line else ""
    why = f"w{first.worker} {first.outcome}{said}"
    return Ending(RunState.FAILED, code, first_failure=first.worker, why=why)
