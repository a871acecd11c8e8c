"""Runs of ``tpupod run`` for the dashboard: the records ``tpupod logs`` reads
(launch/records.py), summarised; the first failure with its last lines."""

from __future__ import annotations

import os
import re
import shlex
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpupod.errors import StateError
from tpupod.fanout.results import RunState
from tpupod.hang import digest
from tpupod.hang.ofrun import stacks_of_run
from tpupod.launch.records import RUNS_DIR, EndWatch, RunRecord, run_record
from tpupod.launch.standing import ProgressWatch, latest_stacks, worker_progress
from tpupod.pod.state import StateDir
from tpupod.recovery.record import RecoveryRecord, find_recovery

TAIL_LINES = 10
TAIL_BYTES = 16_384
LAUNCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class RunIndex:
    """Every pod's runs as summaries, kept up to date at a cost that does not grow with the
    history: a pod's runs folder is listed again only when its mtime changed (a run was added
    or removed), an ended run is read once (a summary, not the record: a record of 256
    workers is thousands of objects), and only the runs not ended are read again.

    ``reads`` counts the run folders read, for the test that history costs nothing per take."""

    def __init__(self) -> None:
        self.listed: dict[str, int] = {}  # pod -> its runs folder's mtime when last listed
        self.ended: dict[str, dict[Path, dict[str, Any]]] = {}  # pod -> folder -> summary
        self.live: dict[str, dict[Path, dict[str, Any] | None]] = {}  # None: not readable yet
        self.made: dict[str, Any] | None = None
        self.reads = 0

    def take(self, state: StateDir) -> dict[str, Any]:
        """``{"count", "states": {state: n}, "list": summaries newest first, "failing":
        the newest failing, "failing_count"}``: the same object while nothing changed."""
        names = state.names()
        changed = set(self.listed) != set(names)
        for gone in set(self.listed) - set(names):
            del self.listed[gone], self.ended[gone], self.live[gone]
        for name in names:
            changed = self._pod(state, name) or changed
        if changed or self.made is None:
            found = [r for name in names for r in self._all(name)]
            found.sort(key=lambda r: (r["started"], r["id"]), reverse=True)
            states: dict[str, int] = {}
            for r in found:
                states[r["state"]] = states.get(r["state"], 0) + 1
            failing = [r for r in found if r["state"] in FAILING]
            self.made = {
                "count": len(found),
                "states": states,
                "list": found,
                "failing": failing[:FAILING_SHOWN],
                "failing_count": len(failing),
            }
        return self.made

    def _all(self, name: str) -> Iterator[dict[str, Any]]:
        yield from self.ended[name].values()
        yield from (r for r in self.live[name].values() if r is not None)

    def _pod(self, state: StateDir, name: str) -> bool:
        """Bring one pod's runs up to date; whether any summary changed."""
        folder = state.pod_dir(name) / RUNS_DIR
        try:
            mtime = folder.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = -1
        ended = self.ended.setdefault(name, {})
        live = self.live.setdefault(name, {})
        changed = False
        if self.listed.get(name) != mtime:  # listed after the stat: nothing added is missed
            self.listed[name] = mtime
            paths = set(folder.iterdir()) if mtime >= 0 else set()
            for gone in (set(ended) | set(live)) - paths:
                ended.pop(gone, None)
                live.pop(gone, None)
                changed = True
            for path in paths - set(ended) - set(live):
                live[path] = None
        for path, before in list(live.items()):
            made, done = self._read(state, name, path)
            if done and made is not None:
                del live[path]
                ended[path] = made
            else:
                live[path] = made
            changed = changed or made != before
        return changed

    def _read(self, state: StateDir, name: str, path: Path) -> tuple[dict[str, Any] | None, bool]:
        """A run's summary (None: its record is not written yet) and whether it has ended."""
        self.reads += 1
        recovery = find_recovery(state, name, path.name)
        if recovery is not None:  # a --retries run: its attempts are runs of their own
            return recovery_summary(recovery), recovery.ended
        try:
            record = run_record(path)
        except StateError:  # a launch this instant: its record is not written yet
            return None, False
        return summary(record, name), record.done


