"""The job service on SQLite and on PostgreSQL (started here on loopback): claims that cannot
double-run, fencing by (job id, attempt), the reaper, runners as real processes, and a gang
job on a local pod."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import update

from tests.conftest import CliResult, tpupod_argv
from tests.postgres import Postgres, new_database, postgres_cluster
from tests.test_jobs_api import serving
from tpupod.errors import LeaseLost
from tpupod.jobs import claims, service
from tpupod.jobs.models import Claim, JobRequest, JobStatus
from tpupod.jobs.request import UTF8_HINT
from tpupod.jobs.store import Store
from tpupod.pod.record import Pod

pytestmark = pytest.mark.local  # a database server and runner processes


@pytest.fixture
def postgres(postgres_server: Postgres) -> Postgres:
    """The session's PostgreSQL cluster (tests/conftest.py); modules import this name."""
    return postgres_server


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path, state_home: Path) -> str:
    """A fresh, empty job store on each database (runners keep their journals in this
    test's own state directory)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return new_database(request.getfixturevalue("postgres"))


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    opened = Store.open(db_url)
    yield opened
    opened.close()


def command_job(command: str, **fields: object) -> JobRequest:
    return JobRequest.model_validate({"command": command, **fields})


# -- the store and its claims, in process ---------------------------------------------


def test_schema_is_versioned_and_opening_again_migrates_nothing(db_url: str) -> None:
    from tpupod.jobs import schema

    first = Store.open(db_url)
    with first.write() as conn:
        assert schema.current_version(conn) == schema.LATEST
        assert schema.migrate(conn) == schema.LATEST  # nothing left to do
    first.close()


def test_a_claim_runs_the_most_urgent_job_and_no_job_twice(store: Store) -> None:
    low = store.submit(command_job("true"))
    high = store.submit(command_job("true", priority=5))
    first = claims.claim(store, "a", pod=None, lease_s=30)
    second = claims.claim(store, "b", pod=None, lease_s=30)
    assert first is not None and second is not None
    assert (first.job.id, second.job.id) == (high, low)
    assert claims.claim(store, "c", pod=None, lease_s=30) is None
    assert store.get(high).status is JobStatus.SCHEDULED


def test_jobs_for_a_pod_go_only_to_that_pods_runners(store: Store) -> None:
    job = store.submit(command_job("true", pod="big"))
    assert claims.remaining(store, None) == 0  # so a local --until-empty runner ends
    assert claims.remaining(store, "big") == 1
    assert claims.claim(store, "here", pod=None, lease_s=30) is None
    assert claims.claim(store, "other", pod="small", lease_s=30) is None
    taken = claims.claim(store, "big-runner", pod="big", lease_s=30)
    assert taken is not None and taken.job.id == job


def test_an_expired_lease_is_requeued_with_backoff_and_the_old_runner_is_fenced(
    store: Store,
) -> None:
    job = store.submit(command_job("true"))
    old = claims.claim(store, "dead-runner", pod=None, lease_s=0.05)
    assert old is not None
    claims.started(store, old)
    time.sleep(0.1)
    [reaped] = claims.reap(store)
    assert reaped.what == f"job {job} requeued for attempt 2"
    requeued = store.get(job)
    assert requeued.status is JobStatus.PENDING
    lost = "runner dead-runner lost (its lease expired) while running"
    assert requeued.error == f"attempt 1: {lost}"
    [entry] = requeued.history  # jobs show and jobs logs say it
    assert (entry.attempt, entry.runner, entry.how, entry.why) == (1, "dead-runner", "lost", lost)
    assert claims.claim(store, "new", pod=None, lease_s=30) is None  # backoff: 1 s
    time.sleep(claims.backoff_s(1))
    new = claims.claim(store, "new", pod=None, lease_s=30)
    assert new is not None and new.attempt == 2
    # the presumed-dead runner wakes up: every write it tries is refused
    with pytest.raises(LeaseLost):
        claims.append_logs(store, old, old.next_seq, [(0, "late line")])
    with pytest.raises(LeaseLost):
        claims.heartbeat(store, old, 30)
    with pytest.raises(LeaseLost):
        claims.finish(store, old, JobStatus.COMPLETED, result="stale")
    claims.append_logs(store, new, new.next_seq, [(0, "fresh line")])
    claims.finish(store, new, JobStatus.COMPLETED, result="fresh")
    done = store.get(job)
    assert (done.status, done.result, done.attempt) == (JobStatus.COMPLETED, "fresh", 2)
    assert [line.line for line in store.logs(job)] == ["fresh line"]


def test_an_attempt_given_back_by_a_stopped_runner_does_not_count_against_max_attempts(
    store: Store,
) -> None:
    """A trial: three runners stopped with Ctrl-C while holding a job (each gives it back)
    used its 3 attempts; the job then showed 'pending 4/3' and ran a fourth anyway."""
    from sqlalchemy import update

    from tpupod.jobs.schema import jobs

    job = store.submit(command_job("false", max_attempts=2))
    for runner in ("a", "b", "c"):
        held = claims.claim(store, runner, pod=None, lease_s=30)
        assert held is not None
        claims.started(store, held)
        claims.release(store, held, "stopped")
    given = store.get(job)
    assert (given.status, given.attempt, given.counted_attempts) == (JobStatus.PENDING, 3, 0)
    assert [e.how for e in given.history] == ["given back"] * 3
    fourth = claims.claim(store, "d", pod=None, lease_s=30)
    assert fourth is not None and fourth.attempt == 4
    assert claims.retry(store, fourth, "exit 1") is JobStatus.PENDING  # its first counted
    with store.write() as conn:  # past the retry's backoff
        conn.execute(update(jobs).where(jobs.c.id == job).values(run_after=0.0))
    fifth = claims.claim(store, "e", pod=None, lease_s=30)
    assert fifth is not None
    assert claims.retry(store, fifth, "exit 1") is JobStatus.FAILED  # the second: --max-attempts 2
    assert store.get(job).error == "exit 1; gave up after 2 attempts"


def test_an_attempt_that_fails_before_its_program_started_as_its_runner_stops_is_given_back(
    store: Store, tmp_path: Path
) -> None:
    """A trial: a pod runner's Ctrl-C reached the processes its job was starting (the
    preflight's, forked in the terminal's process group before they have a session of
    their own): the attempt failed ('w0 (vm): killed by SIGINT') and so did the job. Here
    the executor's attempt fails, its program not started, just as its runner is told to
    stop (a pod runner's ending, before the runner's own loop asks it to stop)."""
    from tpupod.jobs.attempt import Hooks, Outcome
    from tpupod.jobs.runner import Runner

    job = store.submit(command_job("true", max_attempts=1))

    class StoppedAtTheStart:
        async def execute(
            self, job: object, attempt: int, hooks: Hooks, stop: asyncio.Event
        ) -> Outcome:
            stopping.shutdown.set()  # the runner's SIGINT handler, as the signal came
            return Outcome(JobStatus.FAILED, error="1 worker(s) not ready: w0: killed by SIGINT")

    async def serve() -> int:
        return await stopping.serve(until_empty=True)

    stopping = Runner(store, StoppedAtTheStart(), pod=None, lease_s=30, journal=tmp_path)
    asyncio.run(serve())
    given = store.get(job)
    assert (given.status, given.counted_attempts) == (JobStatus.PENDING, 0), given
    assert [e.how for e in given.history] == ["given back"]


def test_a_reaped_attempt_ends_when_its_runner_was_last_heard_from_not_when_reaped(
    store: Store,
) -> None:
    """New-user trial: 'jobs show' gave a runner killed at 22:16:12 the end 22:16:26, when
    the next runner reaped its job: a runner started hours later made the attempt seem to
    have run for hours. The attempt ends at its runner's last sign of life (its last
    heartbeat or write: the row's updated_at), and 'show' says it is that."""
    from tpupod.jobs.schema import jobs

    job = store.submit(command_job("true"))
    last = store.submit(command_job("true", max_attempts=1))
    for _ in (job, last):
        assert claims.claim(store, "gone-runner", pod=None, lease_s=30) is not None
    began, heard = time.time() - 7200, time.time() - 3600  # it died an hour before the reap
    with store.write() as conn:
        conn.execute(update(jobs).values(scheduled_at=began, updated_at=heard))
    reaped = claims.reap(store, dead=frozenset({"gone-runner"}), expired=False)
    assert [one.requeued for one in reaped] == [True, False]
    [entry] = store.get(job).history
    assert (entry.started, entry.ended) == (began, heard)
    failed = store.get(last)  # its last attempt ended with it: so did the job
    assert (failed.status, failed.completed_at) == (JobStatus.FAILED, heard)
    [line] = service.attempt_texts(store.get(job))
    stamp = time.strftime("%H:%M:%S", time.gmtime(heard))
    assert line.endswith(f", lost after {stamp}, 1 h 00 min in)"), line


