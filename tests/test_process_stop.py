"""Every stop of a local process group (transport/local.py's ``kill_process_group``) returns
only when no member is alive: a job's, a pool process's and a served model's. The program's
leader ends at once on TERM; one child takes 0.5 s to clean up, one ignores TERM. A stop
that waited for the leader alone returned while they lived (and then KILLed the cleaner
mid-way, or left the other to hold its port)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tpupod.base import procfs
from tpupod.jobs.attempt import Hooks
from tpupod.jobs.execute import LocalExecutor
from tpupod.jobs.models import JobRequest, JobStatus
from tpupod.jobs.pool import Pool
from tpupod.jobs.store import Store
from tpupod.serve.agent.supervisor import ManagedServer
from tpupod.serve.backends import Backend, ServerSpec
from tpupod.serve.services import unstamped
from tpupod.transport.local import group_has_live_members

pytestmark = [pytest.mark.local, pytest.mark.timeout(60)]

PROGRAM = Path(__file__).parent / "programs" / "slow_to_stop.py"
GRACE_S = 2.0


class Started:
    """The program's lines: its children's pids and its process group, once it is ready."""

    def __init__(self) -> None:
        self.children: list[int] = []
        self.group = 0
        self.ready = asyncio.Event()

    def line(self, text: str) -> None:
        words = text.split()
        if words[:1] == ["children"]:
            self.children = [int(w) for w in words[1:]]
        elif words[:1] == ["ready"]:
            self.group = int(words[1])
            self.ready.set()


def _all_gone(started: Started, mark: Path) -> None:
    assert mark.read_text() == "cleaned up\n"  # the cleaner had its time, within the grace
    assert len(started.children) == 2
    assert not any(procfs.alive(pid) for pid in started.children)
    assert not group_has_live_members(started.group)


async def _stop_a_job(executor: LocalExecutor, store: Store, request: JobRequest) -> Started:
    job = store.get(store.submit(request))
    started, stop = Started(), asyncio.Event()

    async def cancel_when_ready() -> None:
        await started.ready.wait()
        stop.set()

    hooks = Hooks(on_line=lambda _, text: started.line(text), on_started=lambda: None)
    canceller = asyncio.create_task(cancel_when_ready())
    outcome = await executor.execute(job, 1, hooks, stop)
    await canceller
    assert outcome.status is JobStatus.CANCELLED, outcome
    return started


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(f"sqlite:///{tmp_path / 'jobs.db'}")


def test_a_cancelled_command_job_returns_when_its_whole_group_is_gone(
    store: Store, tmp_path: Path
) -> None:
    mark = tmp_path / "mark"
    request = JobRequest(command=f"{sys.executable} {PROGRAM} {mark}")
    started = asyncio.run(_stop_a_job(LocalExecutor(grace_s=GRACE_S), store, request))
    _all_gone(started, mark)


def test_a_cancelled_pool_job_returns_when_its_whole_group_is_gone(
    store: Store, tmp_path: Path
) -> None:
    mark = tmp_path / "mark"
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(PROGRAM)!r}, {str(mark)!r}]\n"
        f"runpy.run_path({str(PROGRAM)!r}, run_name='__main__')\n"
    )

    async def main() -> Started:
        pool = Pool(1)
        await pool.start()
        try:
            executor = LocalExecutor(grace_s=GRACE_S, pool=pool)
            return await _stop_a_job(executor, store, JobRequest(code=code))
        finally:
            await pool.close()

    started = asyncio.run(main())
    _all_gone(started, mark)


def test_a_stopped_server_returns_when_its_whole_group_is_gone(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    spec = ServerSpec(
        name="s0",
        backend=Backend.COMMAND,
        host="127.0.0.1",
        ports=(1,),
        model="m",
        command=f"{sys.executable} {PROGRAM} {mark}",
    )
    server = ManagedServer(spec, tmp_path / "logs", {"PATH": "/usr/bin:/bin"})

    async def main() -> None:
        server.start()
        log = server.log_path
        for _ in range(600):  # the program's 'ready' line in the server's log
            if log.exists() and "Z ready " in log.read_text():
                break
            await asyncio.sleep(0.05)
        await server.stop(GRACE_S)

    asyncio.run(main())
    started = Started()
    for line in server.log_path.read_text().splitlines():
        started.line(unstamped(line))
    _all_gone(started, mark)


def _server_whose_poll_unwinds_slowly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unwind: Callable[[], Awaitable[None]]
) -> tuple[ManagedServer, list[bool]]:
    """A server (``sleep 60``) whose readiness poll, cancelled, awaits ``unwind`` before it
    ends (as an HTTP request cancelled mid-flight does); the list records that it ended."""
    unwound: list[bool] = []

    async def slow_to_unwind(self: ManagedServer) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await unwind()
            unwound.append(True)
            raise

    monkeypatch.setattr(ManagedServer, "_wait_ready", slow_to_unwind)
    spec = ServerSpec(
        name="s0", backend=Backend.COMMAND, host="127.0.0.1", ports=(1,), model="m",
        command="sleep 60",
    )  # fmt: skip
    server = ManagedServer(spec, tmp_path / "logs", {"PATH": "/usr/bin:/bin"})
    return server, unwound


async def _started(server: ManagedServer) -> None:
    """Start ``server`` and return once its readiness poll waits on its request."""
    spawned = asyncio.Event()
    server.on_change = spawned.set  # called once it is spawned (its poll never ends here)
    server.start()
    await spawned.wait()
    await asyncio.sleep(0.1)


def _others() -> set[asyncio.Task[object]]:
    return asyncio.all_tasks() - {asyncio.current_task()}


def test_a_stopped_server_leaves_no_readiness_poll_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stop`` returns when the server's readiness poll has ended too. The poll is cancelled
    mid-request, and an HTTP request takes a few loop turns to unwind (anyio's connection
    attempt is a task of its own). A stop that did not wait for it left the poll to the
    event loop's shutdown, which cancelled the attempt before it ran: "coroutine
    'connect_tcp.<locals>.try_connect' was never awaited" (a CI failure of a later test)."""

    async def twenty_turns() -> None:  # the request's own tasks ending, a turn each
        for _ in range(20):
            await asyncio.sleep(0)

    server, unwound = _server_whose_poll_unwinds_slowly(tmp_path, monkeypatch, twenty_turns)

    async def main() -> set[asyncio.Task[object]]:
        await _started(server)
        await server.stop(GRACE_S)
        return _others()

    left = asyncio.run(main())
    assert left == set(), left
    assert unwound == [True]


def test_a_caller_cancelled_while_stop_waits_stays_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stop`` waits for the supervisor to end; a cancel of the caller that lands meanwhile
    (an agent shutting down, say) is raised once that is done, not swallowed with the
    supervisor's own, and the supervisor's poll still ends before ``stop`` does."""

    async def half_a_second() -> None:  # a request that takes a while to unwind
        await asyncio.sleep(0.5)

    server, unwound = _server_whose_poll_unwinds_slowly(tmp_path, monkeypatch, half_a_second)

    async def main() -> tuple[bool, set[asyncio.Task[object]]]:
        await _started(server)
        proc = server._proc
        assert proc is not None
        stopping = asyncio.create_task(server.stop(GRACE_S))
        await proc.wait()  # the group is gone: stop now waits on the supervisor
        await asyncio.sleep(0.05)
        stopping.cancel()
        await asyncio.wait({stopping})
        return stopping.cancelled(), _others()

    was_cancelled, left = asyncio.run(main())
    assert was_cancelled
    assert left == set(), left
    assert unwound == [True]