def recovery_summary(record: RecoveryRecord) -> dict[str, Any]:
    """A ``run --retries`` run: its state and attempts (preemptions among their causes)."""
    last = record.attempts[-1] if record.attempts else None
    finished = last.ended if record.ended and last is not None else None
    why = None
    if record.state == "failed" and last is not None:
        why = f"attempt {last.attempt}: {last.cause or 'failed'}" + (
            f": {last.detail}" if last.detail else ""
        )
    return {
        "id": record.run_id,
        "pod": record.pod,
        "command": shlex.join(record.command),
        "state": record.state,
        "why": why,
        "exit_code": record.exit_code,
        "started": record.started,
        "finished": finished,
        "seconds": None if finished is None else round(finished - record.started, 3),
        "workers": None,
        "first_failure": None,
        "job": None,
        "attempts": record.lines(),
        "goodput": record.goodput_line(),
        "elastic": record.elastic_lines(),
        "attempt_rows": [
            {
                "attempt": a.attempt,
                "cause": a.cause,
                "exit_code": a.exit_code,
                "launch_id": a.launch_id,
                "started": a.started,
                "finished": a.ended,
            }
            for a in record.attempts
        ],
        "launches": [a.launch_id for a in record.attempts if a.launch_id],
    }


def find_retried(state: StateDir, run_id: str) -> dict[str, Any] | None:
    """The ``run --retries`` run ``run_id`` (None: it is not one)."""
    if LAUNCH_ID.fullmatch(run_id):
        for name in state.names():
            found = find_recovery(state, name, run_id)
            if found is not None:
                return recovery_summary(found)
    return None


def find(state: StateDir, launch_id: str) -> RunRecord:
    """A run by launch id, on whichever pod it ran (its folder is named by it)."""
    if LAUNCH_ID.fullmatch(launch_id):
        for name in state.names():
            folder = state.pod_dir(name) / RUNS_DIR / launch_id
            if folder.is_dir():
                return run_record(folder)
    raise StateError(f"no run {launch_id!r}", hint="the runs page lists them")


def ok(outcome: str) -> bool:
    return outcome in ("exit 0", "ok")


# what the overview lists as failing ("failed": a --retries run's state)
FAILING = (RunState.FAILED, RunState.TIMED_OUT, RunState.LAUNCHER_GONE, "failed")
FAILING_SHOWN = 10  # the newest failing runs the overview lists (and says how many more)


def summary(record: RunRecord, pod: str) -> dict[str, Any]:
    end = record.finished
    judged = record.ending  # once: it looks at the launcher (a lock file) while it runs
    return {
        "id": record.launch_id,
        "pod": pod,
        "command": record.command,
        "state": judged.state,
        "why": judged.why or None,
        "exit_code": record.exit_code,
        "started": record.started,
        "finished": end,
        "seconds": None if end is None else round(end - record.started, 3),
        "workers": len(record.workers),
        "slices": len({w.slice for w in record.workers}),
        "first_failure": judged.first_failure,
        "job": None if record.job is None else {"id": record.job[0], "attempt": record.job[1]},
    }


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last lines of a log file (its last 16 KiB at most)."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, 2)
            file.seek(max(0, size - TAIL_BYTES))
            data = file.read()
    except FileNotFoundError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-lines:]


def detail(record: RunRecord, pod: str) -> dict[str, Any]:
    """The run with every worker's state, exit and progress (step, steps/s, its last
    progress), the first failure first; its latest stacks' digest; why it hung."""
    outcomes = {r.worker: r for r in record.results}
    shown = summary(record, pod)  # once: it looks at the launcher (a lock file) each time
    failed, overall = shown["first_failure"], shown["state"]
    at = record.finished or time.time()  # an ended run's ages: to its end
    progress = {p.worker: p.to_json(at) for p in worker_progress(record)}
    stacks = latest_stacks(record)
    workers = []
    for w in record.workers:
        r = outcomes.get(w.id)
        workers.append(
            {
                "worker": w.id,
                "hostname": w.hostname,
                "slice": w.slice,
                "state": r.outcome if r else overall,
                "ok": ok(r.outcome) if r else None,
                "last_line": r.last_line if r else "",
                "tail": tail(record.log_file(w.id)),
                "progress": progress[w.id],
            }
        )
    workers.sort(key=lambda w: (w["worker"] != failed, w["worker"]))
    return {
        **shown,
        "worker_list": workers,
        "stepping": any(p["step"] is not None for p in progress.values()),
        "stacks": None if stacks is None else stacks.to_json(),
        "hung": None if record.hung is None else record.hung.why,
    }


def take_stacks(state: StateDir, record: RunRecord) -> dict[str, Any]:
    """Every worker's stacks of a running run, now (``tpupod stacks``): the digest, the
    hints for the workers without stacks, the seconds they took, where they are saved."""
    found, lines, took, saved = stacks_of_run(state, pod_of(record), record.launch_id, None, False)
    return {
        "digest": lines,
        "hints": digest.hints(found),
        "seconds": round(took, 3),
        "saved": str(saved),
    }


def pod_of(record: RunRecord) -> str:
    return record.folder.parent.parent.name