def test_a_job_that_loses_its_runner_max_attempts_times_fails_with_the_reason(
    store: Store,
) -> None:
    job = store.submit(command_job("true", max_attempts=1))
    assert claims.claim(store, "r1", pod=None, lease_s=0.01) is not None
    time.sleep(0.05)
    [reaped] = claims.reap(store)
    assert reaped.what == f"job {job} failed after 1 attempt"
    failed = store.get(job)
    assert failed.status is JobStatus.FAILED
    assert "gave up after 1 attempts" in (failed.error or "")


def test_cancel_ends_a_pending_job_and_asks_a_leased_one_to_stop(store: Store) -> None:
    pending = store.submit(command_job("true"))
    leased = store.submit(command_job("true"))
    store.cancel(pending)
    taken = claims.claim(store, "r", pod=None, lease_s=30)
    assert taken is not None and taken.job.id == leased
    assert store.get(pending).status is JobStatus.CANCELLED
    assert store.cancel(leased).status is JobStatus.SCHEDULED
    assert claims.heartbeat(store, taken, 30) is True  # the runner learns it at its heartbeat


def _take_over(store: Store, job_id: int) -> Claim:
    """Another runner gets ``job_id`` (the most urgent pending one then): its lease expires,
    the reaper requeues it, and "b" claims attempt 2 at once (no backoff)."""
    from sqlalchemy import update

    from tpupod.jobs.schema import jobs

    with store.write() as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(lease_expires_at=0.0))
    assert len(claims.reap(store)) == 1
    with store.write() as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(run_after=0.0))
    taken = claims.claim_many(store, "b", pod=None, lease_s=30, limit=1)
    assert [c.job.id for c in taken] == [job_id] and taken[0].attempt == 2
    return taken[0]


