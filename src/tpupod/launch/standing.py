"""How a run stands, for ``tpupod status`` and the dashboard: each worker's progress, the
latest stacks' digest, and why it hung.

A worker's progress is its heartbeat's step and steps/s from the run's ``progress.json``
(``tpupod.heartbeat``, kept by the launcher); a worker that never called it progresses by
its output, so its last line is its log's last write. A step that has not moved for
``STALL_S`` (or three of its steps, when steps are slower) is shown as stalled, with the
rate it had before: a rate read off the last heartbeats says nothing of a worker that has
since stopped. The digest is the newest ``stacks-*.json`` in the run's folder (``tpupod
stacks``, the dashboard's button), or the one the hang watchdog printed when it stopped the
run. An ended run's ages are counted to its end, not to now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpupod.base.durations import format_seconds
from tpupod.fanout.results import RunState
from tpupod.hang import digest, progress
from tpupod.launch.records import RUNS_DIR, RunRecord, runs
from tpupod.pod.state import StateDir

STALL_S = 5.0  # a heartbeat prints at most once a second; the launcher saves every 2 s
HEARTBEAT, LINE, START = "heartbeat", "line", "start"  # what a worker's last progress was


@dataclass(frozen=True)
class WorkerStanding:
    """One worker's progress: its step and steps/s (None: no heartbeat), and when it last
    progressed (``source``: its heartbeat's step, a line of output, or the run's start
    when it printed nothing yet)."""

    worker: int
    hostname: str
    step: int | None
    steps_per_s: float | None
    last_progress: float
    source: str
    stall_s: float = STALL_S  # 0 in a run that ended hung: none progressed, by its verdict

    def stalled(self, now: float) -> bool:
        """A heartbeat whose step stood still longer than a moving one's can."""
        if self.step is None:
            return False
        slow = 3 / self.steps_per_s if self.steps_per_s and self.stall_s else 0.0
        return now - self.last_progress > max(self.stall_s, slow)

    def text(self, now: float) -> str:
        """``step 61, 9.98 steps/s, last step 1s ago``; ``step 31, no step for 25s (9.96
        steps/s before)``; ``last line 3s ago``; ``no output for 12s``."""
        ago = format_seconds(round(max(0.0, now - self.last_progress)))
        if self.source == START:
            return f"no output for {ago}"
        if self.step is None:
            return f"last line {ago} ago"
        rate = "" if self.steps_per_s is None else f"{self.steps_per_s:.2f} steps/s"
        if self.stalled(now):
            return f"step {self.step}, no step for {ago}" + (f" ({rate} before)" if rate else "")
        return f"step {self.step}, " + (f"{rate}, " if rate else "") + f"last step {ago} ago"

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "hostname": self.hostname,
            "step": self.step,
            "steps_per_s": self.steps_per_s,
            "last_progress": self.last_progress,
            "seconds_since": round(max(0.0, now - self.last_progress), 3),
            "source": self.source,
            "stalled": self.stalled(now),
            "text": self.text(now),
        }


@dataclass(frozen=True)
class Stacks:
    """The latest stacks of a run: their digest, when taken, where the dump is."""

    digest: tuple[str, ...]
    taken: float | None
    path: str | None

    def to_json(self) -> dict[str, Any]:
        return {"digest": list(self.digest), "taken": self.taken, "path": self.path}


@dataclass(frozen=True)
class RunStanding:
    """A run as it stands: its state, every worker's progress, its latest stacks, why it
    hung (None: it did not). ``at`` is the time its ages are counted to."""

    launch_id: str
    command: str
    state: str
    started: float
    at: float
    workers: tuple[WorkerStanding, ...]
    stacks: Stacks | None
    hung: str | None

    @property
    def running(self) -> bool:
        return self.state == RunState.RUNNING.value

    def lines(self) -> list[str]:
        """The block ``tpupod status`` prints: a heading, a line a worker, the digest."""
        took = format_seconds(round(max(0.0, self.at - self.started)))
        head = f"run {self.launch_id} {self.state}" + (
            f" for {took}" if self.running else f" after {took}"
        )
        out = [f"{head}: {self.command}"]
        if self.hung:
            out.append(f"  {self.hung}")
        width = max((len(str(w.worker)) for w in self.workers), default=1)
        out += [f"  w{w.worker:<{width}}  {w.text(self.at)}" for w in self.workers]
        if self.stacks is not None:
            out.append(f"  stacks{self._taken()}:")
            out += [f"    {line}" for line in self.stacks.digest]
            if self.stacks.path:
                out.append(f"    saved in {self.stacks.path}")
        return out

    def _taken(self) -> str:
        if self.stacks is None or self.stacks.taken is None:
            return ""
        ago = format_seconds(round(max(0.0, time.time() - self.stacks.taken)))
        return f" taken {ago} ago"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.launch_id,
            "command": self.command,
            "state": self.state,
            "started": self.started,
            "at": self.at,
            "running": self.running,
            "hung": self.hung,
            "workers": [w.to_json(self.at) for w in self.workers],
            "stacks": None if self.stacks is None else self.stacks.to_json(),
        }


