"""``tpupod jobs`` as a user meets it: what it refuses and how it says so, what ``show``,
``logs`` and the API print, and the fast path of ``submit`` (the same row as the typer
command, on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text
from typer.testing import CliRunner

import tpupod.cli.jobs  # noqa: F401  (registers `jobs` for CliRunner)
from tests.conftest import CliResult, tpupod_argv
from tests.test_jobs import db_url, postgres  # noqa: F401  (SQLite and PostgreSQL, as there)
from tests.test_jobs_api import serving
from tpupod.base import procfs
from tpupod.base.durations import spoken
from tpupod.cli.app import app
from tpupod.jobs import claims, rows, schema, service
from tpupod.jobs.models import JobStatus
from tpupod.jobs.store import Store

pytestmark = pytest.mark.local

Cli = Callable[..., CliResult]


def _one_error(result: CliResult, code: int, message: str) -> None:
    """Exactly 'error: MESSAGE' and one hint line, exit ``code``, no traceback."""
    assert result.code == code, result.err
    lines = result.err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("hint: "), result.err
    assert lines[0] == f"error: {message}", result.err


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'jobs.db'}"


# -- what show and ls say ----------------------------------------------------------------


def test_a_failed_job_shows_no_attempts_that_will_not_happen(cli: Cli, tmp_path: Path) -> None:
    db = _sqlite(tmp_path)
    job_id = cli("jobs", "submit", "--db", db, "--", "bash", "-c", "exit 3").out.strip()
    assert cli("jobs", "worker", "--db", db, "--local", "--until-empty", "-q").code == 0
    shown = cli("jobs", "show", job_id, "--db", db).out.splitlines()
    assert shown[1] == "  status    failed", shown  # was 'failed (attempt 1 of 3)'
    row = cli("jobs", "ls", "--db", db).out.splitlines()[1].split()
    assert row[1:3] == ["failed", "1"], row  # TRY was '1/3'


def test_a_job_still_running_shows_its_attempt_of_how_many(tmp_path: Path) -> None:
    store = Store.open(_sqlite(tmp_path))
    job_id = store.submit(quick_request("sleep 1"))
    assert claims.claim(store, "r", pod=None, lease_s=30) is not None
    assert service.status_text(store.get(job_id)) == "scheduled (attempt 1 of 3)"
    store.close()


def test_a_leased_job_whose_runner_process_ended_says_so_without_a_write(
    cli: Cli, tmp_path: Path
) -> None:
    """New-user trial: after 'kill -9' of its runner, 'ls' and 'show' called the job
    running until another runner reaped it. Where the runner ran on this machine and its
    process provably ended (its pid is free, or a zombie's) they say so; a runner that is
    alive (a pid in use) or elsewhere is not judged. Nothing is written: a view only."""
    db = _sqlite(tmp_path)
    store = Store.open(db)
    here = socket.gethostname()
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid is free
    killed = subprocess.Popen(["sleep", "60"])
    killed.kill()  # a zombie until it is waited for, as a runner killed under its parent
    _wait_for_zombie(killed.pid)
    owners = {
        f"{here}:{ended.pid}:aa": 3,
        f"{here}:{killed.pid}:bb": 1,  # its last attempt: the next runner fails it
        f"{here}:{os.getpid()}:cc": 3,  # alive: this test
        f"elsewhere:{ended.pid}:dd": 3,  # another machine: only its lease can tell
    }
    ids = {}
    for owner, attempts in owners.items():
        ids[owner] = store.submit(quick_request("sleep 1", max_attempts=attempts))
        assert claims.claim(store, owner, pod=None, lease_s=300) is not None
    before = {owner: store.get(job) for owner, job in ids.items()}
    try:
        listed = cli("jobs", "ls", "--db", db).out.splitlines()
        shown = {o: cli("jobs", "show", str(j), "--db", db).out for o, j in ids.items()}
    finally:
        killed.wait()
    gone = "is gone: its process ended; the next runner"
    [free, zombie, alive, far] = owners
    assert f"scheduled (attempt 1 of 3; runner {free} {gone} requeues it)" in shown[free]
    assert (
        f"  status    scheduled (runner {zombie} {gone} fails it (its last attempt))"
        in (shown[zombie])
    )
    assert gone not in shown[alive] + shown[far], shown
    rows = {int(line.split()[0]): line for line in listed[1:]}
    assert rows[ids[free]].split()[1] == "scheduled", listed  # the column is the store's
    assert rows[ids[free]].endswith(f"(runner {free} {gone} requeues it)"), listed
    assert gone in rows[ids[zombie]] and gone not in rows[ids[alive]] + rows[ids[far]]
    assert {owner: store.get(job) for owner, job in ids.items()} == before  # nothing written
    store.close()


def _wait_for_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    while (found := procfs.stat(pid)) is None or found.alive:
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.01)


def test_show_gives_the_jobs_times_and_each_attempts_start_end_and_length(
    cli: Cli, tmp_path: Path
) -> None:
    """New-user trial: the job's created, started and completed times were only in
    'show --json' (epoch floats), and the attempt that ended the job had no end or
    length ('2: completed on runner R (started T)'). Now 'show' gives them in UTC."""
    db = _sqlite(tmp_path)
    job_id = cli("jobs", "submit", "--db", db, "--", "sleep", "0.3").out.strip()
    assert cli("jobs", "worker", "--db", db, "--local", "--until-empty", "-q").code == 0
    shown = cli("jobs", "show", job_id, "--db", db).out.splitlines()
    job = json.loads(cli("jobs", "show", job_id, "--json", "--db", db).out)
    utc = "%Y-%m-%d %H:%M:%S UTC"
    stamps = {k: time.strftime(utc, time.gmtime(job[k])) for k in ("created_at", "started_at")}
    assert f"  created   {stamps['created_at']}" in shown, shown
    assert f"  started   {stamps['started_at']}" in shown, shown
    ended = time.strftime(utc, time.gmtime(job["completed_at"]))
    ran = spoken(job["completed_at"] - job["started_at"])
    assert f"  ended     {ended} (ran {ran})" in shown, shown
    # a job of more than one attempt: the one that ended it has its span and length
    job_id = cli("jobs", "submit", "--db", db, "--", "sleep", "0.1").out.strip()
    store = Store.open(db)
    assert claims.claim(store, "gone", pod=None, lease_s=300) is not None
    claims.reap(store, dead=frozenset({"gone"}), expired=False)
    with store.write() as conn:  # no backoff to wait out
        conn.execute(schema.jobs.update().values(run_after=0.0))
    store.close()
    assert cli("jobs", "worker", "--db", db, "--local", "--until-empty", "-q").code == 0
    job = json.loads(cli("jobs", "show", job_id, "--json", "--db", db).out)
    shown = cli("jobs", "show", job_id, "--db", db).out.splitlines()
    begin, end = (time.gmtime(job[k]) for k in ("scheduled_at", "completed_at"))
    span = f"{time.strftime('%Y-%m-%d %H:%M:%S', begin)} to {time.strftime('%H:%M:%S', end)}"
    length = spoken(job["completed_at"] - job["scheduled_at"])
    last = f"            2: completed on runner {job['runner']} ({span} UTC, {length})"
    assert last in shown, shown


def quick_request(command: str, **fields: Any) -> Any:
    from tpupod.jobs.models import JobRequest

    return JobRequest(command=command, **fields)


def test_retries_run_a_failing_program_again(cli: Cli, tmp_path: Path) -> None:
    db = _sqlite(tmp_path)
    tries = tmp_path / "tries"
    second_works = f"echo x >> {tries}; test $(wc -l < {tries}) -ge 2"
    flaky = cli("jobs", "submit", "--db", db, "--retries", "2", "--", second_works).out.strip()
    never = cli("jobs", "submit", "--db", db, "--retries", "1", "--", "exit 4").out.strip()
    worker = cli("jobs", "worker", "--db", db, "--local", "--until-empty", timeout=60)
    assert worker.code == 0, worker.err
    assert f"job {flaky} attempt 1: retried" in worker.err
    job = Store.open(db).get(int(flaky))
    assert (job.status, job.attempt, job.retries, job.max_attempts) == (
        JobStatus.COMPLETED,
        2,
        2,
        3,
    )
    shown = cli("jobs", "show", never, "--db", db).out.splitlines()
    assert shown[1] == "  status    failed after 2 attempts", shown  # 1 retry, then no more
    assert shown[-1] == "  error     exit 4: (no output)", shown


def test_retries_need_attempts_to_run_them(cli: Cli, tmp_path: Path) -> None:
    db = _sqlite(tmp_path)
    many = cli("jobs", "submit", "--db", db, "--retries", "5", "--", "true")
    assert Store.open(db).get(int(many.out)).max_attempts == 6  # --max-attempts follows
    _one_error(
        cli("jobs", "submit", "--db", db, "--retries", "3", "--max-attempts", "2", "--", "true"),
        2,
        "retries 3 needs max_attempts of at least 4",
    )


def test_a_store_of_schema_1_gains_retries_and_attempts_on_open(db_url: str) -> None:  # noqa: F811
    store = Store.open(db_url)
    old = store.submit(quick_request("true"))
    with store.write() as conn:  # as tpupod made it before retries (and attempts' history)
        conn.execute(text("DROP INDEX tpupod_jobs_submit_key"))
        for column in ("retries", "runner", "history", "submit_key"):
            conn.execute(text(f"ALTER TABLE {rows.JOBS_TABLE} DROP COLUMN {column}"))
        conn.execute(text(f"UPDATE {rows.VERSION_TABLE} SET version = 1"))
    store.close()
    again = Store.open(db_url)
    job = again.get(old)
    assert (job.retries, job.runner, job.history) == (0, None, ())
    with again.write() as conn:
        assert schema.current_version(conn) == schema.LATEST == 3
    again.close()


# -- refusals and plain messages ------------------------------------------------------------


def test_submit_refuses_a_pod_no_runner_would_serve(cli: Cli, tmp_path: Path) -> None:
    db = _sqlite(tmp_path)
    refused = cli("jobs", "submit", "--db", db, "--pod", "nosuch", "--", "true")
    _one_error(refused, 2, "no pod named 'nosuch': no runner would take the job")
    assert "--remote-pod" in refused.err and refused.out == ""
    elsewhere = cli("jobs", "submit", "--db", db, "--pod", "nosuch", "--remote-pod", "--", "true")
    assert elsewhere.code == 0, elsewhere.err
    assert Store.open(db).get(int(elsewhere.out)).pod == "nosuch"


def test_submit_without_pod_queues_for_any_runner_as_its_help_says(
    cli: Cli, tmp_path: Path
) -> None:
    """The help said --pod defaulted to "the only pod", while a job without --pod went to
    any runner, with one pod or two (and no "which pod?" error). A job without --pod is
    for any runner, on purpose: the store may be shared, and what runs a job should not
    depend on how many pods the submitter's machine has; the help now says so."""
    shown = " ".join(cli("jobs", "submit", "--help").out.split())
    assert "the only pod" not in shown, shown
    assert "(default: none, any runner takes it: a local one or any pod's)" in shown, shown
    db = _sqlite(tmp_path)
    for name in ("one", "two"):
        assert cli("up", "--name", name, "--local", "1").code == 0
        job = cli("jobs", "submit", "--db", db, "--", "true")
        assert job.code == 0, job.err
        assert Store.open(db).get(int(job.out)).pod is None
        assert "  pod       any runner" in cli("jobs", "show", job.out.strip(), "--db", db).out
    for name in ("one", "two"):
        cli("down", "--pod", name)


def test_a_syntax_error_is_refused_at_submit_with_its_line(cli: Cli, tmp_path: Path) -> None:
    db = _sqlite(tmp_path)
    code = tmp_path / "typo.py"
    code.write_text("import time\nx = (1,\nprint(x)\n")
    refused = cli("jobs", "submit", "--db", db, str(code))
    _one_error(refused, 2, f"{code} line 2: '(' was never closed: x = (1,")
    document = tmp_path / "typo.json"
    document.write_text(json.dumps({"code": "x = (1,\n"}))
    _one_error(
        cli("jobs", "submit", "--db", db, str(document)),
        2,
        f"{document}: <job> line 1: '(' was never closed: x = (1,",
    )
    assert not (tmp_path / "jobs.db").exists()  # nothing was queued


def test_an_api_submit_of_code_that_does_not_compile_gets_422(tmp_path: Path) -> None:
    store = Store.open(_sqlite(tmp_path))
    with serving(store) as api:
        refused = api.post("/jobs", json={"code": "def f(:\n    pass\n"})
    assert refused.status_code == 422
    assert "<job> line 1: invalid syntax" in refused.json()["detail"][0]["msg"]
    store.close()


@pytest.mark.parametrize("pool", ["--pool", "--no-pool"])
def test_a_jobs_traceback_shows_the_jobs_frames_not_tpupods(
    cli: Cli, tmp_path: Path, pool: str
) -> None:
    db = _sqlite(tmp_path)
    code = tmp_path / "boom.py"
    code.write_text("x = 1\ndef f():\n    raise ValueError('boom')\nf()\n")
    job_id = cli("jobs", "submit", "--db", db, str(code)).out.strip()
    assert cli("jobs", "worker", "--db", db, "--local", pool, "--until-empty", "-q").code == 0
    logs = cli("jobs", "logs", job_id, "--db", db).out
    assert logs.splitlines() == [
        "Traceback (most recent call last):",
        '  File "<job>", line 4, in <module>',
        "    f()",
        '  File "<job>", line 3, in f',
        "    raise ValueError('boom')",
        "ValueError: boom",
    ], logs
    error = cli("jobs", "show", job_id, "--db", db).out.splitlines()[-1]
    assert error.startswith("  error") and error.endswith(" ValueError: boom"), error


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["show", "abc"], 2, "job id 'abc' is not a number"),
        (["logs", "1x"], 2, "job id '1x' is not a number"),
        (
            ["submit", "--timeout", "-5", "--", "true"],
            2,
            "--timeout -5: must be more than 0 seconds",
        ),
        (["wait", "1", "--timeout", "-5"], 2, "--timeout -5: must be more than 0 seconds"),
        (["submit", "--retries", "-1", "--", "true"], 2, "--retries -1: must be 0 or more"),
        (
            ["ls", "--db", "mysql://me:secret@db/jobs"],
            2,
            "cannot use the job store URL 'mysql://me:***@db/jobs': "
            "jobs are kept in SQLite or PostgreSQL (not mysql)",
        ),
    ],
)
def test_bad_input_gets_a_plain_message(
    cli: Cli, cli_in_process: Cli, args: list[str], code: int, message: str
) -> None:
    run = cli if args[0] == "submit" else cli_in_process  # submit: entry's fast path
    _one_error(run("jobs", *args), code, message)