def test_a_batched_finish_writes_every_held_attempt_and_rejects_only_the_lost_one(
    store: Store,
) -> None:
    ids = [store.submit(command_job("true", priority=p)) for p in (0, 2, 1, 0)]
    held = claims.claim_many(store, "a", pod=None, lease_s=30, limit=3, running=True)
    assert [c.job.id for c in held] == [ids[1], ids[2], ids[0]]  # most urgent first
    assert {store.get(c.job.id).status for c in held} == {JobStatus.RUNNING}  # one commit
    assert store.get(ids[1]).started_at is not None
    newer = _take_over(store, ids[2])
    cancel, lost = claims.heartbeat_many(store, held, 30)
    assert (cancel, lost) == (set(), {(ids[2], 1)})
    endings = [
        claims.Ending(held[0], JobStatus.COMPLETED, result='"42"'),  # JSON, as executors write
        claims.Ending(held[1], JobStatus.COMPLETED, result="stale"),
        claims.Ending(held[2], JobStatus.FAILED, error="exit 1: no"),
    ]
    lost_now, more = claims.finish_and_claim(store, endings, "a", pod=None, lease_s=30, limit=5)
    assert lost_now == {(ids[2], 1)}  # that job only
    assert [c.job.id for c in more] == [ids[3]]  # and the next job, in the same commit
    assert (store.get(ids[1]).status, store.get(ids[1]).result) == (JobStatus.COMPLETED, "42")
    assert (store.get(ids[0]).status, store.get(ids[0]).error) == (JobStatus.FAILED, "exit 1: no")
    taken_over = store.get(ids[2])  # the newer attempt is untouched
    assert (taken_over.status, taken_over.attempt, taken_over.lease_owner) == (
        JobStatus.SCHEDULED,
        2,
        "b",
    )
    claims.finish(store, newer, JobStatus.COMPLETED, result="fresh")
    assert store.get(ids[2]).result == "fresh"


def test_seed_003_documents_are_accepted_as_they_are() -> None:
    doc = {
        "challenge_number": 42,
        "code": "result = 1",
        "timeout": 300,
        "status": "pending",
        "created_at": "SERVER_TIMESTAMP",
    }
    request = JobRequest.model_validate(doc)
    assert request.timeout == 300 and request.metadata == {"challenge_number": 42}


def test_the_local_executor_keeps_long_and_unterminated_lines(store: Store) -> None:
    import asyncio

    from tpupod.jobs.attempt import Hooks
    from tpupod.jobs.execute import LocalExecutor

    job_id = store.submit(command_job("head -c 200000 /dev/zero | tr '\\0' x; echo; printf end"))
    lines: list[str] = []
    started: list[bool] = []
    hooks = Hooks(on_line=lambda w, t: lines.append(t), on_started=lambda: started.append(True))
    outcome = asyncio.run(LocalExecutor().execute(store.get(job_id), 1, hooks, asyncio.Event()))
    assert outcome.status is JobStatus.COMPLETED and started == [True]
    assert "".join(lines[:-1]) == "x" * 200000 and lines[-1] == "end"


# -- runners as processes -------------------------------------------------------------


