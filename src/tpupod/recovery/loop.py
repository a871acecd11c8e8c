"""The attempts of one run with ``--retries``: launch, watch, classify, recover, again.

Every attempt gets ``TPUPOD_RUN_ID`` (the same for all), ``TPUPOD_ATTEMPT`` (1, 2, ...)
and, after the first, ``TPUPOD_RESUMED=1``. During an attempt on a cloud TPU the
API's state is read every few seconds; once it says the TPU was preempted, every
worker's program gets SIGTERM (a JAX program saves at its preemption sync point),
then after the notice grace KILL. After an attempt, ``confirm`` decides why it
ended; a preemption deletes and recreates the TPU (``replace``), a lost worker of a
pod that cannot be recreated is only rerun. The state is kept in the run directory
(``record``) at every phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tpupod import settings
from tpupod.base.files import FULL_DISK, no_room
from tpupod.errors import GcpError, PreflightError, TpupodError, UsageError
from tpupod.fanout.context import Interrupt, NoticeHandler
from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
from tpupod.fanout.worker import LineHandler
from tpupod.ops.free_tpu import free_tpu
from tpupod.pod.record import Pod, Worker
from tpupod.pod.spec import GcpPodSpec
from tpupod.pod.state import StateDir
from tpupod.providers import GONE, provider_for
from tpupod.recovery import confirm, elastic
from tpupod.recovery.elastic import Regrowth
from tpupod.recovery.goodput import account
from tpupod.recovery.leftovers import stop_leftovers
from tpupod.recovery.policy import Cause, Counters, RetryPolicy, counted
from tpupod.recovery.record import RecoveryRecord
from tpupod.recovery.replace import lost_slices, recreate, rerun_setup, timed

# (pod, the attempt's extra environment, its interrupt, told the launch id once it exists,
# the workers it runs on: a selection, None for all) -> (launch id, result)
Launcher = Callable[
    [Pod, dict[str, str], Interrupt, Callable[[str], None], str | None],
    Awaitable[tuple[str, FanoutResult]],
]


# Signals a worker's program gets from outside (the OOM killer, an operator, a host going
# down): a worker killed by one, without a word of its own, was lost. Crashes (SEGV, ABRT,
# ...) are the program's own errors.
LOST_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP})
UNREACHABLE_EXIT = 255  # as ssh, and every tpupod command, for a worker that cannot be reached
ROOM_POLL_S = 1.0  # how often a recovery waiting for a full disk looks again


@dataclass
class Ending:
    cause: Cause
    exit_code: int
    detail: str = ""
    silent: tuple[int, ...] = ()  # workers still silent at the end of the probe budget
    error: TpupodError | None = None  # what ended a FATAL attempt (the run ends with it)


class Recovery:
    """One run's attempts; ``run()`` returns the run's exit code."""

    def __init__(
        self,
        record: RecoveryRecord,
        state: StateDir,
        policy: RetryPolicy,
        launch: Launcher,
        *,
        notice: NoticeHandler,
        interrupt: Interrupt,
        setup_script: Path | None = None,
        sync_repo: Path | None = None,
        on_line: LineHandler | None = None,
    ) -> None:
        self.record, self.state, self.policy = record, state, policy
        self.on_line = on_line  # the setup script's output
        self.launch, self.notice, self.interrupt = launch, notice, interrupt
        self.setup_script, self.sync_repo = setup_script, sync_repo
        self.counters = Counters(**record.counters)
        self.pod = state.load(record.pod)
        self.cloud = isinstance(self.pod.spec, GcpPodSpec)
        # --elastic: the slices being made again while attempts run on the others
        self.regrowth = Regrowth(self, self._slice_back) if policy.elastic else None
        self.in_use: list[int] | None = None  # the slices the attempt runs on (None: all)
        self._inner: Interrupt | None = None  # the running attempt's interrupt
        self._growing: list[int] = []  # slices back during the attempt: it ends to grow

    async def run(self, *, resumed: bool = False) -> int:
        self.record.hold(self.state)  # one recovery of a pod at a time
        try:
            with self.record.using(self.state):  # 'tpupod down' refuses it, in every phase
                return await self._attempts(resumed)
        finally:
            if self.regrowth is not None and self.regrowth.missing:
                await self._delete_regrowing()
            self.state.release(self.record.pod)

    async def _delete_regrowing(self) -> None:
        """The run ends (done, cancelled, failed) while slices are being made again: they
        are deleted, as a stopped recovery deletes what it was making (a slice made after
        the run's end, its hosts unknown to the pod's record, left a pod that only down and
        up mended), and ``up --recreate`` makes them again."""
        from tpupod.providers.gcp import GcpProvider  # separate TPU slices only: the gcp extra

        assert self.regrowth is not None and isinstance(self.pod.spec, GcpPodSpec)
        left = self.regrowth.missing
        await self.regrowth.stop()
        names = ", ".join(self.pod.spec.tpus()[k].name for k in left)
        self.notice(f"the run ended: deleting {names}, which the run was making again")
        try:
            await GcpProvider().delete_slices(self.pod, left)
        except TpupodError as exc:
            self.notice(f"could not delete {names}: {exc}")
        self.notice(f"'tpupod up --name {self.pod.name} --recreate' makes it again")

    async def _attempts(self, resumed: bool) -> int:
        # Resumed: a recovery the dead launcher left half-done starts over. A TPU that was
        # preempted, or is gone, is replaced before the first launch.
        unfinished = self.record.phase in ("delete", "create", "setup")
        if resumed and self.record.attempts and self.record.current.cause is None:
            self.record.current.cause = Cause.LAUNCHER_LOST.value
            self.record.current.ended = time.time()
        shrunk = resumed and await self._shrink(resumed=True)
        recreate_next = (
            self.cloud
            and not shrunk
            and ((resumed and unfinished) or await self._needs_new_tpu(resumed))
        )
        while True:
            silent = await self._stop_leftovers(waits=not recreate_next)
            attempt = self.record.begin_attempt()
            if not silent and not await self._enough_slices(attempt.phases):
                attempt.cause, attempt.ended = Cause.INTERRUPTED.value, time.time()
                return await self._finish(Ending(Cause.INTERRUPTED, 130, self._stopped_by()))
            attempt.slices = self.in_use
            ending = silent or await self._attempt(recreate_next, resumed=attempt.attempt > 1)
            attempt.cause, attempt.exit_code, attempt.detail = (
                ending.cause.value,
                ending.exit_code,
                ending.detail,
            )
            attempt.ended = time.time()
            self.notice(
                f"run {self.record.run_id}, attempt {attempt.attempt}: {ending.cause}"
                + (f" ({ending.detail})" if ending.detail else "")
            )
            if ending.cause is Cause.GROW or self._falls_back(ending):
                self.record.state = "recovering"
                self._save()
                recreate_next = False
                continue  # no rerun counted: the run grows, or waits for every slice
            # Never again on a host known to be silent: the launch would only wait for it.
            again = (
                ending.cause not in (Cause.OK, Cause.INTERRUPTED)
                and not ending.silent
                and self.counters.allow(ending.cause, self.policy)
            )
            self.record.counters = vars(self.counters).copy()
            if not again:
                return await self._finish(ending)
            if not await self._room_for(attempt.attempt + 1):
                stopped = f"{self._stopped_by()} while waiting for space"
                return await self._finish(Ending(Cause.INTERRUPTED, 130, stopped))
            self.record.state = "recovering"
            self._save()
            recreate_next = ending.cause is Cause.PREEMPTED and self.cloud
            if recreate_next and await self._shrink():
                recreate_next = False
            if not recreate_next:
                await self._free_accelerator()

    async def _stop_leftovers(self, *, waits: bool = True) -> Ending | None:
        """Before each attempt after the first (and a resumed run's): what the earlier
        attempts left running on the workers is killed (see recovery/leftovers.py). A
        worker that does not answer is named at once and probed within the budget (the
        attempt would otherwise start beside what was left there, if its host came back in
        between); still silent at the end: the attempt's ending, lost and not rerun. Not
        where the hosts are made again (``waits`` False: a preempted TPU's are gone)."""
        attempts = {a.launch_id: a.attempt for a in self.record.attempts if a.launch_id}
        stopped = await stop_leftovers(
            self.pod, list(attempts), self._workers_in_use(), self.notice
        )
        for label, launches in stopped.found.items():
            for launch_id, count in launches.items():
                self.notice(
                    f"stopped {count} process(es) attempt {attempts[launch_id]} left on {label}"
                )
        if not waits or not (stopped.silent or stopped.failed):
            return None
        numbers = sorted(attempts.values())
        earlier = str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"
        what = f"what attempt{'s' if len(numbers) > 1 else ''} {earlier} left"
        for worker, why in stopped.silent.items():
            self.notice(
                f"{worker} did not answer the stop of {what} there ({why}): "
                "waiting for it before the next attempt"
            )
        if stopped.failed:
            self.notice(f"could not stop {what}: {stopped.failed}")
        who = ", ".join(w.split(" ")[0] for w in stopped.silent) or "a worker"
        ending = await self._silent(who, f" when stopping {what}")
        if ending.silent:
            return ending
        return await self._stop_leftovers()

    def _workers_in_use(self) -> list[Worker] | None:
        """The workers of the slices attempts run on now (None: every worker)."""
        if self.in_use is None:
            return None
        return [w for w in self.pod.workers if w.slice in self.in_use]

    async def _shrink(self, *, resumed: bool = False) -> bool:
        """--elastic, a slice preempted (or, resumed, being made again when the launcher
        died): make the lost slices again in the background and go on with the others.
        False: not elastic, or every slice is lost (made again whole, as without it)."""
        regrowth = self.regrowth
        if regrowth is None or not self.cloud:
            return False
        lost = set(await lost_slices(self.pod, self.policy, self.notice))
        if resumed:
            lost |= {int(k) for k in regrowth.kept["regrowing"]}
        new = sorted(lost - set(regrowth.missing))
        lost |= set(regrowth.missing)
        if not lost or (not new and not resumed) or len(lost) >= self.pod.slices:
            await regrowth.stop()  # the pod is made again whole, as without --elastic
            regrowth.kept["regrowing"].clear()
            self.in_use = None
            return False
        regrowth.start(sorted(lost))
        self.in_use = [k for k in range(self.pod.slices) if k not in lost]
        there, gone = len(self.in_use), ", ".join(map(str, sorted(lost)))
        if there >= self.policy.min_slices:
            regrowth.event(
                f"slice {gone} being made again: going on with {there} of "
                f"{self.pod.slices} slices from the newest checkpoint"
            )
        else:  # the wait says so (_enough_slices)
            regrowth.event(f"slice {gone} being made again")
        return True

    async def _enough_slices(self, phases: dict[str, float]) -> bool:
        """Before an attempt of an elastic run: the slices it runs on (waiting while fewer
        than --min-slices are there: the attempt's ``wait``, capacity in its goodput).
        False: interrupted while waiting."""
        regrowth = self.regrowth
        if regrowth is None:
            return True
        enough = True
        if regrowth.tasks:
            waiting = regrowth.enough(self.policy.min_slices, self.interrupt.requested)
            enough = await timed(phases, "wait", waiting)
        self.in_use = regrowth.in_use()
        if self.in_use is None:
            regrowth.need_all = False
        return enough

    def _falls_back(self, ending: Ending) -> bool:
        """An attempt on fewer slices that failed as the program's error (it may not
        restore into a smaller mesh): not counted; the run waits for every slice."""
        if self.regrowth is None or self.in_use is None or ending.cause is not Cause.ERROR:
            return False
        self.regrowth.need_all = True
        self.regrowth.event(
            f"the program failed on {len(self.in_use)} of {self.pod.slices} slices "
            f"({ending.detail}): it may not restore into fewer slices; waiting for every slice"
        )
        return True

    def _slice_back(self, slice_id: int) -> None:
        """A slice made again is ready: an attempt running without it ends at a checkpoint
        (the notice: SIGTERM, then KILL after the grace), and the next runs with it."""
        inner, regrowth = self._inner, self.regrowth
        if inner is None or regrowth is None or self.in_use is None:
            return
        self._growing.append(slice_id)
        there = self.pod.slices - len(regrowth.missing)
        regrowth.event(f"growing to {there} of {self.pod.slices} slices at a checkpoint")
        inner.request(
            signal.SIGTERM,
            grace=self.policy.notice_grace,
            reason=f"slice {slice_id} is back: growing to {there} slices",
        )

    def _save(self) -> None:
        """The record to its file; on a full disk it is said and left for the next save
        (each writes the whole record): the run goes on to ``_room_for``, which waits for
        space before the next attempt, where a save that raised ended the run."""
        try:
            self.record.save()
        except OSError as exc:
            if exc.errno not in FULL_DISK:
                raise
            self.notice(
                f"run {self.record.run_id}: cannot write {self.record.path} ({exc.strerror}); "
                "it is written again once there is room"
            )

    async def _room_for(self, attempt: int) -> bool:
        """Wait while the state directory's disk is full (the run's records and the next
        launch's logs live there): a disk that filled for a while ended the whole run when
        it should only delay the next attempt. False: interrupted while waiting."""
        folder = self.record.path.parent
        full = no_room(folder)
        if full is None:
            return True
        self.notice(
            f"run {self.record.run_id}: the disk of {folder} is full ({full.strerror}): "
            f"waiting for space to start attempt {attempt} (Ctrl-C stops the run)"
        )
        started = time.monotonic()
        while (full := no_room(folder)) is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.interrupt.requested.wait(), ROOM_POLL_S)
            if self.interrupt.requested.is_set():
                return False
        self.notice(
            f"run {self.record.run_id}: space again after {time.monotonic() - started:.0f} s"
        )
        return True

    async def _attempt(self, recreate_first: bool, *, resumed: bool) -> Ending:
        phases = self.record.current.phases
        try:
            if recreate_first:
                slices = await self._slices_to_replace()
                self.pod = await self._interruptible(
                    recreate(
                        self.pod,
                        self.state,
                        self.policy,
                        phases,
                        notice=self.notice,
                        on_phase=self._phase,
                        slices=slices,
                    )
                )
                self._made(slices)
            if self.setup_script is not None and (recreate_first or not resumed):
                self._phase("setup")
                setup = rerun_setup(self.pod, self.setup_script, phases, self.on_line)
                await self._interruptible(setup)
            self._check_code()
            self.record.options["replacing"] = []  # what a recovery stopped now would delete
            self._phase("run")
            return await self._launch(phases, resumed)
        except _Interrupted:
            await self._delete_what_we_made()
            return Ending(Cause.INTERRUPTED, 130, f"{self._stopped_by()} during recovery")
        except UsageError:
            raise
        except TpupodError as exc:
            if exc.lasting and not self.interrupt.requested.is_set():
                where = f"during {self.record.phase}: {exc}"
                return Ending(Cause.FATAL, exc.exit_code or 1, where, error=exc)
            return await self._classify_error(exc)

    async def _slices_to_replace(self) -> list[int]:
        """The slices to make again (empty: the whole pod): those a recovery the dead
        launcher left half-done was replacing, else those the API says are lost."""
        replacing = self.record.options.get("replacing")
        if self.record.phase in ("delete", "create", "setup") and replacing:
            return list(replacing)
        slices = await lost_slices(self.pod, self.policy, self.notice)
        if slices:
            kept = [k for k in range(self.pod.slices) if k not in slices]
            self.notice(
                f"replacing slice {', '.join(map(str, slices))} alone; "
                f"slice {', '.join(map(str, kept))} stay{'s' if len(kept) == 1 else ''} up"
            )
        self.record.options["replacing"] = slices
        self._save()
        return slices

    def _made(self, slices: list[int]) -> None:
        """Remember what the recovery made (the whole pod, or some of its slices): what a
        run that ends preempted deletes."""
        if slices:
            made = set(self.record.options.get("made_slices", [])) | set(slices)
            self.record.options["made_slices"] = sorted(made)
        else:
            self.record.options["created"] = True

    async def _launch(self, phases: dict[str, float], resumed: bool) -> Ending:
        attempt = self.record.current
        env = {
            "TPUPOD_RUN_ID": self.record.run_id,
            "TPUPOD_ATTEMPT": str(attempt.attempt),
            **({"TPUPOD_RESUMED": "1"} if resumed else {}),
        }
        if self.regrowth is not None:
            env["TPUPOD_ELASTIC"] = "1"
        inner = Interrupt()
        inner.who = self.record.cancelled_by  # the attempt's summary names who cancelled it
        self._inner, self._growing = inner, []
        preempted: list[str] = []

        def on_preempted(state: str, of: str) -> None:
            preempted.append(f"{of} was {state}")
            what = f"TPU {self.pod.name!r}" if of == "the TPU" else of
            self.notice(f"{what} is {state}: preempted")
            inner.request(
                signal.SIGTERM,
                grace=self.policy.notice_grace,
                reason=f"preemption notice ({state})",
            )

        stopped = asyncio.Event()
        tasks = [asyncio.create_task(self._forward(inner, stopped))]
        if self.cloud:
            interval = settings.recovery_watch_s()
            watch = confirm.watch(self.pod, interval, on_preempted, stopped, self.in_use)
            tasks.append(asyncio.create_task(watch))

        def began(launch_id: str) -> None:  # 'tpupod status' names it while it runs
            attempt.launch_id = launch_id
            self._save()

        attempt.launched = time.time()
        on = None if self.in_use is None else elastic.selection(self.in_use)
        try:
            launch = self.launch(self.pod, env, inner, began, on)
            launch_id, result = await timed(phases, "run", launch)
        finally:
            self._inner = None
            stopped.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        attempt.launch_id = launch_id
        self._save()
        return await self._classify(result, preempted)

    async def _forward(self, inner: Interrupt, stopped: asyncio.Event) -> None:
        """Our own interrupts (Ctrl-C, cancel) reach the attempt's fan-out."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self.interrupt.requested, stopped)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self.interrupt.requested.is_set() and not stopped.is_set():
            cancelled = self.record.cancel_file.exists()
            reason = self._stopped_by() if cancelled else None  # else the signal's own words
            inner.request(self.interrupt.signal or signal.SIGINT, reason=reason)
            force = [asyncio.ensure_future(e.wait()) for e in (self.interrupt.forced, stopped)]
            await asyncio.wait(force, return_when=asyncio.FIRST_COMPLETED)
            if self.interrupt.forced.is_set():
                inner.request()
            for waiting in force:
                waiting.cancel()
        for waiting in waits:
            waiting.cancel()

    def _stopped_by(self) -> str:
        """Who stopped the run: 'tpupod cancel' or 'tpupod down --force' (they leave a file
        first), or our signal."""
        by = self.record.cancelled_by()
        if by is not None:
            return f"cancelled by {by}"
        if self.interrupt.signal == signal.SIGTERM:
            return "terminated (SIGTERM)"
        return "interrupted (Ctrl-C)"

    async def _classify(self, result: FanoutResult, preempted: list[str]) -> Ending:
        code = result.exit_code()
        if self.interrupt.requested.is_set():
            return Ending(Cause.INTERRUPTED, code, self._stopped_by())
        if preempted:
            return Ending(Cause.PREEMPTED, code or 1, preempted[0])
        if self._growing:
            back = ", ".join(map(str, self._growing))
            return Ending(Cause.GROW, code, f"slice {back} came back")
        if self.cloud and not result.ok:
            told = await self._metadata_says()
            if told:
                return Ending(Cause.PREEMPTED, code, f"instance/preempted is TRUE on {told}")
        if self.cloud:
            # Even a run that ended well may have ended because its program saved and left.
            budget = self.policy if not result.ok else _one_try(self.policy)
            state = await confirm.api_state(self.pod, budget, self.notice, self.in_use)
            if state in confirm.REPLACE_STATES:
                of = await confirm.preempted_of(self.pod, state, self.in_use)
                return Ending(Cause.PREEMPTED, code or 1, f"{of} is {state}")
        if result.hung is not None:
            return Ending(Cause.HUNG, result.exit_code(), result.hung.removeprefix("hung: "))
        if result.ok:
            return Ending(Cause.OK, 0)
        first = result.first_failure
        if first is not None and first.outcome is Outcome.UNREACHABLE:
            return await self._silent(first.worker.label)
        return ended_by(result, self.policy)

    async def _silent(self, who: str, when: str = "") -> Ending:
        """A worker stopped answering: probe the pod within the budget. Lost either way; if
        some worker is still silent at the end, it is not rerun (``Ending.silent``)."""
        connector = provider_for(self.pod.provider).connect(self.pod, self.state)
        try:
            silent = await confirm.wait_reachable(
                self.pod, connector, self.policy, self.notice, self._workers_in_use()
            )
        finally:
            await connector.close()
        lost = f"{who} stopped answering{when}"
        if not silent:
            return Ending(Cause.LOST, UNREACHABLE_EXIT, f"{lost}, then came back")
        names = ", ".join(self.pod.workers[w].label for w in silent)
        return Ending(
            Cause.LOST,
            UNREACHABLE_EXIT,
            f"{lost}; {names} still silent after {self.policy.probe_s:g}s",
            silent=tuple(silent),
        )

    async def _free_accelerator(self) -> None:
        """Before a rerun on the same hosts: what still holds the accelerator is killed and
        a stale libtpu lockfile removed (a killed holder leaves one, and the next launch's
        preflight would refuse the host). Only on the slices in use (an elastic run's lost
        slice has no hosts to answer). Not on a local pod: its workers share this machine's
        /tmp."""
        if self.pod.provider == "local":
            return
        try:
            result = await free_tpu(self.pod, workers=self._workers_in_use())
        except TpupodError as exc:
            self.notice(f"could not free the accelerator before the rerun: {exc}")
            return
        silent = [r.worker.label for r in result.workers if r.outcome is Outcome.UNREACHABLE]
        held = [r.worker.label for r in result.workers if not r.ok and r.worker.label not in silent]
        if silent:
            self.notice(f"could not free the accelerator on {', '.join(silent)}: no answer")
        if held:
            self.notice(
                f"the accelerator is still held on {', '.join(held)}; the launch will say by whom"
            )

    async def _metadata_says(self) -> str:
        """The workers whose metadata says preempted ("w0, w1"), or ""."""
        connector = provider_for(self.pod.provider).connect(self.pod, self.state)
        try:
            told = await confirm.metadata_preempted(self.pod, connector, self._workers_in_use())
        finally:
            await connector.close()
        return ", ".join(f"w{w}" for w in told)

    async def _classify_error(self, exc: TpupodError) -> Ending:
        """A phase failed (setup, sync, preflight, create): preempted, a lost worker, or an
        error of its own (not rerun without --retry-errors)."""
        if self.interrupt.requested.is_set():
            return Ending(Cause.INTERRUPTED, 130, self._stopped_by())
        where = f"during {self.record.phase}: {exc}"
        if self.cloud:
            state = await confirm.api_state(self.pod, self.policy, self.notice)
            if state in confirm.REPLACE_STATES:
                return Ending(Cause.PREEMPTED, 1, f"during {self.record.phase}: TPU {state}")
        if isinstance(exc, PreflightError) and exc.unreachable:
            # lost, as a worker that stops answering mid-run is, even where it answers again
            # by now (a link down for a while): not the program's error
            return await self._silent(", ".join(exc.unreachable), f" {where}")
        connector = provider_for(self.pod.provider).connect(self.pod, self.state)
        try:
            silent = await confirm.reachable(self.pod, connector, workers=self._workers_in_use())
        finally:
            await connector.close()
        if silent:
            names = ", ".join(self.pod.workers[w].label for w in silent)
            return await self._silent(names, f" {where}")
        return Ending(Cause.ERROR, exc.exit_code or 1, where)

    async def _needs_new_tpu(self, resumed: bool) -> bool:
        """Is the TPU preempted or gone (so the first attempt makes it first)? A resumed run
        that gets no answer takes it for preempted: its launcher died mid-way."""
        state = await confirm.api_state(self.pod, self.policy, self.notice)
        if state == GONE:
            self.notice(f"TPU {self.pod.name!r} is gone: creating it again before the run")
        return state in confirm.REPLACE_STATES or (resumed and state is None)

    def _phase(self, name: str) -> None:
        self.record.phase = name
        self.record.state = "running" if name == "run" else "recovering"
        self._save()

    def _check_code(self) -> None:
        """Every attempt runs the commit the first one ran (refuse different code)."""
        if self.sync_repo is None:
            return
        commit = head_commit(self.sync_repo)
        if self.record.commit is None:
            self.record.commit = commit
            self._save()
        elif commit != self.record.commit:
            raise UsageError(
                f"the code changed since the run began ({self.record.commit[:12]} -> "
                f"{commit[:12]}): refusing to resume on different code",
                hint=f"check out {self.record.commit[:12]} to resume, or start a new run",
            )

    async def _interruptible(self, work: Awaitable[Pod | None]) -> Pod:
        """``work``, unless we are interrupted first (then _Interrupted)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.interrupt.requested.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _Interrupted
        return task.result() or self.pod

    async def _delete_what_we_made(self) -> None:
        """Stopped while recovering: the TPU the recovery was creating goes."""
        deleted = await delete_unfinished(self.record, self.state)
        if deleted:
            self.notice(f"deleted {deleted!r}, which the recovery was making")

    async def _finish(self, ending: Ending) -> int:
        self.record.state = {Cause.OK: "done", Cause.INTERRUPTED: "cancelled"}.get(
            ending.cause, "failed"
        )
        code = ending.exit_code
        if ending.cause is not Cause.OK and code == 0:
            code = 1
        self.record.exit_code = code
        self.record.phase = ""
        goodput = account(self.record, time.time())
        self.record.goodput = goodput.to_json() if goodput is not None else None
        self._save()
        self.notice(f"{self.record.headline()}; {self.counters.describe()}")
        if goodput is not None:
            self.notice(f"run {self.record.run_id}: {goodput.describe()}")
        if ending.cause is Cause.PREEMPTED:
            await delete_what_recovery_made(self.record, self.pod, self.state, self.notice)
        if ending.error is not None:
            raise _ends_the_run(self.record.run_id, ending.error)
        if ending.silent:
            raise HostsSilent(self.record, ending, self.pod)
        if ending.cause in (Cause.PREEMPTED, Cause.LOST):
            raise RetriesSpent(self.record, ending, self.policy, cloud=self.cloud)
        if ending.cause is Cause.ERROR:
            self.notice(f"not rerun: {rerun_advice(self.record.run_id, ending, self.policy)}")
        if ending.cause is Cause.HUNG:
            spent = (
                f", --retry-hangs {self.policy.retry_hangs} spent"
                if self.policy.retry_hangs
                else ""
            )
            self.notice(
                f"not rerun: hung{spent} (--retry-hangs N reruns after hangs); 'tpupod run "
                f"--resume {self.record.run_id} --retry-hangs 1' reruns it from its checkpoint"
            )
        return code


async def delete_what_recovery_made(
    record: RecoveryRecord, pod: Pod, state: StateDir, notice: NoticeHandler
) -> None:
    """A run that ends preempted leaves no TPU its recovery made: the whole pod, or the
    slices it made again (the others were the user's, and stay)."""
    made = record.options.get("made_slices") or []
    if record.options.get("created"):
        notice(f"deleting {pod.name!r}: preempted, and the recovery made it")
        await provider_for(pod.provider).destroy(pod, state)
    elif made:
        from tpupod.providers.gcp import GcpProvider  # Cloud TPUs only: asyncssh, google

        which = ", ".join(map(str, made))
        notice(f"deleting slice {which} of {pod.name!r}: preempted, and the recovery made it")
        await GcpProvider().delete_slices(pod, made)


async def delete_unfinished(record: RecoveryRecord, state: StateDir) -> str | None:
    """Delete the TPU a recovery was making when it stopped (deleting the old one, creating
    or setting up the new; only the slices it was replacing, on a pod of separate slices);
    what it deleted, or None when there was none."""
    pod = state.load(record.pod)
    if not isinstance(pod.spec, GcpPodSpec) or record.phase not in ("delete", "create", "setup"):
        return None
    replacing = record.options.get("replacing") or []
    if replacing:
        from tpupod.providers.gcp import GcpProvider  # Cloud TPUs only: asyncssh, google

        await GcpProvider().delete_slices(pod, replacing)
        return f"{pod.name} slice {', '.join(map(str, replacing))}"
    await provider_for(pod.provider).destroy(pod, state)
    return pod.name


def _ends_the_run(run_id: str, error: TpupodError) -> TpupodError:
    """The error an attempt ended with that no rerun fixes: as a plain run says it; a cloud
    refusal (quota, permission: fixed outside the run) also says how to go on after."""
    if not isinstance(error, GcpError):
        return error
    resume = f"'tpupod run --resume {run_id}' goes on from its checkpoint"
    ended = GcpError(f"run {run_id}: {error.message}", hint=f"{error.hint}; then {resume}")
    ended.lasting = True
    return ended


class _Interrupted(Exception):
    """Ctrl-C or cancel during a recovery phase."""


class RetriesSpent(TpupodError):
    """Preempted or lost once more than ``--retries`` allows."""

    def __init__(
        self, record: RecoveryRecord, ending: Ending, policy: RetryPolicy, *, cloud: bool
    ) -> None:
        run = record.run_id
        if policy.retries:
            what = (
                f"run {run}: {ending.cause} again after "
                f"{counted(policy.retries, 'recovery', 'recoveries')} (--retries {policy.retries})"
            )
        else:
            what = f"run {run}: {ending.cause} ({ending.detail}); not rerun without --retries"
        elsewhere = ", or --zones to try elsewhere" if cloud else ""
        super().__init__(
            what,
            hint=f"'tpupod run --resume {run} --retries 1' goes on from its checkpoint"
            f"{elsewhere}; 'tpupod logs {run}' shows the attempts",
        )
        self.exit_code = ending.exit_code if ending.cause is Cause.LOST else 1


class HostsSilent(TpupodError):
    """A worker still silent at the end of the probe budget: no attempt waits on it."""

    exit_code = UNREACHABLE_EXIT

    def __init__(self, record: RecoveryRecord, ending: Ending, pod: Pod) -> None:
        run = record.run_id
        names = ", ".join(
            f"{pod.workers[w].label} ({pod.workers[w].hostname})" for w in ending.silent
        )
        back = {
            "gcp": "'tpupod status' shows the TPU and every worker",
            "ssh": "bring the host back ('tpupod status' checks every worker)",
        }.get(pod.provider, "'tpupod status' checks every worker")
        super().__init__(
            f"run {run}: {names} did not answer within the probe budget: not rerun on a "
            "silent host",
            hint=f"{back}, then 'tpupod run --resume {run}' goes on from its checkpoint",
        )


def rerun_advice(run_id: str, ending: Ending, policy: RetryPolicy) -> str:
    """How an attempt that ended by the program's own error would have been rerun, and how
    to rerun it now from its checkpoint."""
    listed = (
        f", --retry-exit-codes {ending.exit_code} this exit code"
        if 0 < ending.exit_code < 256
        else ""
    )
    spent = (
        f"a program error again, --retry-errors {policy.retry_errors} spent"
        if policy.retry_errors
        else "a program error"
    )
    return (
        f"{spent} (--retry-errors N reruns after the program's own failures{listed}); "
        f"'tpupod run --resume {run_id} --retry-errors 1' reruns it from its checkpoint"
    )


def ended_by(result: FanoutResult, policy: RetryPolicy) -> Ending:
    """Why a failed attempt on reachable workers ended. Lost when a worker was killed from
    outside: first, or after a peer's error its death caused (a collective fails on the
    others at once, and their report may reach the launcher before its exit does); a
    worker tpupod stopped, after another one failed, is not. Else a listed exit code, else
    the program's own error."""
    code = result.exit_code()
    order = {worker: i for i, worker in enumerate(result.failure_order)}
    killed = sorted(
        (r for r in result.workers if _killed_from_outside(r)),
        key=lambda r: order.get(r.worker.id, len(order)),
    )
    if killed:
        status = killed[0].status
        assert status is not None
        who = f"{killed[0].worker.label} ({killed[0].worker.hostname})"
        return Ending(Cause.LOST, code, f"{who} {status.describe()}")
    if code in policy.retry_exit_codes:
        return Ending(Cause.LISTED, code, f"exit code {code}")
    return Ending(Cause.ERROR, code, result.ending().why)


def _killed_from_outside(result: WorkerResult) -> bool:
    """A worker killed by a signal its program did not give itself (no word of its own):
    KILL, TERM or HUP (the OOM killer, an operator, a host going down)."""
    status = result.status
    return (
        result.outcome is Outcome.FAILED
        and result.error is None
        and status is not None
        and status.signal in LOST_SIGNALS
    )


def _one_try(policy: RetryPolicy) -> RetryPolicy:
    return replace(policy, probe_tries=1)


def head_commit(repo: Path) -> str:
    """The commit ``--sync`` ships from ``repo``; a UsageError when there is none."""
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise UsageError(
            f"--sync: {repo} is not in a git repository with a commit",
            hint="--sync ships this repository's HEAD to every worker: run tpupod from inside "
            "the repository",
        )
    return done.stdout.strip()