def test_a_job_that_does_not_exist_is_bad_input(cli_in_process: Cli, tmp_path: Path) -> None:
    """'jobs wait 999' exited 1 where the README says bad input exits 2."""
    db = _sqlite(tmp_path)
    Store.open(db).close()  # a store with no jobs
    for args in (["wait", "999"], ["show", "999"], ["cancel", "999"], ["logs", "999"]):
        result = cli_in_process("jobs", *args, "--db", db)
        assert result.code == 2 and "no job 999" in result.err.splitlines()[0], (args, result)


def test_a_read_of_a_store_that_is_not_there_makes_no_folders(
    cli_in_process: Cli, tmp_path: Path
) -> None:
    where = tmp_path / "typo" / "dir" / "x.db"
    for args in (["ls"], ["show", "1"], ["logs", "1"], ["wait", "1"], ["cancel", "1"]):
        read = cli_in_process("jobs", *args, "--db", f"sqlite:///{where}")
        _one_error(read, 1, f"no job store at {where} (no jobs were submitted to it)")
    assert not (tmp_path / "typo").exists()


def test_ls_on_a_fresh_state_directory_lists_no_jobs(cli_in_process: Cli, tmp_path: Path) -> None:
    """A trial: a newcomer's first 'jobs ls' was 'error: no job store at ...' (exit 1).
    The default store is made by the first submit; an explicit --db naming none is an
    error still (above: a typo)."""
    home = tmp_path / "home"
    listed = cli_in_process("jobs", "ls", env={"TPUPOD_HOME": str(home), "TPUPOD_JOBS_DB": ""})
    assert listed.code == 0, listed.err
    assert listed.out.split() == ["ID", "STATUS", "TRY", "AGE", "POD", "NAME"]
    said = f"tpupod: no jobs yet: the first 'tpupod jobs submit' makes {home}/jobs.db\n"
    assert listed.err == said
    assert not home.exists()