def runner(db_url: str, *args: str) -> subprocess.Popen[str]:
    argv = tpupod_argv("jobs", "worker", "--db", db_url, *args)
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_1000_jobs_through_3_runner_processes_each_run_exactly_once(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    request = command_job(f"echo $TPUPOD_JOB_ID >> {ran}")
    ids = [store.submit(request) for _ in range(1000)]
    runners = [runner(db_url, "--local", "--until-empty", "-q") for _ in range(3)]
    for proc in runners:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    lines = ran.read_text().split()
    assert sorted(int(x) for x in lines) == ids  # every job ran, none twice
    assert store.counts() == {JobStatus.COMPLETED: 1000}
    with store.read() as conn:
        from sqlalchemy import func, select

        from tpupod.jobs.schema import jobs

        owners = conn.execute(select(func.count(func.distinct(jobs.c.lease_owner)))).scalar()
        attempts = conn.execute(select(func.max(jobs.c.attempt))).scalar()
    assert owners == 0 and attempts == 1  # leases released, no retries


@pytest.mark.timeout(120)
def test_runners_with_concurrency_run_each_job_once_with_batched_claims(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    """3 runners of 4 slots each: code jobs in their pools, command jobs as processes."""
    ran = tmp_path / "ran"
    code = f"import os\nwith open({str(ran)!r}, 'a') as f:\n"
    code += "    f.write(os.environ['TPUPOD_JOB_ID'] + '\\n')\n"
    requests = [
        JobRequest(code=code) if i % 5 else command_job(f"echo $TPUPOD_JOB_ID >> {ran}")
        for i in range(300)
    ]
    ids = store.submit_many(requests)
    runners = [runner(db_url, "--local", "--until-empty", "-q", "-c", "4") for _ in range(3)]
    for proc in runners:
        _, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err
    assert sorted(int(x) for x in ran.read_text().split()) == ids  # every job ran, none twice
    assert store.counts() == {JobStatus.COMPLETED: 300}
    with store.read() as conn:
        from sqlalchemy import func, select

        from tpupod.jobs.schema import jobs

        attempts = conn.execute(select(func.max(jobs.c.attempt))).scalar()
        claimed_together = conn.execute(
            select(func.count()).select_from(
                select(jobs.c.scheduled_at)
                .group_by(jobs.c.scheduled_at)
                .having(func.count() > 1)
                .subquery()
            )
        ).scalar()
    assert attempts == 1
    assert claimed_together, "no claim took more than one job"


def _wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_a_runner_killed_mid_job_loses_the_job_to_another_and_its_late_writes_are_fenced(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    # the first attempt sleeps long enough to be killed under any load (with 0.5 s, a run at
    # load 28 finished it before the kill); the second does not wait
    job = store.submit(
        command_job(
            f"echo begin; [ $TPUPOD_JOB_ATTEMPT = 1 ] && sleep 30; "
            f"echo $TPUPOD_JOB_ATTEMPT >> {ran}"
        )
    )
    first = runner(db_url, "--local", "--lease", "1")
    # a local claim marks the job running as it starts it: its first line says it is at work
    _wait_for(lambda: store.get(job).status is JobStatus.RUNNING and bool(store.logs(job)))
    held = store.get(job)
    started = [p for p in psutil.Process(first.pid).children(recursive=True) if p.name() == "sleep"]
    first.kill()  # kill -9: no chance to give the job back or stop it
    first.communicate()
    assert started and psutil.wait_procs(started, timeout=5)[1] == []  # the guard ended it
    second = runner(db_url, "--local", "--lease", "1", "--until-empty")
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    done = store.get(job)
    assert done.status is JobStatus.COMPLETED and done.attempt == 2, done
    assert ran.read_text().split() == ["2"]  # completed once
    assert [line.line for line in store.logs(job)] == ["begin", "begin"]
    stale = Claim(job=held, attempt=held.attempt, owner=held.lease_owner or "", next_seq=99)
    with pytest.raises(LeaseLost):
        claims.append_logs(store, stale, 99, [(0, "from the dead")])
    with pytest.raises(LeaseLost):
        claims.finish(store, stale, JobStatus.FAILED, error="from the dead")
    assert store.get(job).status is JobStatus.COMPLETED
    assert len(store.logs(job)) == 2


@pytest.mark.timeout(120)
def test_a_runner_killed_mid_job_is_named_with_what_became_of_each_of_its_jobs(
    store: Store, db_url: str, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    """Issue 41: 'requeued or failed 2 job(s) whose runner was lost' named neither the
    jobs, nor the runner, nor which of the two happened, and 'jobs show' said 'completed
    after 2 attempts', nothing of why. A runner killed (-9) on this state directory is known
    gone at once (the lock on its journal went with its process): the next runner takes its
    jobs back without waiting out its lease (15 s), says which runner, why and what became
    of each job, and 'show' and 'logs' name each attempt's runner and how it ended."""
    ran = tmp_path / "ran"
    again = store.submit(
        command_job(
            f'echo "start $TPUPOD_JOB_ATTEMPT"; [ $TPUPOD_JOB_ATTEMPT = 1 ] && sleep 60; '
            f"echo $TPUPOD_JOB_ID >> {ran}"
        )
    )
    once = store.submit(command_job("echo start; sleep 60", max_attempts=1))
    first = runner(db_url, "--local", "-c", "2")  # the default lease: 15 s
    _wait_for(lambda: all(len(store.logs(job)) == 1 for job in (again, once)), timeout=30)
    lost = store.get(again).lease_owner
    first.kill()
    first.communicate()
    killed_at = time.time()
    # until the next runner reaps them, the views say the runner is gone, writing nothing
    held = store.get(again)
    gone = f"runner {lost} is gone: its process ended; the next runner"
    shown = cli("jobs", "show", str(again), "--db", db_url).out.splitlines()
    assert shown[1] == f"  status    running (attempt 1 of 3; {gone} requeues it)", shown
    listed = cli("jobs", "ls", "--db", db_url).out.splitlines()
    assert listed[1].endswith(f"({gone} fails it (its last attempt))"), listed  # once
    assert listed[2].endswith(f"({gone} requeues it)"), listed
    assert store.get(again) == held
    began = time.monotonic()
    second = runner(db_url, "--local", "--until-empty")
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert time.monotonic() - began < 12, err  # no lease waited out
    assert ran.read_text().split() == [str(again)]  # the requeued job ran once more, to its end
    said = f"runner {lost} lost (its process is gone): job {again} requeued for attempt 2; "
    assert said + f"job {once} failed after 1 attempt" in err, err
    done, failed = store.get(again), store.get(once)
    assert (done.status, done.attempt, failed.status) == (
        JobStatus.COMPLETED,
        2,
        JobStatus.FAILED,
    )
    # attempt 1 ended when its runner was last heard from (before the kill), not when reaped
    assert killed_at - 10 < done.history[0].ended <= killed_at, done.history
    shown = cli("jobs", "show", str(again), "--db", db_url).out.splitlines()
    assert shown[1] == "  status    completed after 2 attempts", shown
    stamp, clock = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", r"\d\d:\d\d:\d\d"
    length = r"[\d.]+ (s|min \d\d s)"
    at = shown.index(next(line for line in shown if line.startswith("  attempts ")))
    assert re.fullmatch(
        rf"  attempts  1: runner {re.escape(lost or '')} lost \(its process is gone\) while "
        rf"running \(from {stamp} UTC, lost after {clock}, {length} in\)",
        shown[at],
    ), shown
    assert re.fullmatch(
        rf"            2: completed on runner {re.escape(done.runner or '')} "
        rf"\({stamp} to {clock} UTC, {length}\)",
        shown[at + 1],
    ), shown
    header = r"--- attempt {} \(runner {}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC\) ---"
    logs = cli("jobs", "logs", str(again), "--db", db_url).out.splitlines()
    assert len(logs) == 4 and logs[1::2] == ["start 1", "start 2"], logs
    assert re.fullmatch(header.format(1, re.escape(lost or "")), logs[0]), logs
    assert re.fullmatch(header.format(2, re.escape(done.runner or "")), logs[2]), logs
    assert (
        cli("jobs", "logs", str(again), "--db", db_url, "--attempt", "2").out.splitlines()
        == (logs[2:])
    )
    refused = cli("jobs", "logs", str(again), "--db", db_url, "--attempt", "3")
    assert refused.code == 2 and refused.err.startswith(f"error: job {again} had 2 attempts, not 3")


def test_a_gone_runners_journal_is_recorded_unless_the_job_went_on_without_it(
    store: Store, db_url: str
) -> None:
    """What the next runner does with a journal whose runner is gone, when the store had
    already moved on: a job the reaper requeued that nobody took since is recorded as its
    journal says (its lines, its ending, attempt 1); a job another runner took meanwhile
    (and ran) keeps its own ending, and its history says attempt 1 had ended too, late."""
    from tpupod.jobs.outcomes import Journal, Kept, journal_folder
    from tpupod.jobs.schema import jobs

    requeued, taken = (store.submit(command_job("true")) for _ in range(2))
    journal = Journal(journal_folder(db_url), "gone-runner")
    for job in (requeued, taken):
        claim = claims.claim(store, "gone-runner", pod=None, lease_s=0.01)
        assert claim is not None and claim.job.id == job
        claims.append_logs(store, claim, 1, [(0, "first")])
        kept = Kept(job, 1, "gone-runner", "end", "completed", '"done"', None, time.time() - 99)
        journal.keep(kept, 2, [[(0, "second"), (0, "third")]])
    journal.close()  # as a kill -9 leaves it: the lock goes, the file stays
    time.sleep(0.05)
    assert len(claims.reap(store)) == 2
    with store.write() as conn:  # another runner takes the second job at once, and ends it
        conn.execute(update(jobs).where(jobs.c.id == taken).values(run_after=0.0))
    again = claims.claim_many(store, "other", pod=None, lease_s=30, limit=1)
    assert [c.job.id for c in again] == [taken]
    claims.finish(store, again[0], JobStatus.COMPLETED, result='"again"')
    proc = runner(db_url, "--local", "--until-empty")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    done = store.get(requeued)
    assert (done.status, done.attempt, done.result) == (JobStatus.COMPLETED, 1, "done"), done
    assert done.completed_at is not None and time.time() - done.completed_at > 98  # it ended
    assert [line.line for line in store.logs(requeued)] == ["first", "second", "third"]
    assert [entry.how for entry in done.history] == ["recovered"], done.history
    late = store.get(taken)
    assert (late.status, late.attempt, late.result) == (JobStatus.COMPLETED, 2, "again")
    assert [(entry.attempt, entry.how) for entry in late.history] == [(1, "late")]
    assert "the job store learned it only after the job had gone on" in late.history[0].why
    assert f"recorded job {requeued} attempt 1 (completed) for runner gone-runner" in err, err
    assert not list(journal_folder(db_url).glob("*.journal"))  # recorded: removed


# -- the CLI --------------------------------------------------------------------------


def test_submit_prints_the_id_alone_and_wait_prints_the_result(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    db_url = f"sqlite:///{tmp_path / 'jobs.db'}"  # the CLI is the same on both databases
    code = tmp_path / "job.py"
    code.write_text("logger.info('working')\nresult = {'answer': 6 * 7}\n")
    submitted = cli("jobs", "submit", str(code), "--db", db_url, "--name", "answer")
    assert submitted.code == 0, submitted.err
    job_id = submitted.out.strip()
    assert job_id.isdigit() and submitted.out == f"{job_id}\n"
    worker = cli("jobs", "worker", "--db", db_url, "--local", "--until-empty", "-q")
    assert worker.code == 0, worker.err
    waited = cli("jobs", "wait", job_id, "--db", db_url)
    assert (waited.code, waited.out) == (0, '{"answer": 42}\n')
    logs = cli("jobs", "logs", job_id, "--db", db_url)
    assert logs.out == "INFO working\n"
    shown = json.loads(cli("jobs", "show", job_id, "--json", "--db", db_url).out)
    assert shown["status"] == "completed" and shown["name"] == "answer"
    listed = cli("jobs", "ls", "--db", db_url, "--status", "completed")
    assert f"{job_id}  completed" in listed.out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--", "true", "--timeout", "x"], None),  # after --: part of the command, accepted
        (["--timeout", "-1", "--", "true"], "--timeout -1: must be more than 0 seconds"),
        (["--label", "novalue", "--", "true"], "bad --label 'novalue'"),
        (["missing.py"], "missing.py: no such file"),
        (  # a byte that is not UTF-8 (the argv's \udcff): an internal error before
            ["--", "echo", "\udcff"],
            "the byte 0xff is not UTF-8 text (\\udcff, as Python reads such a byte of a "
            "command line or a file name): no database can store it",
        ),
        (["--name", "\udcff", "--", "true"], "the byte 0xff is not UTF-8 text"),
    ],
)
def test_bad_submissions_get_one_error_line_and_exit_2(
    cli: Callable[..., CliResult], tmp_path: Path, args: list[str], message: str | None
) -> None:
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    if "UTF-8" in (message or ""):
        # the store made: a plain submit takes the fast path (a trial: the byte 0xff in its
        # command was a traceback there)
        assert cli("jobs", "submit", "--db", db, "--", "true").code == 0
    result = cli("jobs", "submit", "--db", db, *args)
    if message is None:
        assert result.code == 0, result.err
        return
    assert result.code == 2
    lines = result.err.splitlines()
    assert lines[0].startswith(f"error: {message}"), result.err
    assert lines[1].startswith("hint: "), result.err
    assert "Traceback" not in result.err
    if "UTF-8" in message:
        assert lines[1] == f"hint: {UTF8_HINT}"


def test_a_state_directory_that_cannot_be_made_is_one_error_line(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """The default store's folder under a TPUPOD_HOME that cannot be made (a read-only
    mount, a typo into /proc) was 'internal error: FileNotFoundError' (exit 70)."""
    home = "/proc/tpupod-nowhere"
    for args in (["submit", "--", "true"], ["worker", "--local", "--until-empty"]):
        result = cli("jobs", *args, env={"TPUPOD_HOME": home})
        assert result.code == 1, result.err
        lines = result.err.splitlines()
        assert lines[0].startswith(f"error: cannot make the job store's folder {home}:"), lines
        assert "TPUPOD_HOME" in lines[1] and "--db" in lines[1], lines


def test_submit_wait_and_logs_follow_with_a_runner_at_work(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    code = tmp_path / "job.py"
    code.write_text("import time\ntime.sleep(0.3)\nresult = 42\n")
    proc = runner(db, "--local")
    try:
        waited = cli("jobs", "submit", "--db", db, "--wait", str(code))
        assert (waited.code, waited.out) == (0, "1\n42\n"), waited.err
        store = Store.open(db)
        job = store.submit(command_job("echo a; sleep 0.5; echo b"))
        followed = cli("jobs", "logs", "-f", str(job), "--db", db)
        assert (followed.code, followed.out) == (0, "a\nb\n"), followed.err
        assert store.get(job).status is JobStatus.COMPLETED
        failing = cli("jobs", "submit", "--db", db, "--", "bash", "-c", "echo oops; exit 3")
        waited = cli("jobs", "wait", failing.out.strip(), "--db", db)
        assert waited.code == 1
        reason = f"error: job {failing.out.strip()} failed: exit 3: oops"
        assert waited.err.splitlines()[0] == reason, waited.err
        store.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ls", "--db", "foo://x"], "error: cannot use the job store URL 'foo://x': "),
        (["ls", "--status", "nope"], "error: --status 'nope'"),
        (["show", "nope"], None),  # typer's own usage error: exit 2 too
        (["worker", "--pod", "p", "-c", "2"], "error: --concurrency is for --local runners"),
        (["worker", "--local", "-c", "0"], None),  # typer's range check
    ],
)
def test_bad_arguments_exit_2_without_a_traceback(
    cli: Callable[..., CliResult], tmp_path: Path, args: list[str], message: str | None
) -> None:
    result = cli("jobs", *args)
    assert result.code == 2, result.err
    assert message is None or result.err.startswith(message), result.err
    assert "Traceback" not in result.err


# -- gang jobs on a local pod ---------------------------------------------------------

GANG = """
import time, tpupod
me = tpupod.worker()
logger.info(f"worker {{me.id}} of {{me.count}}")
if me.id == {fail}:
    raise ValueError("bad shard 7")
time.sleep({sleep})
result = me.count
"""


def test_a_gang_job_runs_on_every_worker_and_worker_0_gives_the_result(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(2)
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    code = tmp_path / "gang.py"
    code.write_text(GANG.format(fail=-1, sleep=0))
    job_id = cli("jobs", "submit", str(code), "--db", db, "--pod", pod.name).out.strip()
    # --worker-python is the workers' Python on a local pod too (it was ignored there)
    python, used = tmp_path / "python", tmp_path / "used"
    script = f'#!/bin/sh\necho "$TPUPOD_WORKER_ID" >> {used}\nexec {sys.executable} "$@"\n'
    python.write_text(script)
    python.chmod(0o755)
    worker = cli(
        "jobs", "worker", "--db", db, "--pod", pod.name, "--until-empty",
        "--worker-python", str(python), timeout=60,
    )  # fmt: skip
    assert worker.code == 0, worker.err
    waited = cli("jobs", "wait", job_id, "--db", db)
    assert (waited.code, waited.out) == (0, "2\n"), waited.err
    logs = cli("jobs", "logs", job_id, "--db", db).out.splitlines()
    assert sorted(logs) == ["[w0] INFO worker 0 of 2", "[w1] INFO worker 1 of 2"]
    assert sorted(used.read_text().split()) == ["0", "1"]
    # the pod's runs show the job's own command, not the runner's wrapper (a trial: `logs
    # --list` and the dashboard showed "echo '::tpupod-job:: started'; ...")
    said = cli("jobs", "submit", "--db", db, "--pod", pod.name, "--", "echo", "hi there")
    assert cli("jobs", "worker", "--db", db, "--pod", pod.name, "--until-empty").code == 0
    listed = cli("logs", "--list", "--pod", pod.name).out
    assert "::tpupod-job::" not in listed and "tpupod.jobs.code" not in listed, listed
    assert "echo 'hi there'" in listed and f"job {job_id}'s code" in listed, listed
    assert said.code == 0
    # nor its marker lines in the run's logs (a trial: '[w0] ::tpupod-job:: started')
    run_logs = cli("logs", "--pod", pod.name).out
    assert "hi there" in run_logs and "::tpupod-job::" not in run_logs, run_logs


def test_a_gang_job_where_w1_fails_fails_the_attempt_naming_w1_and_leaves_nothing(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    leftovers: Callable[[Pod], list[str]],
    tmp_path: Path,
) -> None:
    pod = make_pod(2)
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    code = tmp_path / "gang.py"
    code.write_text(GANG.format(fail=1, sleep=60))
    job_id = cli("jobs", "submit", str(code), "--db", db, "--pod", pod.name).out.strip()
    worker = cli("jobs", "worker", "--db", db, "--pod", pod.name, "--until-empty", timeout=60)
    assert worker.code == 0, worker.err
    assert worker.seconds < 15, worker.err
    shown = json.loads(cli("jobs", "show", job_id, "--json", "--db", db).out)
    assert shown["status"] == "failed"
    assert shown["error"].startswith("w1 "), shown["error"]
    assert "ValueError: bad shard 7" in shown["error"]
    assert leftovers(pod) == []


SLOW = "echo up; sleep 60"


@contextlib.contextmanager
def runner_at_work(
    store: Store, pod: Pod, *args: str
) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A runner for ``pod`` (a process, with ``args``) running a slow gang job on it, once
    the jobs queued before it are done; killed afterwards if the test left it running."""
    job = store.submit(command_job(SLOW, pod=pod.name))
    proc = runner(store.url, "--pod", pod.name, *args)
    try:
        _wait_for(lambda: store.get(job).status is JobStatus.RUNNING, timeout=30)
        yield job, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_cancel_and_timeout_stop_every_worker_of_a_gang_job(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    leftovers: Callable[[Pod], list[str]],
    tmp_path: Path,
) -> None:
    pod = make_pod(2)
    store = Store.open(f"sqlite:///{tmp_path / 'jobs.db'}")
    timed = store.submit(command_job(SLOW, pod=pod.name, timeout=1.5))
    with runner_at_work(store, pod, "--lease", "1.5", "--until-empty") as (cancelled, proc):
        store.cancel(cancelled)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert store.get(timed).status is JobStatus.FAILED
    assert store.get(timed).error == "timed out after 1.5 s"
    assert store.get(cancelled).status is JobStatus.CANCELLED
    assert leftovers(pod) == []
    store.close()


def test_sigterm_to_a_runner_gives_its_job_back(store: Store, db_url: str) -> None:
    job = store.submit(command_job(SLOW))
    proc = runner(db_url, "--local")
    _wait_for(lambda: store.get(job).status is JobStatus.RUNNING)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    back = store.get(job)
    assert back.status is JobStatus.PENDING and back.lease_owner is None


def test_an_idle_runner_wakes_for_a_new_job_at_once(store: Store, db_url: str) -> None:
    """PostgreSQL: NOTIFY wakes it (its own wait is lease/3 = 5 s); SQLite: it polls."""
    proc = runner(db_url, "--local", "--lease", "15")
    try:
        first = store.submit(command_job("true"))  # the runner is up once it has run this
        _wait_for(lambda: store.get(first).status.finished, timeout=60)
        time.sleep(1.0)  # found nothing more, now waiting
        submitted = time.monotonic()
        job = store.submit(command_job("true"))
        _wait_for(lambda: store.get(job).status is not JobStatus.PENDING, timeout=10)
        assert time.monotonic() - submitted < 1.0
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_postgres_restarted_under_load_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path,
    state_home: Path,  # where its runners keep their journals
) -> None:
    with postgres_cluster() as server:  # its own: a restart disturbs no other test
        _restarted_under_load(server, tmp_path)


def _restarted_under_load(server: Postgres, tmp_path: Path) -> None:
    url = new_database(server)
    store = Store.open(url)
    ran = tmp_path / "ran"
    ids = [store.submit(command_job(f"echo $TPUPOD_JOB_ID >> {ran}")) for _ in range(100)]
    runners = [runner(url, "--local", "--until-empty", "--lease", "20") for _ in range(2)]
    with serving(Store.open(url)) as api:
        assert api.get("/jobs", params={"limit": 1}).status_code == 200
        _wait_for(lambda: ran.exists() and len(ran.read_text().split()) > 20, timeout=30)
        server.restart()
        late = api.post("/jobs", json={"command": f"echo $TPUPOD_JOB_ID >> {ran}"})
        assert late.status_code == 201, late.text  # the API's pool reconnected
        ids.append(late.json()["id"])
        errs = []
        for proc in runners:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            errs.append(err)
    assert "job store postgresql://" in "".join(errs)  # the restart was felt, and survived
    assert sorted(int(x) for x in ran.read_text().split()) == ids
    assert store.counts() == {JobStatus.COMPLETED: 101}
    store.close()


@pytest.mark.ssh  # simulated hosts (root); the module's own mark says local
def test_a_gang_job_on_an_ssh_pod_fails_naming_the_worker_and_leaves_nothing(
    make_ssh_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    leftovers: Callable[[Pod], list[str]],
    tmp_path: Path,
) -> None:
    pod = make_ssh_pod(2)
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    failing = (  # one argument: a command line, as `tpupod exec -- '...'` takes it
        'echo "job $TPUPOD_JOB_ID on w$TPUPOD_WORKER_ID"; [ "$TPUPOD_WORKER_ID" = 1 ] && exit 3; '
        "sleep 60"
    )
    job_id = cli("jobs", "submit", "--db", db, "--pod", pod.name, "--", failing).out.strip()
    worker = cli("jobs", "worker", "--db", db, "--pod", pod.name, "--until-empty", timeout=60)
    assert worker.code == 0, worker.err
    shown = json.loads(cli("jobs", "show", job_id, "--json", "--db", db).out)
    assert shown["status"] == "failed"
    assert shown["error"].startswith("w1 ") and "exit 3" in shown["error"], shown["error"]
    logs = cli("jobs", "logs", job_id, "--db", db).out.splitlines()
    assert {f"[w0] job {job_id} on w0", f"[w1] job {job_id} on w1"} <= set(logs)  # w0 also
    assert leftovers(pod) == []  # may say "Terminated": it was stopped when w1 failed
