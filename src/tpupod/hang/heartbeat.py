"""``tpupod.heartbeat(step)``: a program says how far it got, for the launcher's watchdog.

A call costs a clock read and a comparison (~0.1 us): it prints a marker line,
``tpupod-heartbeat STEP TIME``, only when the step changed and a second has passed since
the last one (and at the first call). The launcher already reads every worker's output:
no other channel, over SSH and inside containers alike; it takes the markers out of the
terminal, the logs and the summary, and keeps each worker's step and steps/s in the run's
``progress.json``. Outside ``tpupod run`` (no ``TPUPOD_LAUNCH_ID``) it does nothing.

Once a worker has called it, only a step that moves counts as its progress: a program
that goes on printing while its steps stand still is hung all the same.
"""

from __future__ import annotations

import sys
import time

from tpupod import settings

MARKER = "tpupod-heartbeat"
EVERY_S = 1.0  # at most one marker line a second


class _Beat:
    """The last step printed, and when (module state: one program, one heartbeat)."""

    step: int | None = None
    printed = -EVERY_S
    active: bool | None = None  # under tpupod run (read once)


def heartbeat(step: int) -> None:
    """Tell the launcher this worker reached ``step`` (an int that grows; cheap: call it
    every step)."""
    now = time.monotonic()
    if step == _Beat.step or now - _Beat.printed < EVERY_S:
        return
    if _Beat.active is None:
        _Beat.active = settings.launch_id() is not None
    _Beat.step, _Beat.printed = step, now
    if _Beat.active:
        sys.stdout.write(f"{MARKER} {int(step)} {time.time():.3f}\n")
        sys.stdout.flush()
