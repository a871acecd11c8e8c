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
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tpupod import settings
from tpupod.errors import TpupodError, UsageError
from tpupod.fanout import Interrupt, NoticeHandler
from tpupod.ops.free_tpu import free_tpu
from tpupod.pod import Pod
from tpupod.providers import GONE, provider_for
from tpupod.recovery import confirm
from tpupod.recovery.policy import Cause, Counters, RetryPolicy
from tpupod.recovery.record import RecoveryRecord
from tpupod.recovery.replace import recreate, rerun_setup, timed
from tpupod.results import FanoutResult, Outcome
from tpupod.spec import GcpPodSpec
from tpupod.state import StateDir

# (pod, the attempt's extra environment, its interrupt) -> (launch id, result)
Launcher = Callable[[Pod, dict[str, str], Interrupt], Awaitable[tuple[str, FanoutResult]]]


@dataclass
class Ending:
    cause: Cause
    exit_code: int
    detail: str = ""


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
    ) -> None:
        self.record, self.state, self.policy = record, state, policy
        self.launch, self.notice, self.interrupt = launch, notice, interrupt
        self.setup_script, self.sync_repo = setup_script, sync_repo
        self.counters = Counters(**record.counters)
        self.pod = state.load(record.pod)
        self.cloud = isinstance(self.pod.spec, GcpPodSpec)

    async def run(self, *, resumed: bool = False) -> int:
        self.record.hold(self.state)  # one recovery of a pod at a time
        try:
            return await self._attempts(resumed)
        finally:
            self.state.release(self.record.pod)

    async def _attempts(self, resumed: bool) -> int:
        # Resumed: a recovery the dead launcher left half-done starts over. A TPU that was
        # preempted, or is gone, is replaced before the first launch.
        unfinished = self.record.phase in ("delete", "create", "setup")
        if resumed and self.record.attempts and self.record.current.cause is None:
            self.record.current.cause = Cause.LAUNCHER_LOST.value
            self.record.current.ended = time.time()
        recreate_next = self.cloud and (
            (resumed and unfinished) or await self._needs_new_tpu(resumed)
        )
        while True:
            attempt = self.record.begin_attempt()
            ending = await self._attempt(recreate_next, resumed=attempt.attempt > 1)
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
            again = ending.cause not in (Cause.OK, Cause.INTERRUPTED) and self.counters.allow(
                ending.cause, self.policy
            )
            self.record.counters = vars(self.counters).copy()
            if not again:
                return await self._finish(ending)
            self.record.state = "recovering"
            self.record.save()
            recreate_next = ending.cause is Cause.PREEMPTED and self.cloud
            if not recreate_next:
                await self._free_accelerator()

    async def _attempt(self, recreate_first: bool, *, resumed: bool) -> Ending:
        phases = self.record.current.phases
        try:
            if recreate_first:
                self.pod = await self._interruptible(
                    recreate(
                        self.pod,
                        self.state,
                        self.policy,
                        phases,
                        notice=self.notice,
                        on_phase=self._phase,
                    )
                )
                self.record.options["created"] = True
            if self.setup_script is not None and (recreate_first or not resumed):
                self._phase("setup")
                await self._interruptible(rerun_setup(self.pod, self.setup_script, phases))
            self._check_code()
            self._phase("run")
            return await self._launch(phases, resumed)
        except _Interrupted:
            await self._delete_what_we_made()
            return Ending(Cause.INTERRUPTED, 130, "stopped during recovery")
        except UsageError:
            raise
        except TpupodError as exc:
            return await self._classify_error(exc)

    async def _launch(self, phases: dict[str, float], resumed: bool) -> Ending:
        attempt = self.record.current
        env = {
            "TPUPOD_RUN_ID": self.record.run_id,
            "TPUPOD_ATTEMPT": str(attempt.attempt),
            **({"TPUPOD_RESUMED": "1"} if resumed else {}),
        }
        inner = Interrupt()
        preempted: list[str] = []

        def on_preempted(state: str) -> None:
            preempted.append(state)
            self.notice(f"TPU {self.pod.name!r} is {state}: preempted")
            inner.request(
                signal.SIGTERM,
                grace=self.policy.notice_grace,
                reason=f"preemption notice ({state})",
            )

        stopped = asyncio.Event()
        tasks = [asyncio.create_task(self._forward(inner, stopped))]
        if self.cloud:
            interval = settings.recovery_watch_s()
            tasks.append(
                asyncio.create_task(confirm.watch(self.pod, interval, on_preempted, stopped))
            )
        try:
            launch_id, result = await timed(phases, "run", self.launch(self.pod, env, inner))
        finally:
            stopped.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        attempt.launch_id = launch_id
        self.record.save()
        return await self._classify(result, preempted)

    async def _forward(self, inner: Interrupt, stopped: asyncio.Event) -> None:
        """Our own interrupts (Ctrl-C, cancel) reach the attempt's fan-out."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self.interrupt.requested, stopped)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self.interrupt.requested.is_set() and not stopped.is_set():
            inner.request(self.interrupt.signal or signal.SIGINT)
            force = [asyncio.ensure_future(e.wait()) for e in (self.interrupt.forced, stopped)]
            await asyncio.wait(force, return_when=asyncio.FIRST_COMPLETED)
            if self.interrupt.forced.is_set():
                inner.request()
            for waiting in force:
                waiting.cancel()
        for waiting in waits:
            waiting.cancel()

    async def _classify(self, result: FanoutResult, preempted: list[str]) -> Ending:
        code = result.exit_code()
        if self.interrupt.requested.is_set():
            return Ending(Cause.INTERRUPTED, code)
        if preempted:
            return Ending(Cause.PREEMPTED, code or 1, f"the TPU was {preempted[0]}")
        if self.cloud and not result.ok:
            told = await self._metadata_says()
            if told:
                return Ending(Cause.PREEMPTED, code, f"{told}' metadata: preempted")
        if self.cloud:
            # Even a run that ended well may have ended because its program saved and left.
            budget = self.policy if not result.ok else _one_try(self.policy)
            state = await confirm.api_state(self.pod, budget, self.notice)
            if state in confirm.REPLACE_STATES:
                return Ending(Cause.PREEMPTED, code or 1, f"the TPU is {state}")
        if result.ok:
            return Ending(Cause.OK, 0)
        connector = provider_for(self.pod.provider).connect(self.pod, self.state)
        try:
            # Lost only when a silent worker ended the attempt (a stopped worker slow to
            # answer its stop, after another one failed, is not).
            first = result.first_failure
            if first is not None and first.outcome is Outcome.UNREACHABLE:
                silent = await confirm.wait_reachable(self.pod, connector, self.policy, self.notice)
                still = f"; still silent: {', '.join(f'w{w}' for w in silent)}" if silent else ""
                return Ending(Cause.LOST, code, f"{first.worker.label} stopped answering{still}")
        finally:
            await connector.close()
        if code in self.policy.retry_exit_codes:
            return Ending(Cause.LISTED, code, f"exit code {code}")
        return Ending(Cause.ERROR, code)

    async def _free_accelerator(self) -> None:
        """Before a rerun on the same hosts: what still holds the accelerator is killed and
        a stale libtpu lockfile removed (a killed holder leaves one, and the next launch's
        preflight would refuse the host). Not on a local pod: its workers share this
        machine's /tmp."""
        if self.pod.provider == "local":
            return
        try:
            result = await free_tpu(self.pod)
        except TpupodError as exc:
            self.notice(f"could not free the accelerator before the rerun: {exc}")
            return
        if not result.ok:
            self.notice("the accelerator is still held on some worker; the launch will say which")

    async def _metadata_says(self) -> str:
        """The workers whose metadata says preempted ("w0, w1"), or ""."""
        connector = provider_for(self.pod.provider).connect(self.pod, self.state)
        try:
            told = await confirm.metadata_preempted(self.pod, connector)
        finally:
            await connector.close()
        return ", ".join(f"w{w}" for w in told)

    async def _classify_error(self, exc: TpupodError) -> Ending:
        """A phase failed (setup, sync, preflight, create): preempted, a lost worker, or an
        error of its own (not rerun without --retry-errors)."""
        if self.interrupt.requested.is_set():
            return Ending(Cause.INTERRUPTED, 130)
        where = f"during {self.record.phase}: {exc}"
        if self.cloud:
            state = await confirm.api_state(self.pod, self.policy, self.notice)
            if state in confirm.REPLACE_STATES:
                return Ending(Cause.PREEMPTED, 1, f"during {self.record.phase}: TPU {state}")
        connector = provider_for(self.pod.provider).connect(self.pod, self.state)
        try:
            silent = await confirm.reachable(self.pod, connector)
        finally:
            await connector.close()
        if silent:
            return Ending(Cause.LOST, 255, where)
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
        self.record.save()

    def _check_code(self) -> None:
        """Every attempt runs the commit the first one ran (refuse different code)."""
        if self.sync_repo is None:
            return
        commit = _head(self.sync_repo)
        if self.record.commit is None:
            self.record.commit = commit
            self.record.save()
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
        self.record.save()
        self.notice(f"{self.record.headline()}; {self.counters.describe()}")
        if ending.cause is Cause.PREEMPTED and self.record.options.get("created"):
            self.notice(f"deleting {self.pod.name!r}: preempted, and the recovery made it")
            await provider_for(self.pod.provider).destroy(self.pod, self.state)
        if ending.cause in (Cause.PREEMPTED, Cause.LOST):
            raise RetriesSpent(self.record, ending, self.policy)
        return code


