"""``run --hang-timeout``: a run where no worker progresses for the timeout is hung.

Every second the watchdog looks at the run's ``Progress``: a straggler (a worker whose
heartbeat stood still half the timeout while another went past it) is named once; when
no worker has progressed for the whole timeout it takes every worker's stacks, prints
the digest (the odd workers first) and saves the dump in the run's folder, then stops
the run (TERM, then KILL after the grace), which ends as *hung* (exit 124), naming the
odd workers. ``run --retries`` counts a hang apart (``--retry-hangs``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tpupod.base.durations import format_seconds
from tpupod.errors import TpupodError, UsageError
from tpupod.hang.progress import Progress

CHECK_S = 1.0
MIN_TIMEOUT_S = 2.0  # a heartbeat comes at most once a second: less would find steady runs hung


def check_timeout(seconds: float, what: str) -> float:
    """``seconds`` as a hang timeout, or a UsageError naming ``what`` when it is too short."""
    if seconds < MIN_TIMEOUT_S:
        raise UsageError(
            f"{what}: {format_seconds(seconds)} is shorter than {format_seconds(MIN_TIMEOUT_S)}",
            hint="a heartbeat comes at most once a second: give the run a few, e.g. 30s or 10m",
        )
    return seconds


@dataclass(frozen=True)
class Stacks:
    """What the watchdog took when it fired: the digest, where the dump is, the odd ones."""

    digest: list[str]
    saved: Path | None
    odd: list[int]
    said: str = ""  # the odd ones in words: "not where the others are: w3"


class Watchdog:
    def __init__(
        self,
        progress: Progress,
        timeout: float,
        take: Callable[[], Awaitable[Stacks]],
        stop: Callable[[str], None],
        notice: Callable[[str], None],
    ) -> None:
        self.progress, self.timeout, self.take = progress, timeout, take
        self.stop, self.notice = stop, notice
        self.why: str | None = None  # set once it fired
        self.stacks: Stacks | None = None

    async def watch(self) -> None:
        """Until cancelled (the run ended), or until it fires once."""
        while True:
            await asyncio.sleep(min(CHECK_S, self.timeout / 10))
            for worker in self.progress.stragglers(self.timeout / 2):
                self.notice(
                    f"w{worker} is straggling: {self.progress.describe(worker)}, while "
                    f"another worker is at step {self._ahead()}"
                )
            if self.progress.stalled_for() >= self.timeout:
                await self._fire()
                return

    def _ahead(self) -> int:
        steps = [s.step for s in self.progress.workers.values() if s.step is not None]
        return max(steps) if steps else 0

    async def _fire(self) -> None:
        said = f"no worker progressed for {format_seconds(self.timeout)}"
        self.notice(f"hung: {said}; taking every worker's stacks")
        try:
            self.stacks = await self.take()
        except (TpupodError, OSError) as exc:
            self.notice(f"could not take the stacks: {exc}")
        odd = ""
        if self.stacks is not None:
            for line in self.stacks.digest:
                self.notice(f"  {line}")
            if self.stacks.saved is not None:
                self.notice(f"stacks saved in {self.stacks.saved}")
            if self.stacks.said:
                odd = f"; {self.stacks.said}"
        self.why = f"hung: {said}{odd}"
        self.stop(self.why)
