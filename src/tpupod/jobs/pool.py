"""A local runner's warm pool of Python processes for code jobs (prefork, as celery's).

Each process (``python -m tpupod.jobs.pool_worker``) runs one code job at a time, sent
over its stdin; a job costs a JSON line and its output, not a fork and exec of bash and
Python. A job that crashes its process (``os._exit``, a segfault) or outlives its
timeout or a cancel has its process group stopped (TERM, then KILL after the grace);
the process is then dropped and a fresh one takes its place, so the pool keeps serving.

What a pool gives up (and ``--no-pool`` keeps): a fresh interpreter per job. Jobs in
one process share its modules and globals, so a job that changes process-wide state
(its working directory, environment variables, stdout and stderr are put back; a monkeypatched
module, a JAX backend, a thread it left running are not) affects the next ones there,
and a child process a job left in the background lives until its pool process ends.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from tpupod.jobs.attempt import GRACE_S, Hooks, Marks, Outcome, describe_exit
from tpupod.jobs.code import END, TAKEN
from tpupod.jobs.models import Job, JobStatus
from tpupod.transport.lines import split_lines
from tpupod.transport.local import kill_process_group


class PoolProcess:
    """One warm process and the job it is running (if any)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.marks: Marks | None = None
        self.ended: asyncio.Future[str | None] | None = None
        self.taken = False  # the running job was read by the process (its TAKEN line)
        self.alive = True
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        """Lines to the running job's marks; the end marker or the process's death ends it."""
        assert self.proc.stdout is not None
        async for text in split_lines(self.proc.stdout):
            self._line(text)
        code = await self.proc.wait()
        self.alive = False
        if self.ended is not None and not self.ended.done():
            if not self.taken:  # it died before it read the job: the job never ran
                self.ended.set_exception(_NotTaken(describe_exit(code)))
                return
            last = self.marks.last if self.marks is not None else "(no output)"
            self.ended.set_result(f"{describe_exit(code)}: {last}")

    def _line(self, text: str) -> None:
        if text == TAKEN:
            self.taken = True
        elif text.startswith(END):
            if self.ended is not None and not self.ended.done():
                self.ended.set_result(json.loads(text[len(END) :])["error"])
        elif self.marks is not None:
            self.marks.line(0, text)

    async def run(self, job: Job, attempt: int, hooks: Hooks, stop: asyncio.Event) -> str | None:
        """Send the job; returns None (completed), why it failed, or raises ``_Stopped``."""
        assert self.proc.stdin is not None and job.code is not None
        self.marks = Marks(1, hooks)
        self.ended = asyncio.get_running_loop().create_future()
        self.taken = False
        env = {"TPUPOD_JOB_ID": str(job.id), "TPUPOD_JOB_ATTEMPT": str(attempt)}
        try:
            self.proc.stdin.write(json.dumps({"code": job.code, "env": env}).encode() + b"\n")
            await self.proc.stdin.drain()
        except (OSError, ConnectionError) as exc:  # it is gone, and never read the job
            self.ended.cancel()
            raise _NotTaken(f"its stdin: {exc}") from exc
        stopped = asyncio.ensure_future(stop.wait())
        waits: set[asyncio.Future[Any]] = {self.ended, stopped}
        done, _ = await asyncio.wait(
            waits, timeout=job.timeout, return_when=asyncio.FIRST_COMPLETED
        )
        stopped.cancel()
        if self.ended not in done:
            raise _Stopped(by_request=stop.is_set())
        return self.ended.result()

    async def kill(self, grace_s: float) -> None:
        """TERM the process group, KILL it after ``grace_s``; the process is gone after."""
        self.alive = False
        await kill_process_group(self.proc.pid, grace_s)
        await self.proc.wait()
        await self.pump


class _Stopped(Exception):
    def __init__(self, *, by_request: bool) -> None:
        self.by_request = by_request


class _NotTaken(Exception):
    """The process ended before it read the job (it died idle, an instant before)."""


class Pool:
    """Up to ``size`` warm processes; ``execute`` is the executor's call for a code job."""

    def __init__(self, size: int, *, python: str = sys.executable, grace_s: float = GRACE_S):
        self.size, self.python, self.grace_s = size, python, grace_s
        self.idle: list[PoolProcess] = []
        self.busy: set[PoolProcess] = set()

    async def start(self) -> None:
        """Start every process now, so the first jobs find them warm."""
        missing = self.size - len(self.idle) - len(self.busy)
        self.idle += await asyncio.gather(*(self._spawn() for _ in range(missing)))

    async def _spawn(self) -> PoolProcess:
        proc = await asyncio.create_subprocess_exec(
            self.python,
            "-m",
            "tpupod.jobs.pool_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own group: a stop ends the job's children too
        )
        return PoolProcess(proc)

    async def execute(self, job: Job, attempt: int, hooks: Hooks, stop: asyncio.Event) -> Outcome:
        """Run the job in an idle process; one that turns out dead before it read the job
        hands it to a fresh process (once: a pool that cannot start one fails the job)."""
        for fresh in (False, True):
            process = await self._take(fresh)
            self.busy.add(process)
            try:
                error = await process.run(job, attempt, hooks, stop)
                break
            except _NotTaken as lost:
                await process.kill(self.grace_s)
                if fresh:
                    return Outcome(JobStatus.FAILED, error=f"its pool process ended: {lost}")
            except _Stopped as stopped:
                await process.kill(self.grace_s)
                if stopped.by_request:
                    return Outcome(JobStatus.CANCELLED, error="stopped")
                return Outcome(JobStatus.FAILED, error=f"timed out after {job.timeout:g} s")
            finally:
                self.busy.discard(process)
                if process.alive:
                    self.idle.append(process)
        if error is None:
            assert process.marks is not None
            return Outcome(JobStatus.COMPLETED, result=process.marks.result)
        return Outcome(JobStatus.FAILED, error=error)

    async def _take(self, fresh: bool) -> PoolProcess:
        """An idle process (dead ones dropped), or a new one."""
        while self.idle and not self.idle[-1].alive:
            await self.idle.pop().pump
        return self.idle.pop() if self.idle and not fresh else await self._spawn()

    async def close(self) -> None:
        """End every process: idle ones exit at EOF, busy ones kill their own group."""
        every = [*self.idle, *self.busy]
        self.idle, self.busy = [], set()
        for process in every:
            if process.proc.stdin is not None:
                process.proc.stdin.close()
        for process in every:
            try:
                await asyncio.wait_for(asyncio.shield(process.pump), self.grace_s)
            except TimeoutError:
                await process.kill(0)