def test_serve_on_a_busy_port_is_one_error_line(cli: Cli, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = cli("jobs", "serve", "--db", _sqlite(tmp_path), "--port", str(port))
    assert served.code == 2, served.err
    errors = [line for line in served.err.splitlines() if not line.startswith("tpupod: ")]
    assert errors == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use",
        f"hint: something else listens there: pick another, --port {port + 1}",
    ], served.err


@pytest.mark.parametrize(("args", "path"), [(["jobs", "serve"], "/jobs"), (["dashboard"], "/")])
def test_port_0_is_a_free_port_and_the_line_says_which(
    tmp_path: Path, state_home: Path, args: list[str], path: str
) -> None:
    """--port 0 (any free port: what a script asks for) printed 'http://127.0.0.1:0/',
    a URL nobody can reach; the line now names the port the service listens on."""
    argv = tpupod_argv(*args, "--db", _sqlite(tmp_path), "--port", "0")
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(r" on http://127\.0\.0\.1:(\d+)/? ", line)
        assert found and found.group(1) != "0", line
        answer = httpx.get(f"http://127.0.0.1:{found.group(1)}{path}", timeout=10)
        assert answer.status_code in (200, 401), answer.text  # the API wants its token
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_runner_without_a_pod_is_offered_local(cli: Cli, tmp_path: Path) -> None:
    started = cli("jobs", "worker", "--db", _sqlite(tmp_path))
    assert started.code == 2 and started.err.startswith("error: no pods yet"), started.err
    assert "'tpupod jobs worker --local'" in started.err.splitlines()[1]