def standing(record: RunRecord, now: float | None = None) -> RunStanding:
    """How ``record``'s run stands now (an ended run: at its end)."""
    ending = record.ending  # once: while it runs, it looks at the launcher's lock
    at = record.finished if record.finished is not None else (now or time.time())
    return RunStanding(
        launch_id=record.launch_id,
        command=record.command,
        state=ending.state.value,
        started=record.started,
        at=at,
        workers=worker_progress(record),
        stacks=latest_stacks(record),
        hung=record.hung.why if record.hung is not None else None,
    )


def worker_progress(record: RunRecord) -> tuple[WorkerStanding, ...]:
    """Each worker's progress: its heartbeat's (``progress.json``), else its log's last
    write, else the run's start."""
    beats = progress.read(record.folder)
    stall_s = 0.0 if record.hung is not None else STALL_S
    found = []
    for worker in record.workers:
        beat = beats.get(worker.id, {})
        step, rate, last = beat.get("step"), beat.get("steps_per_s"), beat.get("last_progress")
        if step is not None and last is not None:
            found.append(
                WorkerStanding(
                    worker.id,
                    worker.hostname,
                    int(step),
                    None if rate is None else float(rate),
                    float(last),
                    HEARTBEAT,
                    stall_s,
                )
            )
            continue
        # the launcher's own time of the worker's last line (kept at the run's end: a log's
        # mtime then is when the stop was written into it), else the log's last write
        written = float(last) if last is not None else _last_write(record.log_file(worker.id))
        source, when = (LINE, written) if written is not None else (START, record.started)
        found.append(WorkerStanding(worker.id, worker.hostname, None, None, when, source))
    return tuple(found)


def latest_stacks(record: RunRecord) -> Stacks | None:
    """The digest the hang watchdog printed (with its hints), else the newest saved."""
    if record.hung is not None and record.hung.digest:
        saved = Path(record.hung.stacks) if record.hung.stacks else None
        taken = _mtime(saved) if saved is not None else None
        return Stacks(record.hung.digest, taken, record.hung.stacks)
    found = digest.latest(record.folder)
    if found is None:
        return None
    return Stacks(tuple(found.digest), found.taken, str(found.path))


def pod_standings(state: StateDir, pod_name: str) -> list[RunStanding]:
    """What ``tpupod status`` shows of a pod's runs: each one running, and the latest when
    it ended hung (oldest first)."""
    if not any((state.pod_dir(pod_name) / RUNS_DIR).glob("*/run.json")):
        return []
    found = runs(pod_name, state)
    shown = [r for r in found if r.ending.state is RunState.RUNNING]
    if found and found[-1].hung is not None and found[-1] not in shown:
        shown.append(found[-1])
    return [standing(r) for r in shown]


class ProgressWatch:
    """A followed run's workers' progress again when it may have changed (its
    ``progress.json`` rewritten, or a log grew), at most every ``every_s``: for the run
    page's follow, which polls its logs anyway."""

    def __init__(self, record: RunRecord, every_s: float = 1.0) -> None:
        self.record, self.every_s = record, every_s
        self.seen: float | None = None
        self.pending = True
        self.sent = -every_s

    def poll(self, grew: bool) -> list[dict[str, Any]] | None:
        """The workers' progress (JSON) when it changed since it was last sent; else None."""
        mtime = _mtime(self.record.folder / progress.PROGRESS_FILE)
        if grew or mtime != self.seen:
            self.seen, self.pending = mtime, True
        now = time.monotonic()
        if not self.pending or now - self.sent < self.every_s:
            return None
        self.pending, self.sent = False, now
        wall = time.time()
        return [w.to_json(wall) for w in worker_progress(self.record)]


def _last_write(path: Path) -> float | None:
    """When a log last got a line (None: it has none yet)."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_mtime if found.st_size > 0 else None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
