"""The fan-out engine through its Python API: results, policies, and what it never does (raise)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import tpupod
from tpupod.fanout.context import Interrupt
from tpupod.fanout.execute import execute, execute_async
from tpupod.fanout.results import OnFail, Outcome
from tpupod.pod.record import Pod, Worker
from tpupod.transport import OutputLine, Stream


def test_results_come_back_in_worker_order(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(4)
    seen: list[tuple[int, OutputLine]] = []
    result = execute(
        pod, "echo $TPUPOD_WORKER_ID; echo e >&2", on_line=lambda w, line: seen.append((w.id, line))
    )
    assert result.ok and result.exit_code() == 0
    assert [r.worker.id for r in result.workers] == [0, 1, 2, 3]
    assert [r.last_line for r in result.workers] == ["e"] * 4
    assert {(w, line.text) for w, line in seen if line.stream is Stream.STDOUT} == {
        (i, str(i)) for i in range(4)
    }
    assert result.raise_for_failures() is result


def test_failure_is_reported_not_raised(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(2)
    result = execute(pod, 'echo "line $TPUPOD_WORKER_ID"; exit $TPUPOD_WORKER_ID')
    assert not result.ok
    first = result.first_failure
    assert first is not None and first.worker.id == 1 and first.outcome is Outcome.FAILED
    assert first.tail == ("line 1",)
    with pytest.raises(tpupod.FanoutFailed) as info:
        result.raise_for_failures()
    assert info.value.exit_code == 1
    assert "first: w1" in info.value.message


def test_an_unstartable_worker_is_unreachable_and_the_rest_run(
    make_pod: Callable[..., Pod],
) -> None:
    pod = make_pod(3)
    assert pod.workers[1].workdir is not None
    shutil.rmtree(pod.workers[1].workdir)
    result = execute(pod, "echo ok")
    outcomes = [r.outcome for r in result.workers]
    assert outcomes == [Outcome.OK, Outcome.UNREACHABLE, Outcome.OK]
    assert result.exit_code() == 255
    assert "cannot start the command" in (result.workers[1].error or "")


def test_selection_by_workers_list(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(3)
    chosen: list[Worker] = [pod.workers[2]]
    result = execute(pod, "true", workers=chosen)
    assert [r.worker.id for r in result.workers] == [2]


def test_killed_by_signal_reports_the_signal(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(1)
    result = execute(pod, "kill -9 $$")
    worker = result.workers[0]
    assert worker.status is not None and worker.status.signal == 9
    assert worker.outcome_text() == "killed by SIGKILL"
    assert result.exit_code() == 137


def test_interrupt_stops_everyone(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(3)

    async def go() -> tpupod.FanoutResult:
        interrupt = Interrupt()
        asyncio.get_running_loop().call_later(0.3, interrupt.request)
        return await execute_async(pod, "sleep 30", interrupt=interrupt, grace=1)

    result = asyncio.run(go())
    assert [r.outcome for r in result.workers] == [Outcome.INTERRUPTED] * 3
    assert result.exit_code() == 130
    assert result.elapsed < 5


def test_cancelling_the_caller_still_kills_every_worker(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(2)
    marker_dir = Path(pod.workers[0].workdir or "")

    async def go() -> None:
        task = asyncio.create_task(execute_async(pod, "echo $$ > pid; sleep 30", grace=0.5))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    pid = int((marker_dir / "pid").read_text())
    from tests.conftest import wait_until_gone

    assert wait_until_gone(pod.name) == []
    assert (
        not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    )


def test_on_fail_accepts_strings(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(2)
    result = execute(
        pod, '[ "$TPUPOD_WORKER_ID" = 0 ] && exit 2; sleep 30', on_fail="kill", grace=0.5
    )
    assert [r.outcome for r in result.workers] == [Outcome.FAILED, Outcome.STOPPED]
    assert result.workers[1].stopped_by == 0
    assert OnFail("kill") is OnFail.KILL


def test_public_api_is_complete() -> None:
    for name in tpupod.__all__:
        assert getattr(tpupod, name) is not None
    with pytest.raises(AttributeError):
        _ = tpupod.nothing_here