# -- results and logs ----------------------------------------------------------------------


def test_result_is_a_json_value_in_show_json_and_over_http(cli: Cli, tmp_path: Path) -> None:
    db = _sqlite(tmp_path)
    results = {"result = {'answer': 42}\n": {"answer": 42}, "result = '42'\n": "42"}
    ids: list[str] = []
    for source in results:
        code = tmp_path / f"job{len(ids)}.py"
        code.write_text(source)
        ids.append(cli("jobs", "submit", "--db", db, str(code)).out.strip())
    assert cli("jobs", "worker", "--db", db, "--local", "--until-empty", "-q").code == 0
    store = Store.open(db)
    with serving(store) as api:
        for job_id, value in zip(ids, results.values(), strict=True):
            shown = json.loads(cli("jobs", "show", job_id, "--json", "--db", db).out)
            assert shown["result"] == value  # was the string '{"answer": 42}'
            assert api.get(f"/jobs/{job_id}").json()["result"] == value
    assert cli("jobs", "wait", ids[0], "--db", db).out == '{"answer": 42}\n'
    assert cli("jobs", "wait", ids[1], "--db", db).out == "42\n"  # a string prints as is
    store.close()


def _job_with_lines(store: Store, count: int) -> int:
    job_id = store.submit(quick_request("true"))
    claim = claims.claim(store, "r", pod=None, lease_s=60)
    assert claim is not None
    claims.append_logs(store, claim, claim.next_seq, [(0, f"line {i}") for i in range(count)])
    claims.finish(store, claim, JobStatus.COMPLETED)
    return job_id


