"""The local runner's warm pool of Python processes for code jobs: the code job contract
(logger, result, the job's identity), a job that raises, exits or outlives its timeout
fails with the reason and the pool keeps serving, cancel, and the orphan guard."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.test_jobs import _wait_for, runner
from tpupod.jobs.attempt import Hooks, Outcome
from tpupod.jobs.execute import LocalExecutor
from tpupod.jobs.models import JobRequest, JobStatus
from tpupod.jobs.pool import Pool
from tpupod.jobs.store import Store

pytestmark = pytest.mark.local  # real processes


@pytest.fixture
def store(tmp_path: Path, state_home: Path) -> Iterator[Store]:
    """A store of the test's own; its runners keep their journals in its state directory."""
    opened = Store.open(f"sqlite:///{tmp_path / 'jobs.db'}")
    yield opened
    opened.close()


def _run(pool: Pool, store: Store, code: str, *, timeout: float | None = None) -> Outcome:
    """Run one code job in ``pool``; its lines land in ``_run.lines``."""
    job = store.get(store.submit(JobRequest(code=code, timeout=timeout)))
    lines: list[str] = []
    hooks = Hooks(on_line=lambda w, t: lines.append(t), on_started=lambda: None)
    executor = LocalExecutor(grace_s=1.0, pool=pool)
    outcome = pool_loop.run_until_complete(executor.execute(job, 1, hooks, asyncio.Event()))
    _LINES[:] = lines
    return outcome


_LINES: list[str] = []
pool_loop = asyncio.new_event_loop()


@pytest.fixture(scope="module", autouse=True)
def _close_the_loop() -> Iterator[None]:
    yield
    pool_loop.close()


def _with_a_child(marker: Path) -> str:
    """Code that starts ``sleep 60`` and writes its pid to ``marker``."""
    return (
        "import subprocess, time\nchild = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
    )


@pytest.mark.timeout(60)
def test_the_pool_runs_code_jobs_as_before_and_survives_their_failures(store: Store) -> None:
    pool = Pool(1, grace_s=1.0)
    pool_loop.run_until_complete(pool.start())
    try:
        code = (
            "import os\nlogger.info('job %s', os.environ['TPUPOD_JOB_ID'])\n"
            "print(os.getpid())\nprint('no newline', end='')\nresult = {'answer': 42}\n"
        )
        done = _run(pool, store, code)
        assert (done.status, done.result) == (JobStatus.COMPLETED, '{"answer": 42}')
        first = _LINES[1]
        assert ["INFO job 1", first, "no newline"] == _LINES  # the marker kept off the log

        raised = _run(pool, store, "import os\nprint(os.getpid())\nraise ValueError('bad 7')")
        assert (raised.status, raised.error) == (JobStatus.FAILED, "raised ValueError: bad 7")
        assert _LINES[0] == first and _LINES[-1] == "ValueError: bad 7"  # the same process
        assert 'File "<job>", line 3' in "\n".join(_LINES) and "pool_worker" not in str(_LINES)

        exited = _run(pool, store, "import os\nprint(os.getpid(), flush=True)\nos._exit(3)")
        assert (exited.status, exited.error) == (JobStatus.FAILED, f"exit 3: {first}")

        began = time.monotonic()
        slow_code = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)"
        slow = _run(pool, store, slow_code, timeout=1.0)
        assert (slow.status, slow.error) == (JobStatus.FAILED, "timed out after 1 s")
        assert time.monotonic() - began < 5
        slow_pid = int(_LINES[0])
        assert str(slow_pid) != first and not psutil.pid_exists(slow_pid)  # replaced, killed

        closing = _run(pool, store, "import os\nos.close(1)\nos.close(2)\nresult = 5")
        assert (closing.status, closing.result) == (JobStatus.COMPLETED, "5")  # no hang
        child = _run(pool, store, "import subprocess\nsubprocess.run(['echo', 'from a child'])")
        assert child.status is JobStatus.COMPLETED and _LINES == ["from a child"]  # put back

        again = _run(pool, store, "import os\nresult = os.getpid()")
        assert again.status is JobStatus.COMPLETED
        assert again.result not in (first, str(slow_pid))  # a fresh process took their place
        assert len(pool.idle) == 1 and not pool.busy
    finally:
        pool_loop.run_until_complete(pool.close())


@pytest.mark.timeout(60)
def test_a_job_sent_to_a_process_that_just_died_runs_in_a_fresh_one(store: Store) -> None:
    pool = Pool(1, grace_s=1.0)
    pool_loop.run_until_complete(pool.start())
    try:
        (dead,) = pool.idle
        dead.proc.kill()  # dies idle; the pool learns it only when it reads the pipe's end
        assert dead.alive
        done = _run(pool, store, "import os\nprint('ran')\nresult = os.getpid()")
        assert (done.status, _LINES) == (JobStatus.COMPLETED, ["ran"])  # once, not lost
        assert done.result != str(dead.proc.pid) and not dead.alive
        assert len(pool.idle) == 1 and not pool.busy
    finally:
        pool_loop.run_until_complete(pool.close())


@pytest.mark.timeout(60)
def test_a_cancelled_pool_job_stops_and_the_runner_goes_on(store: Store, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    marker = tmp_path / "child.pid"
    code = _with_a_child(marker) + "logger.info('up')\n" + "time.sleep(60)\n"
    job = store.submit(JobRequest(code=code))
    proc = runner(db, "--local", "-c", "2", "--lease", "3")
    try:
        _wait_for(lambda: bool(store.logs(job)))
        child = int(marker.read_text())
        began = time.monotonic()
        store.cancel(job)
        _wait_for(lambda: store.get(job).status.finished, timeout=10)
        assert store.get(job).status is JobStatus.CANCELLED
        assert time.monotonic() - began < 8  # the next heartbeat (1 s), TERM, the grace (3 s)
        _wait_for(
            lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
        )
        after = store.submit(JobRequest(code="result = 'still serving'"))
        _wait_for(lambda: store.get(after).status.finished)
        assert store.get(after).result == "still serving"
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


@pytest.mark.timeout(30)
def test_a_pool_process_whose_runner_vanished_ends_its_job_and_its_children(
    tmp_path: Path,
) -> None:
    """What kill -9 of the runner leaves: the pool process sees its stdin close."""
    marker = tmp_path / "child.pid"
    code = _with_a_child(marker) + "time.sleep(60)\n"
    worker = subprocess.Popen(
        [sys.executable, "-m", "tpupod.jobs.pool_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert worker.stdin is not None
    worker.stdin.write(json.dumps({"code": code, "env": {}}).encode() + b"\n")
    worker.stdin.flush()
    _wait_for(lambda: marker.exists() and marker.read_text() != "")
    child = int(marker.read_text())
    worker.stdin.close()  # as if the runner were killed
    assert worker.wait(10) == -signal.SIGKILL
    _wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie")