async def delete_unfinished(record: RecoveryRecord, state: StateDir) -> str | None:
    """Delete the TPU a recovery was making when it stopped (deleting the old one, creating
    or setting up the new); its name, or None when there was none."""
    pod = state.load(record.pod)
    if not isinstance(pod.spec, GcpPodSpec) or record.phase not in ("delete", "create", "setup"):
        return None
    await provider_for(pod.provider).destroy(pod, state)
    return pod.name


class _Interrupted(Exception):
    """Ctrl-C or cancel during a recovery phase."""


class RetriesSpent(TpupodError):
    def __init__(self, record: RecoveryRecord, ending: Ending, policy: RetryPolicy) -> None:
        super().__init__(
            f"run {record.run_id}: {ending.cause} again after {policy.retries} "
            f"recover{'y' if policy.retries == 1 else 'ies'} (--retries {policy.retries})",
            hint=f"'tpupod logs {record.run_id}' shows the attempts; more --retries, or "
            "--zones to try elsewhere",
        )


def _one_try(policy: RetryPolicy) -> RetryPolicy:
    from dataclasses import replace

    return replace(policy, probe_tries=1)


def _head(repo: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise UsageError(f"{repo} is not a git repository", hint="--sync ships a repository's HEAD")
    return done.stdout.strip()