TWO_ATTEMPTS = (  # the first attempt hangs until its runner is killed; the second ends
    'echo "start $TPUPOD_JOB_ATTEMPT"; '
    'if [ "$TPUPOD_JOB_ATTEMPT" = 1 ]; then sleep 60; fi; echo "end $TPUPOD_JOB_ATTEMPT"'
)
MARKED = ["--- attempt 1 ---", "start 1", "--- attempt 2 ---", "start 2", "end 2"]
HEADER = re.compile(r"--- attempt (\d+) \(runner \S+:\d+:\w+, started [\d-]+ [\d:]+ UTC\) ---")


def plain(lines: list[str]) -> list[str]:
    """``lines`` with each attempt's header as ``--- attempt N ---``: which runner ran an
    attempt and when differs from run to run (each header must name them, though)."""
    out = []
    for line in lines:
        found = HEADER.fullmatch(line)
        assert found is not None or not line.startswith("--- attempt "), line
        out.append(f"--- attempt {found.group(1)} ---" if found else line)
    return out


def job_with_a_lost_runner(cli: Cli, *db: str) -> str:
    """A job whose runner was killed (-9) in its first attempt, run again to the end by
    another runner, as a user meets it; its id."""
    job_id = cli("jobs", "submit", *db, "--", TWO_ATTEMPTS).out.strip()
    runner = subprocess.Popen(
        tpupod_argv("jobs", "worker", *db, "--local", "--lease", "1", "-q"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while "start 1" not in cli("jobs", "logs", job_id, *db).out:
            assert time.monotonic() < deadline, "the first attempt did not start"
            time.sleep(0.1)
    finally:
        runner.kill()
        runner.wait()
    again = cli("jobs", "worker", *db, "--local", "--lease", "1", "--until-empty", "-q")
    assert again.code == 0, again.err
    return job_id


def test_logs_mark_where_each_attempt_begins(cli: Cli, tmp_path: Path) -> None:
    """After a lost runner, attempt 1's and attempt 2's lines came back to back."""
    db = ("--db", _sqlite(tmp_path))
    job_id = job_with_a_lost_runner(cli, *db)
    assert plain(cli("jobs", "logs", job_id, *db).out.splitlines()) == MARKED
    # from an offset inside attempt 2: its mark still says whose lines these are
    assert plain(cli("jobs", "logs", job_id, *db, "--offset", "1").out.splitlines()) == MARKED[2:]
    one = cli("jobs", "submit", *db, "--", "echo once").out.strip()
    assert cli("jobs", "worker", *db, "--local", "--until-empty", "-q").code == 0
    assert cli("jobs", "logs", one, *db).out == "once\n"  # one attempt: nothing to tell apart


def test_a_logs_page_says_where_the_next_one_starts(tmp_path: Path) -> None:
    store = Store.open(_sqlite(tmp_path))
    job_id = _job_with_lines(store, 1234)
    got: list[str] = []
    pages = 0
    with serving(store) as api:
        url: str | None = f"/jobs/{job_id}/logs"
        while url is not None:
            page = api.get(url)
            pages += 1
            got += [line["line"] for line in page.json()]
            nxt = page.links.get("next", {}).get("url")
            assert (nxt is None) == ("x-next-offset" not in page.headers)
            url = nxt
        assert api.get(f"/jobs/{job_id}/logs", params={"limit": 1234}).headers.get("link") is None
    assert got == [f"line {i}" for i in range(1234)] and pages == 3  # 500, 500, 234
    store.close()


def test_logs_without_follow_never_waits_between_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = _sqlite(tmp_path)
    store = Store.open(db)
    job_id = _job_with_lines(store, 12_000)
    store.close()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(asyncio, "sleep", sleep)  # the follower's wait
    printed = CliRunner().invoke(app, ["jobs", "logs", str(job_id), "--db", db])
    assert printed.exit_code == 0, printed.output
    assert printed.output.splitlines() == [f"line {i}" for i in range(12_000)]
    assert slept == []  # it slept 0.2 s after each page of 1,000


# -- the fast path of submit ----------------------------------------------------------------


def test_the_fast_path_knows_the_latest_schema() -> None:
    assert rows.SCHEMA_VERSION == schema.LATEST


def _row(store: Store, job_id: int) -> dict[str, Any]:
    with store.read() as conn:
        row = conn.execute(select(schema.jobs).where(schema.jobs.c.id == job_id)).one()
    values = dict(row._mapping)
    for varying in ("id", "created_at", "updated_at"):
        values.pop(varying)
    assert len(values.pop("submit_key")) == 32  # a new key each submit, unless --key
    return values


TYPER_ONLY = "from tpupod.cli.app import main; main()"  # the console script without fast paths


def test_the_fast_path_and_the_typer_command_store_the_same_row(
    cli: Cli,
    db_url: str,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
    make_pod: Callable[..., Any],
) -> None:
    pod = make_pod(workers=1)
    code = tmp_path / "job.py"
    code.write_text("result = 1\n")
    store = Store.open(db_url)  # the fast path needs the store made
    options = ["--db", db_url, "--pod", pod.name, "--name", "n", "-l", "a=b", "--label", "c=d"]
    options += ["--priority", "5", "--timeout", "2.5", "--max-attempts", "4", "--retries", "1"]
    for what in ([str(code)], ["--", "echo", "a b"]):
        fast = cli("jobs", "submit", *options, *what)
        assert fast.code == 0, fast.err
        typer_made = subprocess.run(
            [sys.executable, "-c", TYPER_ONLY, "jobs", "submit", *options, *what],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert typer_made.returncode == 0, typer_made.stderr
        assert _row(store, int(fast.out)) == _row(store, int(typer_made.stdout))
    assert store.get(int(fast.out)).command == "echo 'a b'"
    store.close()


def test_a_submit_key_given_again_adds_no_second_job(
    cli: Cli,
    db_url: str,  # noqa: F811  (the fixture imported above)
) -> None:
    """A script that did not get a submit's answer (its own process killed, a timeout) sends
    it again with the same --key: the job the first one added, its id, no second job; on
    the fast path, the typer command and the API alike. A key names one job: the same key
    for another command is refused."""
    store = Store.open(db_url)  # the fast path needs the store made
    first = cli("jobs", "submit", "--db", db_url, "--key", "nightly-1", "--", "echo a")
    assert first.code == 0, first.err
    argv = ["jobs", "submit", "--db", db_url, "--key", "nightly-1", "--", "echo a"]
    typer_made = subprocess.run(
        [sys.executable, "-c", TYPER_ONLY, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (typer_made.returncode, typer_made.stdout) == (0, first.out), typer_made.stderr
    keyed = {"Idempotency-Key": "nightly-1"}
    with serving(store) as api:
        again = api.post("/jobs", json={"command": "echo a"}, headers=keyed)
        assert again.json() == {"id": int(first.out)}, again.text
        other = api.post("/jobs", json={"command": "echo b"}, headers=keyed)
        assert other.status_code == 422 and "runs something else" in other.text
    assert [job.id for job in store.find()] == [int(first.out)]
    _one_error(
        cli("jobs", "submit", "--db", db_url, "--key", "nightly-1", "--", "echo b"),
        2,
        f"the submit key 'nightly-1' is job {first.out.strip()}'s, which runs something else",
    )
    _one_error(
        cli("jobs", "submit", "--db", db_url, "--key", "x" * 65, "--", "echo b"),
        2,
        f"the submit key {'x' * 65!r} is not 1 to 64 printable ASCII characters",
    )
    assert len(store.find()) == 1
    store.close()


def test_a_plain_submit_imports_no_framework_and_no_sqlalchemy(
    cli: Cli, tmp_path: Path, state_home: Path
) -> None:
    db = _sqlite(tmp_path)
    Store.open(db).close()
    probe = (
        "import sys\n"
        "from tpupod.cli.entry import main\n"
        f"sys.argv = ['tpupod', 'jobs', 'submit', '--db', {db!r}, '--', 'true']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = {'sqlalchemy', 'typer', 'pydantic'} & set(sys.modules)\n"
        "print('heavy', sorted(heavy), file=sys.stderr)\n"
    )
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert ran.stdout.strip().isdigit(), ran.stderr
    assert ran.stderr.strip() == "heavy []"
