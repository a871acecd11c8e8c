"""The job store's throughput and submit-to-start latency, beside procrastinate.

    .venv/bin/pip install procrastinate==3.10.0   # the anchor (not a tpupod dependency)
    .venv/bin/python benchmarks/jobs.py --jobs 10000

One PostgreSQL cluster of our own on loopback (fsync on, as a real one), the same
machine, the same run:

* drain: N no-op jobs queued, then one worker process drains them (its start counted).
  - procrastinate: an async no-op task, one worker process, concurrency 10.
  - tpupod: ``tpupod jobs worker --local --concurrency 10 --until-empty``, N no-op code
    jobs (``result = None``) in its warm pool, every write fenced.
  - tpupod, queue only: one process claiming, marking running and finishing jobs one
    at a time with nothing run (three commits a job).
  - tpupod, a command job each: ``true`` run as a guarded process group; fewer jobs.
* latency: an idle worker (LISTEN/NOTIFY for both), one job submitted at a time; the
  time from submit to the job's code running: each job writes ``time.time()`` minus
  its submit time to a file, as procrastinate's task does.

``--rounds R`` interleaves the drains (procrastinate, tpupod PostgreSQL, tpupod SQLite,
each round) and reports the median round. SQLite is reported for tpupod too (its
runners poll every 100 ms when idle).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
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


NOOP = "result = None"


def fill(store: Store, count: int, request: JobRequest | None = None) -> None:
    request = request or JobRequest(command="true")
    for start in range(0, count, 1000):
        store.submit_many([request] * min(1000, count - start))


def tpupod_pool_drain(url: str, count: int, concurrency: int) -> float:
    store = Store.open(url)
    fill(store, count, JobRequest(code=NOOP))
    started = time.perf_counter()
    argv = [TPUPOD, "jobs", "worker", "--db", url, "--local", "--until-empty", "-q"]
    subprocess.run([*argv, "--concurrency", str(concurrency)], check=True)
    rate = count / (time.perf_counter() - started)
    assert store.counts() == {JobStatus.COMPLETED: count}, store.counts()
    store.close()
    return rate


def tpupod_start_latency(url: str, samples: int, marks: Path) -> list[float]:
    """Submit to the job's code running (it writes the delay, as procrastinate's task)."""
    store = Store.open(url)
    argv = [TPUPOD, "jobs", "worker", "--db", url, "--local", "--concurrency", "10", "-q"]
    worker = subprocess.Popen(argv)
    time.sleep(3.0)  # started, pool warm, idle
    for i in range(samples):
        sent = time.time()
        code = f"import time\nwith open({str(marks)!r}, 'a') as f:\n"
        code += f"    f.write(f'{{time.time() - {sent!r}}}\\n')\n"
        store.submit(JobRequest(code=code))
        while _count(marks) <= i:
            time.sleep(0.001)
        idle_pause(i)
    worker.terminate()
    worker.wait(30)
    store.close()
    return [float(x) for x in marks.read_text().split()]


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


def tpupod_runner(url: str, count: int, concurrency: int) -> float:
    store = Store.open(url)
    fill(store, count)
    started = time.perf_counter()
    argv = [TPUPOD, "jobs", "worker", "--db", url, "--local", "--until-empty", "-q"]
    subprocess.run([*argv, "--concurrency", str(concurrency)], check=True)
    rate = count / (time.perf_counter() - started)
    assert store.counts() == {JobStatus.COMPLETED: count}
    store.close()
    return rate


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
            idle_pause(i)
    worker.terminate()
    worker.wait(30)
    return [float(x) for x in marks.read_text().split()]


def idle_pause(sample: int) -> None:
    """20-120 ms between samples (the same for both): the worker is idle again, waiting,
    when the next job comes, and a poller's phase is not locked to ours."""
    time.sleep(0.02 + random.Random(sample).random() * 0.1)


def _count(marks: Path) -> int:
    return len(marks.read_text().split()) if marks.exists() else 0


def ms(values: list[float]) -> str:
    p90 = sorted(values)[int(len(values) * 0.9)]
    return f"median {statistics.median(values) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms"


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10000, help="no-op jobs each drain")
    parser.add_argument(
        "--runner-jobs", type=int, default=500, help="jobs the runner drains as commands"
    )
    parser.add_argument(
        "--queue-jobs", type=int, default=2000, help="jobs the queue-only rows drain"
    )
    parser.add_argument("--samples", type=int, default=100, help="latency samples")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved drain rounds")
    parser.add_argument("--concurrency", type=int, default=10, help="both workers'")
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"start: {load()}")
    rows: list[tuple[str, str, str]] = []
    drains: dict[str, list[float]] = {"procrastinate": [], "PostgreSQL": [], "SQLite": []}
    with postgres() as server, tempfile.TemporaryDirectory() as tmp:
        sqlite = lambda name: f"sqlite:///{tmp}/{name}.db"  # noqa: E731
        for r in range(args.rounds):
            db = new_database(server, f"p_drain{r}")
            drains["procrastinate"].append(procrastinate_drain(db, args.jobs))
            db = new_database(server, f"t_drain{r}")
            drains["PostgreSQL"].append(tpupod_pool_drain(db, args.jobs, args.concurrency))
            drains["SQLite"].append(
                tpupod_pool_drain(sqlite(f"drain{r}"), args.jobs, args.concurrency)
            )
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in drains.items()))
        anchor = statistics.median(drains["procrastinate"])
        each = f"{args.jobs:,} no-op jobs, concurrency {args.concurrency}"
        rows.append((f"procrastinate 3.10, {each}", "PostgreSQL", f"{anchor:.0f} jobs/s"))
        for db in ("PostgreSQL", "SQLite"):
            rate = statistics.median(drains[db])
            rows.append(
                (
                    f"tpupod jobs worker --local, {each} (code jobs, warm pool)",
                    db,
                    f"{rate:.0f} jobs/s ({rate / anchor:.2f}x)",
                )
            )
        for db, url in (
            ("PostgreSQL", new_database(server, "t_queue")),
            ("SQLite", sqlite("queue")),
        ):
            rate = tpupod_queue_only(url, args.queue_jobs)
            what = f"tpupod, queue only, {args.queue_jobs:,} jobs one at a time (3 commits each)"
            rows.append((what, db, f"{rate:.0f} jobs/s"))
        for db, url in (
            ("PostgreSQL", new_database(server, "t_runner")),
            ("SQLite", sqlite("runner")),
        ):
            rate = tpupod_runner(url, args.runner_jobs, args.concurrency)
            what = f"tpupod jobs worker --local, {args.runner_jobs} command jobs (`true`)"
            rows.append((what, db, f"{rate:.0f} jobs/s"))
        latency = procrastinate_latency(
            new_database(server, "p_lat"), args.samples, Path(tmp) / "marks"
        )
        rows.append(("procrastinate: submit to the task running", "PostgreSQL", ms(latency)))
        for db, url in (("PostgreSQL", new_database(server, "t_lat")), ("SQLite", sqlite("lat"))):
            started = tpupod_start_latency(url, args.samples, Path(tmp) / f"marks-{db}")
            rows.append(("tpupod: submit to the job's code running", db, ms(started)))
    print(f"end: {load()}")
    print("| measured | database | result |\n| --- | --- | --- |")
    for row in rows:
        print(f"| {' | '.join(row)} |")


if __name__ == "__main__":
    main()
