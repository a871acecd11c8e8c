"""Runs of ``tpupod run`` for the dashboard: the records ``tpupod logs`` reads
(launch/records.py), summarised; the first failure with its last lines."""

from __future__ import annotations

import os
import re
import shlex
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tpupod.errors import StateError, UsageError
from tpupod.launch.records import RunRecord, read_logs, run_record
from tpupod.launch.run import RUNS_DIR
from tpupod.recovery.record import RecoveryRecord, find_recovery
from tpupod.state import StateDir

TAIL_LINES = 10
TAIL_BYTES = 16_384
# a followed run's logs are read again this often: a pass over 256 workers' logs costs
# about 5 ms of CPU, so 0.1 s took 5 % of a core per open run page; a line still shows
# within a second
FOLLOW_POLL_S = 0.25
STOPPED_BY = re.compile(r"stopped after w(\d+) failed")
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
        """``{"count", "states": {state: n}, "list": summaries newest first}``: the same
        object while nothing changed."""
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
            self.made = {"count": len(found), "states": states, "list": found}
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
    return {
        "id": record.run_id,
        "pod": record.pod,
        "command": shlex.join(record.command),
        "state": record.state,
        "exit_code": record.exit_code,
        "started": record.started,
        "seconds": None,
        "workers": None,
        "first_failure": None,
        "attempts": record.lines(),
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


def first_failure(record: RunRecord) -> int | None:
    """The worker that failed first: the one the others were stopped for, else the first
    whose program did not end well."""
    for r in record.results:
        match = STOPPED_BY.search(r.outcome)
        if match:
            return int(match.group(1))
    return next((r.worker for r in record.results if not ok(r.outcome)), None)


def state(record: RunRecord) -> str:
    """ok, failed, running or launcher gone."""
    if record.done:
        return "ok" if record.exit_code == 0 else "failed"
    return record.state()


def summary(record: RunRecord, pod: str) -> dict[str, Any]:
    end = record.finished
    return {
        "id": record.launch_id,
        "pod": pod,
        "command": record.command,
        "state": state(record),
        "exit_code": record.exit_code,
        "started": record.started,
        "seconds": None if end is None else round(end - record.started, 3),
        "workers": len(record.workers),
        "first_failure": first_failure(record),
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
    """The run with every worker's state and exit, the first failure first."""
    outcomes = {r.worker: r for r in record.results}
    failed = first_failure(record)
    overall = state(record)  # once: it looks at the launcher (a lock file) each time
    workers = []
    for w in record.workers:
        r = outcomes.get(w.id)
        workers.append(
            {
                "worker": w.id,
                "hostname": w.hostname,
                "state": r.outcome if r else overall,
                "ok": ok(r.outcome) if r else None,
                "last_line": r.last_line if r else "",
                "tail": tail(record.log_file(w.id)),
            }
        )
    workers.sort(key=lambda w: (w["worker"] != failed, w["worker"]))
    return {**summary(record, pod), "finished": record.finished, "worker_list": workers}


def pod_of(record: RunRecord) -> str:
    return record.folder.parent.parent.name


def follow(record: RunRecord, stop: threading.Event) -> Iterator[tuple[int, str]]:
    """Every worker's lines as ``tpupod logs --follow`` reads them, until ``stop`` is set."""
    ids = [w.id for w in record.workers]
    for brief, line in read_logs(record, ids, follow=True, poll_s=FOLLOW_POLL_S, stop=stop):
        yield brief.id, line


def stop(record: RunRecord) -> None:
    """Stop a running run as Ctrl-C on its launcher does (it stops every worker: TERM, then
    KILL after the grace). Its launcher runs on this machine: it writes this state directory."""
    if record.ended() or record.launcher_pid is None:
        raise UsageError(f"run {record.launch_id} is not running", hint="nothing to stop")
    try:
        os.kill(record.launcher_pid, signal.SIGINT)
    except ProcessLookupError:
        raise UsageError(
            f"run {record.launch_id}'s launcher is gone", hint="nothing to stop"
        ) from None
