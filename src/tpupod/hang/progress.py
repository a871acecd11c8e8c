"""The launcher's view of each worker's progress: the hang and straggler rules.

A worker progresses when its heartbeat's step grows (``tpupod.heartbeat``), or, for a
program that never calls it, when it prints a line. The run is hung when no worker has
progressed for the timeout. A straggler is a worker with a heartbeat that has stood still
for half the timeout while another worker's step went past it: named once, before the
timeout, so a slow host is seen before the whole run stops.

The state goes to the run's ``progress.json`` (at most every ``SAVE_S``): each worker's
step, steps/s and seconds since its last progress, which ``tpupod status``, the summary
and the dashboard read, and its first and last heartbeats (wall time, step), from which
a ``--retries`` run's goodput is counted (recovery/goodput.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpupod.base.files import write_atomic
from tpupod.hang.heartbeat import MARKER

PROGRESS_FILE = "progress.json"
SAVE_S = 1.0
RATE_WINDOW = 10  # steps/s over the last this many heartbeats


@dataclass
class WorkerProgress:
    last: float  # monotonic time of its last progress
    step: int | None = None  # its heartbeat's last step (None: no heartbeat yet)
    beats: list[tuple[float, int]] = field(default_factory=list)  # (wall time, step)
    first: tuple[float, int] | None = None  # its first heartbeat (wall time, step): goodput
    straggling: bool = False  # named as a straggler already
    ended: bool = False  # its program said its last step (a normal exit)

    @property
    def rate(self) -> float | None:
        """Steps per second over the last heartbeats (None: fewer than two)."""
        if len(self.beats) < 2:
            return None
        (t0, s0), (t1, s1) = self.beats[0], self.beats[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


class Progress:
    """Each worker's progress, fed every output line (``seen``); the clock is monotonic."""

    def __init__(self, workers: list[int], clock: float | None = None) -> None:
        now = time.monotonic() if clock is None else clock
        self.workers = {w: WorkerProgress(now) for w in workers}
        self._saved = 0.0
        self._pending = False

    def seen(self, worker: int, text: str, now: float | None = None) -> str | None:
        """A line from ``worker``: what is left of it once a heartbeat marker is taken out
        (None: nothing; the marker is kept out of the terminal, the logs and the summary).
        A marker may end a line the program had begun without ending it (``print(x,
        end="")``, a progress bar's ``\\r``): the text before it is the line."""
        now = time.monotonic() if now is None else now
        state = self.workers.get(worker)
        found = _MARKER_AT_END.search(text)
        if found is not None:
            if state is not None:
                _beat(state, found, now)
            text = text[: found.start()]
            return text if text.strip() else None
        if state is not None and state.step is None:
            state.last = now  # no heartbeat: a line is progress
        return text

    @property
    def any_heartbeat(self) -> bool:
        return any(state.step is not None for state in self.workers.values())

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds since any worker last progressed."""
        now = time.monotonic() if now is None else now
        return now - max(state.last for state in self.workers.values())

    def stragglers(self, after: float, now: float | None = None) -> list[int]:
        """Workers newly found straggling: a heartbeat that stood still ``after`` seconds
        while another worker's step went past it (each named once)."""
        now = time.monotonic() if now is None else now
        steps = [s.step for s in self.workers.values() if s.step is not None]
        if not steps:
            return []
        ahead = max(steps)
        found = []
        for worker, state in self.workers.items():
            # behind: a step below another's, or none yet while another has passed step 0
            behind = (state.step is None and ahead > 0) or (
                state.step is not None and state.step < ahead
            )
            if behind and not state.ended and not state.straggling and now - state.last >= after:
                state.straggling = True
                found.append(worker)
        return found

    def rank(self, worker: int) -> float:
        """How far along ``worker`` is, to order workers whose stacks tie: its step, else
        when it last printed (lower: further behind)."""
        state = self.workers[worker]
        return float(state.step) if state.step is not None else state.last

    def describe(self, worker: int, now: float | None = None) -> str:
        """``at step 41 (2.5 steps/s), 12 s ago``, or ``no step yet, last line 3 s ago``."""
        now = time.monotonic() if now is None else now
        state = self.workers[worker]
        ago = f"{now - state.last:.0f} s ago"
        if state.step is None:
            return f"no step yet, last line {ago}"
        rate = f" ({state.rate:.2f} steps/s)" if state.rate is not None else ""
        return f"at step {state.step}{rate}, last step {ago}"

    def save(self, run_dir: Path, *, force: bool = False) -> None:
        """``progress.json`` in the run's folder once a heartbeat came, at most every SAVE_S
        (``force``: now); a save too soon after the last is made SAVE_S later, so the last
        heartbeat before a hang is on disk too."""
        now = time.monotonic()
        if not self.any_heartbeat and not force:
            return
        if not force and now - self._saved < SAVE_S:
            if not self._pending:
                with contextlib.suppress(RuntimeError):  # no running loop: the next beat saves
                    asyncio.get_running_loop().call_later(SAVE_S, self._later, run_dir)
                    self._pending = True
            return
        self._saved = now
        wall = time.time()
        data = {
            "at": wall,
            "workers": {
                str(w): {
                    "step": s.step,
                    "steps_per_s": s.rate,
                    "last_progress": wall - (now - s.last),
                    "first": s.first,
                    "last": s.beats[-1] if s.beats else None,
                }
                for w, s in self.workers.items()
            },
        }
        with contextlib.suppress(OSError):  # a full disk: the run goes on without it
            write_atomic(run_dir / PROGRESS_FILE, json.dumps(data))

    def _later(self, run_dir: Path) -> None:
        self._pending = False
        self.save(run_dir, force=True)


_MARKER_AT_END = re.compile(re.escape(MARKER) + r" (-?\d+) ([0-9.]+)( end)?$")


def _beat(state: WorkerProgress, found: re.Match[str], now: float) -> None:
    step, at = int(found[1]), float(found[2])
    state.ended = found[3] is not None
    if state.step is None or step != state.step:
        state.last = now
        state.straggling = False
    state.step = step
    state.first = state.first or (at, step)
    state.beats = [*state.beats[-(RATE_WINDOW - 1) :], (at, step)]


def read(run_dir: Path) -> dict[int, dict[str, Any]]:
    """A run's ``progress.json``: worker id -> step, steps_per_s, last_progress (wall
    time), first and last (heartbeats: [wall time, step]); empty when the run has none
    (no heartbeat, or an older run)."""
    try:
        data = json.loads((run_dir / PROGRESS_FILE).read_text())
        return {int(w): dict(v) for w, v in data["workers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def summary_line(run_dir: Path) -> str | None:
    """The run summary's line of steps, for a run with heartbeats: each step reached and
    its workers, the ones behind first, and the median steps/s (None: no heartbeats)."""
    found = {w: v for w, v in read(run_dir).items() if v.get("step") is not None}
    if not found:
        return None
    from tpupod.fanout.report import worker_list  # the summary's naming: when printing only

    by_step: dict[int, list[int]] = {}
    for worker, values in found.items():
        by_step.setdefault(int(values["step"] or 0), []).append(worker)
    shown = [f"{worker_list(ws)} at {step}" for step, ws in sorted(by_step.items())]
    more = f", {len(shown) - 4} more" if len(shown) > 4 else ""
    rates = sorted(float(r) for v in found.values() if (r := v.get("steps_per_s")) is not None)
    rate = f"; {rates[len(rates) // 2]:.2f} steps/s (median)" if rates else ""
    return f"steps: {', '.join(shown[:4])}{more}{rate}"
