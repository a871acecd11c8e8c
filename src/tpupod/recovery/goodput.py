"""A ``--retries`` run's goodput: productive step time over wall time, and where the rest went.

As Google's ML goodput measurement counts it: of the run's wall time (its start to its
end, every attempt and every wait between), only the time of steps that moved training
past where it had been is productive. The rest is badput, told apart by what it went to:

* ``capacity``: deleting and creating TPUs (a preempted slice made again), and an elastic
  run's wait for enough slices (``--min-slices``);
* ``setup``: the setup script run again on new hosts;
* ``start and restore``: from an attempt's launch (sync, preflight, the program's start,
  JAX's compile, the checkpoint's restore) to its first heartbeat;
* ``steps redone``: steps an earlier attempt had passed already (since its last
  checkpoint), at the attempt's own step time;
* ``after the last step``: from an attempt's last heartbeat to its end (the final save,
  the exit; or a step cut short by a preemption);
* ``launcher gone``: from the last heartbeat of an attempt whose launcher died (``kill
  -9``) to the ``run --resume`` that went on;
* ``between attempts``: probing silent hosts, waiting for space or capacity.

Steps are the program's ``tpupod.heartbeat(step)`` (the launch's ``progress.json``: each
worker's first and last beat); the furthest worker's count. A run whose program sends no
heartbeat has no goodput: its steps cannot be told from its start. Heartbeats come at
most once a second: the steps of the last second before a kill count as after the last
step, and steps redone may be short by as many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tpupod.hang import progress
from tpupod.recovery.policy import Cause

CAPACITY_PHASES = ("delete", "create", "wait")  # wait: --elastic, for enough slices
LAUNCHER_LOST = Cause.LAUNCHER_LOST.value


class Attempt(Protocol):
    """What goodput reads of an attempt (record.AttemptRecord, which imports this module)."""

    started: float
    ended: float | None
    launched: float | None
    phases: dict[str, float]
    launch_id: str | None
    cause: str | None


class Run(Protocol):
    """What goodput reads of a run (record.RecoveryRecord)."""

    path: Path
    started: float

    @property
    def attempts(self) -> Sequence[Attempt]: ...


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float] = field(default_factory=dict)  # what the rest went to
    steps: int = 0  # steps that moved training on
    steps_redone: int = 0

    @property
    def fraction(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "goodput": round(self.fraction, 4)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Goodput:
        return cls(
            float(data["wall_s"]), float(data["productive_s"]), dict(data["badput_s"]),
            int(data["steps"]), int(data["steps_redone"]),
        )  # fmt: skip

    def describe(self) -> str:
        """``goodput 81 %: steps 48.6 s of 60.0 s; steps redone 4.1 s (21), ...``."""
        spent = [
            f"{name} {secs:.1f} s" + (f" ({self.steps_redone})" if name == "steps redone" else "")
            for name, secs in self.badput_s.items()
            if secs >= 0.05
        ]
        head = (
            f"goodput {self.fraction:.0%}: {self.steps} steps in {self.productive_s:.1f} s "
            f"of {self.wall_s:.1f} s"
        )
        return head + (f"; {', '.join(spent)}" if spent else "")


def beats(run_dir: Path) -> tuple[tuple[float, int], tuple[float, int]] | None:
    """A launch's first and last heartbeat (wall time, step), of the worker that got
    furthest: workers in lockstep are within a step of each other, and a worker's beats
    come at most once a second (one stopped beside a failed peer keeps an older last beat
    than the peer's exit); None without heartbeats."""
    found = []
    for worker in progress.read(run_dir).values():
        first, last = worker.get("first"), worker.get("last")
        if first and last:
            found.append(((float(first[0]), int(first[1])), (float(last[0]), int(last[1]))))
    if not found:
        return None
    return max(found, key=lambda pair: (pair[1][1], -pair[1][0]))


def account(record: Run, ended: float) -> Goodput | None:
    """The run's goodput up to ``ended`` (wall time); None where no attempt has heartbeats.

    An attempt's steps are those between its first and last heartbeat: the first beat's
    own step is its start (compile, restore), as Google's measurement counts the first
    step's time. A step at or below the furthest an earlier attempt reached is redone."""
    runs = record.path.parent.parent
    kinds = ("capacity", "setup", "start and restore", "steps redone", "after the last step")
    badput = dict.fromkeys((*kinds, "launcher gone"), 0.0)
    productive, steps, redone = 0.0, 0, 0
    passed: int | None = None  # the furthest step an earlier attempt reached
    accounted = 0.0  # seconds inside attempts
    for attempt in record.attempts:
        end = attempt.ended if attempt.ended is not None else ended
        accounted += max(0.0, end - attempt.started)
        badput["capacity"] += sum(attempt.phases.get(p, 0.0) for p in CAPACITY_PHASES)
        badput["setup"] += attempt.phases.get("setup", 0.0)
        run_s = attempt.phases.get("run", 0.0)
        found = beats(runs / attempt.launch_id) if attempt.launch_id else None
        if found is None or attempt.launched is None:
            gone = attempt.cause == LAUNCHER_LOST and attempt.launched is not None
            if gone:
                badput["launcher gone"] += max(0.0, end - (attempt.launched or end))
            badput["start and restore"] += run_s
            continue
        (t0, s0), (t1, s1) = found
        badput["start and restore"] += max(0.0, t0 - attempt.launched)
        if attempt.cause == LAUNCHER_LOST:  # its run phase was never timed
            badput["launcher gone"] += max(0.0, end - t1)
        else:
            badput["after the last step"] += max(0.0, attempt.launched + run_s - t1)
        step_s = (t1 - t0) / (s1 - s0) if s1 > s0 else 0.0
        again = 0 if passed is None else max(0, min(s1, passed) - s0)
        badput["steps redone"] += again * step_s
        productive += (t1 - t0) - again * step_s
        redone += again
        steps += max(0, s1 - max(s0, s0 if passed is None else passed))
        passed = s1 if passed is None else max(passed, s1)
    if passed is None:
        return None
    wall = max(0.0, ended - record.started)
    badput["between attempts"] = max(0.0, wall - accounted)
    badput["other"] = max(0.0, wall - productive - sum(badput.values()))
    return Goodput(wall, productive, badput, steps, redone)
