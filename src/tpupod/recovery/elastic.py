"""``run --retries K --elastic``: training goes on while a preempted slice comes back.

On a pod of separate TPU slices (``up --gcp --slices N``) a preempted slice stops the run
today as in xpk and SkyPilot: every slice waits, idle, while the lost one is provisioned
again (minutes to hours on a busy zone). With ``--elastic`` the recovery loop restarts
the program at once on the slices left, from the newest checkpoint (``TPUPOD_NUM_SLICES``,
the slice ids and ``MEGASCALE_*`` renumbered for them, ``TPUPOD_ELASTIC=1``), while each
lost slice is deleted and made again here, in the background, one task a slice (the same
zone: slices joined over DCN share one; the setup script run on its new hosts). When a
slice is back, the running attempt gets the usual notice (SIGTERM, then KILL after the
grace), so that Orbax saves at its preemption sync point, and the next attempt runs on
every slice that is there: the run grows back at that checkpoint.

Fewer slices left than ``--min-slices``: the run waits, saying so, until enough are back.
An attempt on fewer slices that fails as the program's error (it could not restore into
the smaller mesh, say) is not counted: the run waits for every slice and says why.

What the recovery record keeps (``options["slices_state"]``): the slices being made again
(a resumed launcher starts them again: a TPU already made is taken as it is) and the
events, each with its time: shrink, back, grow, waits. ``tpupod status`` shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tpupod.errors import TpupodError
from tpupod.fanout.context import NoticeHandler
from tpupod.fanout.worker import LineHandler
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.recovery.confirm import REPLACE_STATES
from tpupod.recovery.record import RecoveryRecord

RETRY_S = 30.0  # a slice whose making failed is tried again after this long
SETTLE_S = 5.0  # after a wait for slices: how long another may take to come back too


class Host(Protocol):
    """What the regrowth needs of the recovery that owns it (recovery/loop.py)."""

    pod: Pod
    state: StateDir
    record: RecoveryRecord
    notice: NoticeHandler
    setup_script: Path | None
    on_line: LineHandler | None

    def _save(self) -> None: ...


class Regrowth:
    """The slices an elastic run is making again, one task each; ``back`` is set each time
    one is ready (``on_back`` told which)."""

    def __init__(self, host: Host, on_back: Callable[[int], None]) -> None:
        self.host = host
        self.on_back = on_back
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.since: dict[int, float] = {}  # slice -> when its making began (wall time)
        self.back = asyncio.Event()
        self.need_all = False  # the program failed on fewer slices: wait for every one

    @property
    def kept(self) -> dict[str, Any]:
        """The record's part: ``regrowing`` (slice -> since) and ``events``."""
        found: dict[str, Any] = self.host.record.options.setdefault(
            "slices_state", {"regrowing": {}, "events": []}
        )
        return found

    def event(self, what: str) -> None:
        """An elastic event, told and kept with its time."""
        self.host.notice(what)
        self.kept["events"].append({"at": time.time(), "what": what})
        self.host._save()

    @property
    def missing(self) -> list[int]:
        """The slices being made again."""
        return sorted(self.tasks)

    def in_use(self) -> list[int] | None:
        """The slices an attempt may run on now (None: all of them)."""
        if not self.tasks:
            return None
        return [k for k in range(self.host.pod.slices) if k not in self.tasks]

    def start(self, slices: Sequence[int]) -> None:
        """Make ``slices`` again in the background (those already being made stay so)."""
        for k in slices:
            if k in self.tasks:
                continue
            self.since[k] = self.kept["regrowing"].get(str(k)) or time.time()
            self.kept["regrowing"][str(k)] = self.since[k]
            self.tasks[k] = asyncio.create_task(self._make(k))
        self.host._save()

    async def _make(self, k: int) -> None:
        """Delete slice ``k``'s TPU (unless it is being made or ready already: a resumed
        launcher's) and make it again, until it is ready; then its setup, and it is back."""
        from tpupod.providers.gcp import GcpProvider  # separate TPU slices only: the gcp extra

        provider = GcpProvider()
        host = self.host
        while True:
            try:
                states = await provider.slice_states(host.pod)
                if states[k] in REPLACE_STATES:
                    await provider.delete_slices(host.pod, [k])
                made = await provider.make_slices(host.pod, host.state, [k], made_ok=True)
                new = [w for w in made.workers if w.slice == k]
                kept = [w for w in host.pod.workers if w.slice != k]
                workers = tuple(sorted([*kept, *new], key=lambda w: w.id))
                host.pod = host.pod.model_copy(update={"workers": workers})
                host.state.save(host.pod)
                if host.setup_script is not None:
                    await self._setup(k)
                break
            except TpupodError as exc:
                host.notice(f"slice {k}: {exc}; trying again in {RETRY_S:.0f} s")
                await asyncio.sleep(RETRY_S)
            except Exception as exc:  # a task that died would be waited for, for ever
                host.notice(f"slice {k}: {type(exc).__name__}: {exc}; trying again")
                await asyncio.sleep(RETRY_S)
        took = time.time() - self.since[k]
        del self.tasks[k]
        self.kept["regrowing"].pop(str(k), None)
        made_before = set(host.record.options.get("made_slices", []))
        host.record.options["made_slices"] = sorted(made_before | {k})
        self.event(f"slice {k} is back after {took:.0f} s")
        self.back.set()
        self.on_back(k)

    async def _setup(self, k: int) -> None:
        from tpupod.recovery.replace import rerun_setup  # the setup path: ops, fan-out

        assert self.host.setup_script is not None
        pod = self.host.pod
        only = pod.subset([w for w in pod.workers if w.slice == k])
        await rerun_setup(only, self.host.setup_script, {}, self.host.on_line)

    async def enough(self, count: int, interrupted: asyncio.Event) -> bool:
        """Wait until ``count`` slices are there (every one after ``need_all``), saying so;
        False when interrupted first."""
        total = self.host.pod.slices
        wanted = total if self.need_all else count
        said = False
        while total - len(self.tasks) < wanted:
            if not said:
                there = total - len(self.tasks)
                why = (
                    "the program failed on fewer slices"
                    if self.need_all
                    else (f"--min-slices {count}")
                )
                self.event(
                    f"{there} of {total} slices there, {why}: waiting for slice "
                    f"{', '.join(map(str, self.missing))} to come back"
                )
                said = True
            self.back.clear()
            waits = [asyncio.ensure_future(e.wait()) for e in (self.back, interrupted)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for waiting in waits:
                waiting.cancel()
            if interrupted.is_set():
                return False
        if said:  # slices made together come back together: one launch on all of them
            await self._settle(interrupted)
        return not interrupted.is_set()

    async def _settle(self, interrupted: asyncio.Event) -> None:
        """After a wait: while others come back within SETTLE_S of each other, wait for
        them (a trial: two slices back in the same second made a launch on two, grown to
        three 0.6 s later)."""
        while self.tasks and not interrupted.is_set():
            self.back.clear()
            try:
                await asyncio.wait_for(self.back.wait(), SETTLE_S)
            except TimeoutError:
                return

    async def stop(self) -> None:
        """End every task: the run ended (what they were making stays in the record, for a
        resume), or the pod is made again whole."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()


def selection(slices: Sequence[int]) -> str:
    """A worker selection of these slices (``s0,s2``)."""
    return ",".join(f"s{k}" for k in slices)
