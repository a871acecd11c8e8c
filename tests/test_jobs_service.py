"""The job service as library calls (what the CLI and the dashboard call), on SQLite and
PostgreSQL: pages of a filtered list, one job with its attempts, counts per status, the
log follower, waiting, and running a runner without the CLI."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_jobs import command_job, db_url, postgres  # noqa: F401  (both databases)
from tpupod.errors import JobError
from tpupod.jobs import service
from tpupod.jobs.models import AttemptLines, JobStatus
from tpupod.jobs.runnerflow import RunnerOptions, run_runner
from tpupod.jobs.store import Store

pytestmark = pytest.mark.local  # a database server and job processes


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:  # noqa: F811
    opened = Store.open(db_url)
    yield opened
    opened.close()


def _run_all(store: Store) -> int:
    """Run every queued job here, as ``tpupod jobs worker --local --until-empty`` does."""
    return run_runner(RunnerOptions(db=store.url, local=True, until_empty=True, pool=False))


def test_a_filtered_list_comes_in_pages_newest_first(store: Store) -> None:
    ids = [
        store.submit(command_job("true", labels={"team": "ml" if i % 3 else "infra"}))
        for i in range(10)
    ]
    store.cancel(ids[4])
    wanted = [i for n, i in enumerate(ids) if n % 3 and n != 4][::-1]  # team=ml, pending
    seen, before, pages = [], None, 0
    while True:
        page = service.list_jobs(
            store,
            statuses=[JobStatus.PENDING],
            labels={"team": "ml"},
            before=before,
            limit=2,
        )
        seen += [job.id for job in page.jobs]
        pages += 1
        if page.next_before is None:
            break
        before = page.next_before
    assert seen == wanted and pages == 3  # 2, 2, 1: the last page says it is the last
    assert service.list_jobs(store, limit=10).next_before is None  # exactly 10: no next page


def test_one_job_with_its_attempts_and_the_counts_per_status(store: Store) -> None:
    flaky = store.submit(command_job("echo try $TPUPOD_JOB_ATTEMPT; exit 3", retries=1))
    fine = store.submit(command_job("echo a; echo b"))
    assert service.status_counts(store) == {s: 2 if s == "pending" else 0 for s in JobStatus}
    assert service.job_detail(store, flaky).attempts == []  # not run yet
    assert _run_all(store) == 3  # attempts: the flaky one's retry too
    detail = service.job_detail(store, flaky)
    assert detail.job.status is JobStatus.FAILED and detail.job.attempt == 2
    assert detail.attempts == [AttemptLines(1, 1, 1, 1, 1), AttemptLines(2, 1, 2, 2, 1)]
    assert [line.line for line in store.logs(flaky)] == ["try 1", "try 2"]
    assert service.job_detail(store, fine).attempts == [AttemptLines(1, 2, 1, 2, 1)]
    counts = service.status_counts(store)
    assert (counts[JobStatus.COMPLETED], counts[JobStatus.FAILED], counts[JobStatus.PENDING]) == (
        1,
        1,
        0,
    )
    with pytest.raises(JobError, match=f"job {flaky} failed: exit 3"):
        service.wait(store, flaky)
    assert service.wait(store, fine).status is JobStatus.COMPLETED


def test_the_follower_reads_every_page_once_and_ends_with_the_job(store: Store) -> None:
    """The one follower the CLI's ``logs -f`` and the API's SSE stream use: pages written
    already come back to back; a running job is read until it ends, then every line is there."""
    job = store.submit(command_job("for i in $(seq 1 25); do echo $i; done; sleep 0.3; echo end"))
    assert list(service.log_pages(store, job)) == []  # nothing yet, and it does not wait

    async def follow() -> list[list[str]]:
        return [[line.line for line in page] async for page in service.follow(store, job, page=10)]

    with ThreadPoolExecutor(1) as thread:  # the follower beside a runner (signals: main thread)
        following = thread.submit(asyncio.run, follow())
        assert _run_all(store) == 1
        pages = following.result(timeout=60)
    assert [line for page in pages for line in page] == [*map(str, range(1, 26)), "end"]
    assert all(len(page) <= 10 for page in pages)
    again = [[line.seq for line in page] for page in service.log_pages(store, job, after=20)]
    assert again == [[21, 22, 23, 24, 25, 26]]  # from an offset, without the ones before