# -- a run's logs for its page ------------------------------------------------------------
# Each worker's tail first, read back from the end of its file, then what is written, a
# batch per pass; a batch's id (every worker's offset) lets a reconnecting browser go on
# where it was. A page used to get every line from the start, one event each: a run of 4
# workers x 100,000 lines (21 MB) was incomplete after 120 s and cost the dashboard 57 s of
# CPU per viewer, though the page keeps 500 lines a worker. `tpupod logs` and the download
# have them all.

PANE_LINES = 500  # what a page keeps of each worker's log
TAIL_TOTAL = 50_000  # and of all of them: 256 workers get 195 lines each
TAIL_READ = 1 << 20  # read back at most this much of a log for its tail
CATCH_UP_BYTES = 1 << 20  # a browser further behind than this starts again at the tail
# a followed run's logs are read again this often: a pass over 256 workers' logs costs
# about 5 ms of CPU, so 0.1 s took 5 % of a core per open run page; a line still shows
# within a second
POLL_S = 0.25


@dataclass
class Batch:
    """What one pass found: (worker, line) pairs in order; the workers whose pane starts
    over (the browser was too far behind: their tail follows); the id to resume after."""

    lines: list[tuple[int, str]] = field(default_factory=list)
    reset: list[int] = field(default_factory=list)
    cursor: str = ""
    progress: list[dict[str, Any]] | None = None  # the workers' progress, when it changed
    first: bool = False  # the follow's first (its lines' event goes even when empty)


def tail_lines(workers: int) -> int:
    return max(1, min(PANE_LINES, TAIL_TOTAL // max(1, workers)))


def tail_start(path: Path, lines: int) -> int:
    """The offset of the first of the last ``lines`` whole lines of ``path`` (read back
    from its end, ``TAIL_READ`` at most: a line cut there is left out)."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            start = max(0, size - TAIL_READ)
            file.seek(start)
            data = file.read(size - start)
    except FileNotFoundError:
        return 0
    end = data.rfind(b"\n") + 1  # the last whole line's end (a line being written waits)
    cut = end - 1  # the newline before the tail's first line, found from the end
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            break
    if cut < 0:  # fewer lines than asked: all of them, but for one cut by TAIL_READ
        return start if start == 0 else start + data.find(b"\n") + 1
    return start + cut + 1


def encode(offsets: dict[int, int]) -> str:
    return ".".join(str(offsets[w]) for w in sorted(offsets))


def decode(cursor: str | None, workers: list[int]) -> dict[int, int] | None:
    """A batch's id back into offsets; None for none, or one not of this run."""
    if not cursor:
        return None
    parts = cursor.split(".")
    if len(parts) != len(workers) or not all(p.isdigit() for p in parts):
        return None
    return dict(zip(workers, map(int, parts), strict=True))


class RunLogs:
    """Every worker's log of a run from its tail (or from ``cursor``), until the run has
    ended and all is read, or ``stop`` is set (the viewer left)."""

    def __init__(self, record: RunRecord, cursor: str | None = None) -> None:
        self.record = record
        self.workers = [w.id for w in record.workers]
        self.paths = {w: record.log_file(w) for w in self.workers}
        self.keep = tail_lines(len(self.workers))
        resumed = decode(cursor, self.workers)
        self.offsets = resumed or {w: tail_start(p, self.keep) for w, p in self.paths.items()}
        self.resumed = resumed is not None
        self.progress = ProgressWatch(record)

    def batches(self, stop: threading.Event, poll_s: float = POLL_S) -> Iterator[Batch]:
        ended = EndWatch(self.record)
        first = True
        while True:
            last = ended()  # ended before this pass: it reads all there is, and it is the last
            batch = self._pass(last=last, first=first)
            batch.first = first
            batch.progress = None if last else self.progress.poll(grew=bool(batch.lines))
            if batch.lines or batch.reset or batch.progress or first:
                yield batch
            first = False
            if last or stop.wait(poll_s):
                return

    def _pass(self, *, last: bool, first: bool) -> Batch:
        batch = Batch()
        for worker, path in self.paths.items():
            size = _size(path)
            offset = self.offsets[worker]
            if size is None or (size == offset and not last):
                continue
            if size < offset or size - offset > CATCH_UP_BYTES:  # replaced, or far behind
                offset = tail_start(path, self.keep)
                if self.resumed or not first:
                    batch.reset.append(worker)
            lines, self.offsets[worker] = _read(path, offset, last)
            batch.lines += ((worker, line) for line in lines)
        batch.cursor = encode(self.offsets)
        return batch


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _read(path: Path, offset: int, last: bool) -> tuple[list[str], int]:
    """Whole lines from ``offset`` (and, on the ``last`` pass, a final partial one); the
    offset after them."""
    with path.open("rb") as file:
        file.seek(offset)
        data = file.read(CATCH_UP_BYTES + TAIL_READ)
    end = len(data) if last else data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").splitlines(), offset + end
