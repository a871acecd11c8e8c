"""How one attempt of a job runs: here (the local runner) or on every worker of a pod,
in the vocabulary of ``attempt.py``.

Deferred imports: ``tpupod run``'s launcher (the fan-out context and policy, ``launch.run``)
is imported by the pod executor when it runs an attempt: the local runner does without it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tpupod.errors import TpupodError
from tpupod.fanout.results import OnFail
from tpupod.fanout.results import Outcome as WorkerOutcome
from tpupod.jobs.attempt import GRACE_S, Executor, Hooks, Marks, Outcome, describe_exit
from tpupod.jobs.code import MARK, STARTED
from tpupod.jobs.models import Job, JobStatus
from tpupod.pod.state import StateDir
from tpupod.pod.users import Watch, using
from tpupod.transport.base import Stream, command_script
from tpupod.transport.lines import read_lines
from tpupod.transport.local import kill_process_group

if TYPE_CHECKING:
    from tpupod.fanout.context import Interrupt
    from tpupod.pod.record import Pod


def job_env(job: Job, attempt: int) -> dict[str, str]:
    env = {"TPUPOD_JOB_ID": str(job.id), "TPUPOD_JOB_ATTEMPT": str(attempt)}
    if job.code is not None:
        env["TPUPOD_JOB_CODE"] = base64.b64encode(job.code.encode()).decode()
    return env


def job_command(job: Job, python: str) -> str:
    """The bash command line every worker runs; it says when it started."""
    if job.code is not None:
        return f"{shlex.quote(python)} -m tpupod.jobs.code"
    assert job.command is not None
    return f"echo {shlex.quote(STARTED)}; {job.command}"


class LocalExecutor:
    """Runs the job on this machine: a command line (or, without a pool, a code job) in a
    process group of its own; a code job in a warm pool process when given a ``pool``."""

    starts_at_once = True  # the claim marks its jobs running: there is nothing to wait for

    def __init__(self, grace_s: float = GRACE_S, pool: Executor | None = None) -> None:
        self.grace_s = grace_s
        self.pool = pool

    async def execute(self, job: Job, attempt: int, hooks: Hooks, stop: asyncio.Event) -> Outcome:
        if job.code is not None and self.pool is not None:
            return await self.pool.execute(job, attempt, hooks, stop)
        marks = Marks(1, hooks)
        # Guarded as `tpupod run` guards its workers: if this runner dies (even by kill -9),
        # the guard sees its stdin close and ends the job's whole process group.
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash",
            "-c",
            command_script(job_command(job, sys.executable), guard=True),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **job_env(job, attempt)},
            start_new_session=True,
        )
        pump = asyncio.create_task(self._pump(proc, marks))
        stopped = asyncio.create_task(stop.wait())
        waited = asyncio.create_task(proc.wait())
        done, _ = await asyncio.wait(
            {waited, stopped}, timeout=job.timeout, return_when=asyncio.FIRST_COMPLETED
        )
        stopped.cancel()
        if waited not in done:
            await self._kill(proc)
            await pump
            if stop.is_set():
                return Outcome(JobStatus.CANCELLED, error="stopped")
            return Outcome(JobStatus.FAILED, error=f"timed out after {job.timeout:g} s")
        await kill_process_group(proc.pid, 0)  # what it left in the background
        await pump
        code = proc.returncode
        if code == 0:
            return Outcome(JobStatus.COMPLETED, result=marks.result)
        return Outcome(JobStatus.FAILED, error=f"{describe_exit(code)}: {marks.last}")

    async def _pump(self, proc: asyncio.subprocess.Process, marks: Marks) -> None:
        """The transports' line reader: any line length, a partial last line, a closed pipe."""
        assert proc.stdout is not None
        async for line in read_lines([(Stream.STDOUT, proc.stdout)]):
            marks.line(0, line.text)

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        await kill_process_group(proc.pid, self.grace_s)
        await proc.wait()


class PodExecutor:
    """Gang-runs the job on every worker of a pod through ``tpupod run`` (lockstep launch,
    supervision from outside JAX): any worker's failure ends the attempt and names it;
    a timeout or a stop ends every worker's process group (TERM, then KILL)."""

    def __init__(
        self,
        pod: Pod,
        *,
        worker_python: str = "python3",
        grace_s: float = GRACE_S,
        state: StateDir | None = None,
    ):
        self.pod, self.worker_python, self.grace_s = pod, worker_python, grace_s
        self.state = state  # where the pod's record is (default: $TPUPOD_HOME)
        self._watch: Watch | None = None

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """While a runner serves the pod: it is the pod's registered user (``tpupod down``
        refuses, or with --force asks it to let go) and watches that the pod is there."""
        state = self.state or StateDir()
        if not state.exists(self.pod.name):  # not a pod of this state directory
            yield
            return
        self._watch = Watch(state, self.pod.name)
        what = f"a job runner ('tpupod jobs worker --pod {self.pod.name}')"
        with using(state, self.pod.name, what):
            yield

    def gone(self) -> str | None:
        """Why the pod this runner serves is gone (taken down, made again), or None."""
        return self._watch.gone() if self._watch is not None else None

    async def execute(self, job: Job, attempt: int, hooks: Hooks, stop: asyncio.Event) -> Outcome:
        from tpupod.fanout.context import Context, Interrupt, Sinks
        from tpupod.fanout.execute import Policy
        from tpupod.launch.run import run

        marks = Marks(len(self.pod.workers), hooks)
        interrupt = Interrupt()
        watcher = asyncio.create_task(_relay_stop(stop, interrupt))
        try:
            sinks = Sinks(lambda worker, line: marks.line(worker.id, line.text), None, interrupt)
            async with Context(self.pod, sinks) as ctx:
                done = await run(
                    ctx,
                    job_command(job, self.worker_python),
                    env=job_env(job, attempt),
                    policy=Policy(OnFail.KILL, job.timeout, self.grace_s),
                    worker_python=self.worker_python,
                    shown=job.command if job.code is None else f"job {job.id}'s code",
                    unlogged=lambda text: text.startswith(MARK),
                )
        except TpupodError as exc:  # preflight: a worker not ready; nothing started
            return Outcome(JobStatus.FAILED, error=f"{exc.message} ({exc.hint})")
        finally:
            watcher.cancel()
        fanout = done.fanout
        if fanout.ok:
            return Outcome(JobStatus.COMPLETED, result=marks.result)
        if stop.is_set():
            return Outcome(JobStatus.CANCELLED, error="stopped")
        first = fanout.first_failure
        assert first is not None
        if first.outcome is WorkerOutcome.TIMED_OUT:
            return Outcome(JobStatus.FAILED, error=f"timed out after {job.timeout:g} s")
        return Outcome(JobStatus.FAILED, error=fanout.ending().why)


async def _relay_stop(stop: asyncio.Event, interrupt: Interrupt) -> None:
    await stop.wait()
    interrupt.request(signal.SIGTERM)
