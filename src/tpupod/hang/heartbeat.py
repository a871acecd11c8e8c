"""``tpupod.heartbeat(step)``: a program says how far it got, for the launcher's watchdog.

A call costs a clock read and a comparison (BENCHMARKS.md): it prints a marker line,
``tpupod-heartbeat STEP TIME``, only when the step changed and a second has passed since
the last one (and at the first call). The launcher already reads every worker's output:
no other channel, over SSH and inside containers alike; it takes the markers out of the
terminal, the logs and the summary, and keeps each worker's step and steps/s in the run's
``progress.json``. Outside ``tpupod run`` (no ``TPUPOD_LAUNCH_ID``) it does nothing.

Once a worker has called it, only a step that moves counts as its progress: a program
that goes on printing while its steps stand still is hung all the same.
"""

from __future__ import annotations

import atexit
import sys
import time

from tpupod import settings

MARKER = "tpupod-heartbeat"
EVERY_S = 1.0  # at most one marker line a second


class _Beat:
    """The last step printed, and when (module state: one program, one heartbeat)."""

    step: int | None = None
    latest: int | None = None  # the last step given, printed or not
    printed = -EVERY_S
    active: bool | None = None  # under tpupod run (read once)


def heartbeat(step: int) -> None:
    """Tell the launcher this worker reached ``step`` (an int that grows; cheap: call it
    every step)."""
    _Beat.latest = step
    now = time.monotonic()
    if step == _Beat.step or now - _Beat.printed < EVERY_S:
        return
    if _Beat.active is None:
        _Beat.active = settings.launch_id() is not None
        if _Beat.active:
            atexit.register(_last_beat)
    _Beat.step, _Beat.printed = step, now
    if _Beat.active:
        _write(step)


def _write(step: int, end: str = "") -> None:
    sys.stdout.write(f"{MARKER} {int(step)} {time.time():.3f}{end}\n")
    sys.stdout.flush()


def _last_beat() -> None:
    """At a normal exit: the last step, marked as the end (the launcher then stops counting
    this worker among those that should progress)."""
    if _Beat.latest is not None:
        _write(_Beat.latest, " end")
