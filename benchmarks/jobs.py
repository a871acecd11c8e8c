"""The job store's throughput and submit-to-start latency, beside procrastinate.

    .venv/bin/pip install procrastinate==3.10.0   # the anchor (not a tpupod dependency)
    .venv/bin/python benchmarks/jobs.py --jobs 10000

One PostgreSQL cluster of our own on loopback (fsync on, as a real one), the same
machine, the same run:

* drain: N no-op jobs queued, then one worker drains them.
  - procrastinate: an async no-op task, one worker process, concurrency 10.
  - tpupod, queue only: one process claiming, marking running and finishing jobs
    (every write fenced) with nothing run: the store's own cost per job.
  - tpupod runner: ``tpupod jobs worker --local --until-empty``, each job ``true``
    run as a guarded process group (what a job costs end to end); fewer jobs.
* latency: an idle worker (LISTEN/NOTIFY for both), one job submitted at a time;
  the time from submit to the job's start (procrastinate: the task's first line;
  tpupod: the claim, and the job's process running).

SQLite is reported for tpupod too (its runners poll every 100 ms when idle).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common import TPUPOD

from tpupod.jobs import claims
from tpupod.jobs.models import JobRequest, JobStatus
from tpupod.jobs.store import Store

WORKER_CODE = """
import sys, time
from procrastinate import App, PsycopgConnector
app = App(connector=PsycopgConnector(conninfo=sys.argv[1]))
marks = open(sys.argv[2], "a", buffering=1) if len(sys.argv) > 2 else None
@app.task(name="noop")
async def noop(sent=0.0):
    if marks:
        marks.write(f"{time.time() - sent}\\n")
with app.open():
    app.run_worker(concurrency=10, wait=len(sys.argv) > 2, install_signal_handlers=True)
