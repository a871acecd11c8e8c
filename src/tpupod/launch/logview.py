"""What ``tpupod logs`` prints: a run's per-worker logs (followed if asked), how the run
stands at the end, and the list of a pod's runs. The CLI parses and calls these."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tpupod.errors import UsageError
from tpupod.fanout.report import LinePrinter, print_columns
from tpupod.fanout.results import RunState
from tpupod.launch.records import RunRecord, get_run, read_logs, runs
from tpupod.pod.state import StateDir
from tpupod.recovery.record import find_recovery, recoveries
from tpupod.transport import OutputLine, Stream

COMMAND_WIDTH = 60  # characters of a run's command in the list


def show_logs(
    state: StateDir,
    pod: str,
    run_id: str | None,
    *,
    worker: int | None = None,
    follow: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print a run's logs (the latest run without ``run_id``), prefixed per worker, then one
    line on how it stands. A ``run --retries`` run lists its attempts first, then shows the
    logs of its latest launch. ``out``/``err`` default to the streams at call time (not at
    import, so a caller that swaps ``sys.stdout``, as typer's test runner does, is heard).

    Returns 0; with ``follow``, the run's own exit code (1 for a launcher that died without
    one), so a script that follows a run learns how it ended."""
    out, err = out or sys.stdout, err or sys.stderr
    recovery = find_recovery(state, pod, run_id)
    if recovery is not None:
        print("\n".join(recovery.told()), file=err)
        run_id = next((a.launch_id for a in reversed(recovery.attempts) if a.launch_id), None)
    record = get_run(pod, run_id, state)
    ids = [w.id for w in record.workers if worker is None or w.id == worker]
    if not ids:
        raise UsageError(f"run {record.launch_id} has no worker {worker}", hint=_numbering(record))
    printer = LinePrinter([w for w in record.workers if w.id in ids], out, err)
    for brief, text in read_logs(record, ids, follow=follow):
        printer(brief, OutputLine(Stream.STDOUT, text))
    record = record.reread()
    print(standing(record), file=err)
    if not follow:
        return 0
    ending = record.ending
    if ending.state is RunState.LAUNCHER_GONE:
        return 1
    return ending.exit_code or 0


def standing(record: RunRecord) -> str:
    """One line on how a run stands: its exit code, a launcher that died, or still running;
    and whether its logs stop early."""
    said = _standing(record)
    return f"{said} (its logs stop early: {record.logs_cut})" if record.logs_cut else said


def _standing(record: RunRecord) -> str:
    ending = record.ending
    if ending.state is RunState.RUNNING:
        return f"run {record.launch_id} is still running ('-f' follows it)"
    if ending.state is RunState.LAUNCHER_GONE:
        pid = f" (pid {record.launcher_pid})" if record.launcher_pid else ""
        return (
            f"run {record.launch_id} ended without a record of its end: its launcher{pid} is "
            "gone (killed?), and its workers were stopped with it"
        )
    return f"run {record.launch_id} ended with exit code {record.exit_code}: {ending.describe()}"


def list_runs(
    state: StateDir, pod: str, out: TextIO | None = None, err: TextIO | None = None
) -> None:
    """One line per run, oldest first: its id, start, workers, how it stands, what it ran;
    then the ``--retries`` runs (the ids ``--resume`` and ``cancel`` take), each with its
    state and launches."""
    out, err = out or sys.stdout, err or sys.stderr
    found = runs(pod, state)
    retried = recoveries(state, pod)
    if not found and not retried:
        print(f"pod {pod!r} has no runs yet", file=err)
        return
    rows = [["run", "started", "workers", "state", "command"]]
    for record in found:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started))
        rows.append(
            [
                record.launch_id,
                started,
                str(len(record.workers)),
                record.state(),
                _short(record.command),
            ]
        )
    if found:
        print_columns(rows, out)
    if retried:
        if found:
            print(file=out)
        print("runs with --retries (--resume and cancel take these ids):", file=out)
        table = [["run", "started", "state", "attempts", "command"]]
        for retry in retried:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(retry.started))
            state_said = retry.state if retry.ended else f"{retry.state} ({retry.phase})"
            launches = ", ".join(a.launch_id for a in retry.attempts if a.launch_id) or "-"
            command = _short(" ".join(retry.command))
            table.append(
                [retry.run_id, started, state_said, f"{len(retry.attempts)}: {launches}", command]
            )
        print_columns(table, out)


def _short(command: str) -> str:
    """A command as the run list shows it: cut to COMMAND_WIDTH with an ellipsis."""
    return command if len(command) <= COMMAND_WIDTH else command[: COMMAND_WIDTH - 1] + "…"


def _numbering(record: RunRecord) -> str:
    """How a run numbered its workers: w0 to w{N-1}, and on part of a pod, which they were."""
    count = len(record.workers)
    said = f"its workers are w0 to w{count - 1}" if count > 1 else "its one worker is w0"
    moved = [w for w in record.workers if w.pod_id is not None and w.pod_id != w.id]
    if not moved:
        return said
    pod_ids = ", ".join(f"w{w.pod_id}" for w in record.workers)
    return f"{said}: the pod's {pod_ids}, numbered from 0 for the run (a run on part of a pod)"