"""


@contextmanager
def postgres() -> Iterator[str]:
    """A cluster in a temporary folder on 127.0.0.1, as the postgres user when we are root."""
    bindir = Path(shutil.which("initdb") or "/usr/lib/postgresql/15/bin/initdb").resolve().parent
    as_pg = ["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else []
    data = Path(tempfile.mkdtemp(prefix="tpupod-bench-pg-"))
    if os.getuid() == 0:
        shutil.chown(data, "postgres", "postgres")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.run(
        [*as_pg, str(bindir / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    pg_ctl = [*as_pg, str(bindir / "pg_ctl"), "-D", str(data / "db"), "-w", "-l", str(data / "log")]
    options = f"-h 127.0.0.1 -p {port} -k {data} -c max_connections=200"
    subprocess.run([*pg_ctl, "-o", options, "start"], check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "stop"], check=False, capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


def new_database(server: str, name: str) -> str:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server}/{name}"


def fill(store: Store, count: int) -> None:
    request = JobRequest(command="true")
    for _ in range(count):
        store.submit(request)


def tpupod_queue_only(url: str, count: int) -> float:
    store = Store.open(url)
    fill(store, count)
    started = time.perf_counter()
    while (claim := claims.claim(store, "bench", pod=None, lease_s=60)) is not None:
        claims.started(store, claim)
        claims.finish(store, claim, JobStatus.COMPLETED)
    rate = count / (time.perf_counter() - started)
    assert store.counts() == {JobStatus.COMPLETED: count}
    store.close()
    return rate


def tpupod_runner(url: str, count: int) -> float:
    store = Store.open(url)
    fill(store, count)
    started = time.perf_counter()
    argv = [TPUPOD, "jobs", "worker", "--db", url, "--local", "--until-empty", "-q"]
    subprocess.run(argv, check=True)
    rate = count / (time.perf_counter() - started)
    assert store.counts() == {JobStatus.COMPLETED: count}
    store.close()
    return rate


def tpupod_latency(url: str, samples: int) -> tuple[list[float], list[float]]:
    store = Store.open(url)
    argv = [TPUPOD, "jobs", "worker", "--db", url, "--local", "-q"]
    worker = subprocess.Popen(argv)
    time.sleep(2.0)  # started and idle
    claimed, running = [], []
    for _ in range(samples):
        job_id = store.submit(JobRequest(command="true"))
        while not (job := store.get(job_id)).status.finished:
            time.sleep(0.001)
        assert job.scheduled_at is not None and job.started_at is not None
        claimed.append(job.scheduled_at - job.created_at)
        running.append(job.started_at - job.created_at)
    worker.terminate()
    worker.wait(30)
    store.close()
    return claimed, running


def procrastinate_drain(url: str, count: int) -> float:
    from procrastinate import App, PsycopgConnector

    app = App(connector=PsycopgConnector(conninfo=url))

    @app.task(name="noop")
    async def noop(sent: float = 0.0) -> None:
        return None

    with app.open():
        app.schema_manager.apply_schema()
        for start in range(0, count, 1000):
            noop.batch_defer(*[{} for _ in range(min(1000, count - start))])
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", WORKER_CODE, url], check=True)
    return count / (time.perf_counter() - started)


def procrastinate_latency(url: str, samples: int, marks: Path) -> list[float]:
    from procrastinate import App, PsycopgConnector

    app = App(connector=PsycopgConnector(conninfo=url))

    @app.task(name="noop")
    async def noop(sent: float = 0.0) -> None:
        return None

    with app.open():
        app.schema_manager.apply_schema()
    worker = subprocess.Popen([sys.executable, "-c", WORKER_CODE, url, str(marks)])
    time.sleep(2.0)
    with app.open():
        for i in range(samples):
            noop.defer(sent=time.time())
            while _count(marks) <= i:
                time.sleep(0.001)
    worker.terminate()
    worker.wait(30)
    return [float(x) for x in marks.read_text().split()]


def _count(marks: Path) -> int:
    return len(marks.read_text().split()) if marks.exists() else 0


def ms(values: list[float]) -> str:
    p90 = sorted(values)[int(len(values) * 0.9)]
    return f"median {statistics.median(values) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jobs", type=int, default=10000, help="jobs to drain (queue only, procrastinate)"
    )
    parser.add_argument(
        "--runner-jobs", type=int, default=2000, help="jobs the tpupod runner drains"
    )
    parser.add_argument("--samples", type=int, default=100, help="latency samples")
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    rows: list[tuple[str, str, str]] = []
    with postgres() as server, tempfile.TemporaryDirectory() as tmp:
        sqlite = lambda name: f"sqlite:///{tmp}/{name}.db"  # noqa: E731
        rows.append(
            (
                "procrastinate 3.10, concurrency 10",
                "PostgreSQL",
                f"{procrastinate_drain(new_database(server, 'p_drain'), args.jobs):.0f} jobs/s",
            )
        )
        for db, url in (
            ("PostgreSQL", new_database(server, "t_queue")),
            ("SQLite", sqlite("queue")),
        ):
            rows.append(
                ("tpupod, queue only", db, f"{tpupod_queue_only(url, args.jobs):.0f} jobs/s")
            )
        for db, url in (
            ("PostgreSQL", new_database(server, "t_runner")),
            ("SQLite", sqlite("runner")),
        ):
            rate = tpupod_runner(url, args.runner_jobs)
            rows.append(("tpupod jobs worker (a process per job)", db, f"{rate:.0f} jobs/s"))
        latency = procrastinate_latency(
            new_database(server, "p_lat"), args.samples, Path(tmp) / "marks"
        )
        rows.append(("procrastinate: submit to start", "PostgreSQL", ms(latency)))
        for db, url in (("PostgreSQL", new_database(server, "t_lat")), ("SQLite", sqlite("lat"))):
            claimed, running = tpupod_latency(url, args.samples)
            rows.append(("tpupod: submit to claim", db, ms(claimed)))
            rows.append(("tpupod: submit to running", db, ms(running)))
    print("| measured | database | result |\n| --- | --- | --- |")
    for row in rows:
        print(f"| {' | '.join(row)} |")


if __name__ == "__main__":
    main()
