"""`tpupod dashboard` without a browser: the security rules against a real dashboard process,
and the loading / empty / stale states of a page."""

from __future__ import annotations

import html
import re
import shlex
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from tests.conftest import CliResult
from tests.dashboard_server import TOKEN, Dashboard, dashboard_fixture  # noqa: F401 (a fixture)
from tests.fakes.runs import write_runs
from tpupod.dashboard.app import Config, create_app
from tpupod.dashboard.jobs import Jobs
from tpupod.errors import JobStoreError
from tpupod.jobs.api import listen
from tpupod.jobs.models import JobRequest
from tpupod.jobs.store import Store
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.recovery.record import RecoveryRecord


def test_a_bind_beyond_loopback_without_a_token_is_refused(cli: Callable[..., CliResult]) -> None:
    result = cli("dashboard", "--host", "0.0.0.0", "--port", "1")
    assert result.code == 2, result.err
    assert result.err.startswith("error: the dashboard would listen on 0.0.0.0 without a token")
    assert "hint: add --token T" in result.err and "Traceback" not in result.err


def test_a_foreign_host_header_gets_400(dashboard: Callable[..., Dashboard]) -> None:
    board = dashboard()
    assert board.get("/").status_code == 200
    assert board.get("/", headers={"Host": f"localhost:{board.port}"}).status_code == 200
    rebound = board.get("/api/pods", headers={"Host": f"evil.example:{board.port}"})
    assert rebound.status_code == 400 and "Host" in rebound.json()["detail"]


def test_actions_need_the_token_and_the_same_origin(
    dashboard: Callable[..., Dashboard], state_home: Path
) -> None:
    store = Store.open()
    first, second = store.submit_many([JobRequest(command="true"), JobRequest(command="true")])
    board = dashboard()
    cancel = f"/api/jobs/{first}/cancel"
    assert board.post(cancel).status_code == 401
    wrong = board.post(cancel, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["detail"] == "wrong token"
    foreign = {"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.example"}
    assert board.post(cancel, headers=foreign).status_code == 403
    assert store.get(first).status.value == "pending"  # nothing was done
    own = {"Authorization": f"Bearer {TOKEN}", "Origin": board.url}
    done = board.post(cancel, headers=own)
    assert done.status_code == 200 and done.json()["status"] == "cancelled"
    assert store.get(second).status.value == "pending"
    store.close()


def test_without_a_token_the_dashboard_is_read_only(
    dashboard: Callable[..., Dashboard], state_home: Path
) -> None:
    store = Store.open()
    job = store.submit(JobRequest(command="true"))
    store.close()
    board = dashboard(token=None)
    refused = board.post(f"/api/jobs/{job}/cancel", headers={"Authorization": "Bearer x"})
    assert refused.status_code == 403 and "--token" in refused.json()["detail"]


def test_metrics_are_prometheus_text(
    dashboard: Callable[..., Dashboard], make_pod: Callable[..., object]
) -> None:
    make_pod(2)
    board = dashboard()
    deadline = time.monotonic() + 20
    while "tpupod_worker_up{" not in board.get("/metrics").text and time.monotonic() < deadline:
        time.sleep(0.2)
    families = {f.name: f for f in text_string_to_metric_families(board.get("/metrics").text)}
    ups = [s.value for s in families["tpupod_worker_up"].samples]
    assert ups == [1.0, 1.0]
    assert "tpupod_jobs" in families


def test_a_pod_whose_record_is_broken_is_named_and_the_others_are_sampled(
    dashboard: Callable[..., Dashboard], make_pod: Callable[..., Pod], state_home: Path
) -> None:
    """One emptied pod record failed the whole pods source: the pages showed 'Could not
    read pods' and nothing of the pods that were fine."""
    good = make_pod(2)
    broken = make_pod(1)
    (state_home / "pods" / broken.name / "pod.json").write_text("")
    board = dashboard()
    deadline = time.monotonic() + 20
    while board.get("/api/pods").json()["state"] == "loading" and time.monotonic() < deadline:
        time.sleep(0.2)
    sampled = board.get("/api/pods").json()
    assert sampled["state"] == "ok", sampled  # was: 'error', the record's message
    pods = {p["name"]: p for p in sampled["data"]}
    assert pods[good.name]["reachable"] == 2, pods
    assert "is unreadable" in pods[broken.name]["error"], pods
    page = board.get("/pods").text
    assert f"the record of pod &#39;{broken.name}&#39; is unreadable" in page, page
    assert f'href="/pods/{good.name}"' in page
    assert "is unreadable" in board.get("/").text  # among what is failing


def test_loading_is_not_empty_and_stale_data_says_its_age(state_home: Path) -> None:
    app = create_app(Config())  # no lifespan: the sampler has not run yet
    client = TestClient(app, base_url="http://127.0.0.1")
    page = client.get("/pods").text
    assert 'data-state="loading"' in page and "No pods" not in page
    assert client.get("/api/pods").json()["state"] == "loading"
    feed = app.state.feed  # told what the sampling process would say
    feed.apply({"source": "pods", "data": [], "at": time.time() - 30})
    assert 'data-state="empty"' in client.get("/pods").text
    feed.apply({"source": "pods", "error": "state directory unreadable", "error_at": time.time()})
    page = client.get("/pods").text
    assert "data from 30 s ago; the source failed: state directory unreadable" in page
    assert client.get("/api/pods").json()["state"] == "stale"


def test_a_run_with_retries_lists_its_attempts_and_preemptions(
    dashboard: Callable[..., Dashboard], make_pod: Callable[..., Pod]
) -> None:
    pod = make_pod(2)
    record = RecoveryRecord.new(StateDir(), pod.name, ["python", "train.py"], {})
    first = record.begin_attempt()
    first.cause, first.launch_id, first.ended = "preempted", "20261127-080000-aaaaaa", time.time()
    record.begin_attempt().cause = "ok"
    record.state, record.exit_code = "done", 0
    record.save()
    board = dashboard()
    listed = next(
        r for r in board.get("/api/runs").json()["data"]["runs"] if r["id"] == record.run_id
    )
    assert listed["state"] == "done" and len(listed["attempts"]) == 2
    assert listed["attempts"][0].startswith("attempt 1: preempted")
    page = board.get(f"/runs/{record.run_id}").text
    assert "attempt 1: preempted" in page and "attempt 2: ok" in page
    assert 'href="/runs/20261127-080000-aaaaaa"' in page
    attempts = page.split('id="attempt-list"')[1].split("</table>")[0]
    assert attempts.count("<time datetime=") == 2  # each attempt's start


def sampling_process(board: Dashboard) -> psutil.Process:
    children = psutil.Process(board.proc.pid).children()
    return next(c for c in children if "tpupod.dashboard.sampler" in c.cmdline())


def wait_for_state(
    board: Dashboard, path: str, wanted: str, within: float = 60.0
) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        seen: dict[str, Any] = board.get(path).json()
        if seen["state"] == wanted:
            return seen
        assert time.monotonic() < deadline, f"{path} is {seen['state']}, not {wanted}"
        time.sleep(0.1)


def test_a_killed_sampling_process_is_shown_and_started_again(
    dashboard: Callable[..., Dashboard], make_pod: Callable[..., Pod]
) -> None:
    """The sampler runs apart from the web process (its probes held the GIL against every
    render); if it dies the pages keep their data, say so, and a new one takes over."""
    make_pod(2)
    board = dashboard()
    wait_for_state(board, "/api/pods", "ok")
    first = sampling_process(board)
    first.kill()
    stale = wait_for_state(board, "/api/pods", "stale")
    assert "the sampling process ended" in stale["error"] and len(stale["data"]) == 1
    wait_for_state(board, "/api/pods", "ok")
    assert sampling_process(board).pid != first.pid


def test_a_killed_dashboard_leaves_no_sampling_process(
    dashboard: Callable[..., Dashboard], make_pod: Callable[..., Pod]
) -> None:
    make_pod(1)
    board = dashboard()
    sampler = sampling_process(board)
    board.proc.kill()  # SIGKILL: nothing of the web process runs to stop it
    board.proc.wait()
    sampler.wait(timeout=30)  # it reads EOF on its stdin and ends


def test_job_counts_follow_each_commit_and_skip_the_query_when_nothing_changed(
    state_home: Path,
) -> None:
    """The sampler asks four times a second; on SQLite a count is taken again only after a
    commit (another process's: here another store) changed the database's files."""
    store = Store.open()
    ids = store.submit_many([JobRequest(command="true") for _ in range(3)])
    jobs = Jobs(None)
    assert jobs.counts()["pending"] == 3
    assert jobs.store is not None
    queries: list[str] = []
    event.listen(jobs.store.engine, "before_cursor_execute", lambda *a: queries.append(a[2]))
    assert jobs.counts()["pending"] == 3 and queries == []
    store.cancel(ids[0])
    counts = jobs.counts()
    assert (counts["pending"], counts["cancelled"]) == (2, 1)
    assert [q.split()[0] for q in queries if q != "BEGIN"] == ["SELECT"]
    store.close()
    jobs.store.close()


def test_a_job_store_named_that_is_not_there_is_an_error_not_an_empty_queue(
    state_home: Path, tmp_path: Path
) -> None:
    """'dashboard --db sqlite:////nonexistent/dir/x.db' showed "No jobs" where 'tpupod jobs
    ls --db' with the same URL says there is no store there (a typo, most likely). The
    default store, not made until the first job, is still an empty queue."""
    typo = f"sqlite:///{tmp_path / 'nonexistent' / 'x.db'}"
    with pytest.raises(JobStoreError, match="no job store at"):
        Jobs(typo).page(None, None)
    with pytest.raises(JobStoreError, match="no job store at"):
        Jobs(typo).counts()
    assert not (tmp_path / "nonexistent").exists()
    assert Jobs(None).page(None, None)["jobs"] == []


def test_accepted_connections_send_at_once(state_home: Path) -> None:
    """``jobs.api.listen`` (the dashboard's and the job API's socket) sets TCP_NODELAY, which
    accepted connections inherit; asyncio does not set it on them (their proto is 0), and
    without it a page on a kept connection waited for the client's delayed ACK (measured:
    /serving 46-58 ms a request on httpx keep-alive, 3.4 ms with it; a timing test of that
    passed by chance without the fix, so this checks the option)."""
    listening = listen("127.0.0.1", 0)
    with listening, socket.create_connection(listening.getsockname()[:2]):
        accepted, _ = listening.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


TOKEN_HINT = "hint: make one with: python3 -c 'import secrets; print(secrets.token_urlsafe())'"
BENCH_HINT = "hint: tpupod bench checkpoint --config examples/bench_checkpoint.yaml --output"
PORT_HINT = "hint: a port is 1 to 65535, or 0 for any free one"
INTERVAL_HINT = "hint: sample at most 5 times a second: --interval 0.2 or more"
SPACE = "has a space or a control character"


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--port", "99999"], {}, ["error: --port 99999 is not a port", PORT_HINT]),
        (["--port", "-1"], {}, ["error: --port -1 is not a port", PORT_HINT]),
        (["--interval", "0.01"], {}, ["error: --interval 0.01 is too short", INTERVAL_HINT]),
        (["--token", " "], {}, ["error: --token is blank", TOKEN_HINT]),
        (["--token", "two words"], {}, [f"error: --token {SPACE}", TOKEN_HINT]),
        (["--token", "t\N{EURO SIGN}"], {}, ["error: --token has a character outside ASCII",
                                             TOKEN_HINT]),
        ([], {"TPUPOD_DASHBOARD_TOKEN": "  "}, ["error: $TPUPOD_DASHBOARD_TOKEN is blank",
                                                TOKEN_HINT]),
        (["--bench", "nowhere"], {}, ["error: --bench nowhere: no such folder",
                                      f"{BENCH_HINT} nowhere"]),
    ],
)  # fmt: skip
def test_bad_input_at_start_is_one_error_line_and_one_hint(
    cli: Callable[..., CliResult], args: list[str], env: dict[str, str], said: list[str]
) -> None:
    """--port 99999 was an internal error (bind's OverflowError), --interval 0.01 click's
    three lines, and a blank or unusable token was taken: every action then failed 401."""
    result = cli("dashboard", *args, env=env)
    assert result.code == 2, result.err
    assert result.err.splitlines() == said


def test_an_empty_bench_folder_shows_a_command_that_works(
    dashboard: Callable[..., Dashboard], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """The hint was 'tpupod bench checkpoint SUITE.yaml --output DIR': no such argument."""
    output = tmp_path / "bench"
    output.mkdir()
    board = dashboard(extra=("--bench", str(output)))
    page = board.get("/checkpoints").text
    found = re.search(r"<code>(tpupod bench checkpoint [^<]*)</code>", page)
    assert found, page
    shown = shlex.split(html.unescape(found.group(1)))
    assert shown == ["tpupod", "bench", "checkpoint", "--config", "examples/bench_checkpoint.yaml",
                     "--output", str(output)]  # fmt: skip
    tried = cli(*shown[1:])  # the suite loads and the options parse: it stops at the pod
    assert tried.err.startswith("error: no pods yet"), tried.err


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def this_machines_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for found in addresses:
            if found.family == socket.AF_INET and not found.address.startswith("127."):
                return str(found.address)
    return None


def test_beyond_loopback_every_request_needs_the_token(
    dashboard: Callable[..., Dashboard], make_pod: Callable[..., Pod], state_home: Path
) -> None:
    """Bound beyond loopback, a job's full command and a run's logs were open to anyone who
    could reach the port; only POSTs needed the token."""
    pod = make_pod(1)
    running = write_runs(StateDir(), pod.name, 1, 0)
    store = Store.open()
    job = store.submit(JobRequest(command="train --password hunter2"))
    store.close()
    board = dashboard(extra=("--host", "0.0.0.0"))
    reads = ["/", "/runs", f"/jobs/{job}", f"/api/jobs/{job}", f"/api/jobs/{job}/follow",
             f"/api/runs/{running}/follow", "/api/events", "/metrics"]  # fmt: skip
    for path in reads:
        with httpx.stream("GET", board.url + path, timeout=10) as answer:
            body = answer.read().decode()
        assert answer.status_code == 401, (path, answer.status_code)
        assert "hunter2" not in body and "w0 line" not in body, path
    missing = board.get(f"/api/jobs/{job}").json()["detail"]
    assert missing.startswith("a token is required"), missing
    wrong = board.get(f"/api/jobs/{job}", headers=auth("nope"))
    assert (wrong.status_code, wrong.json()["detail"]) == (401, "wrong token")
    assert board.get(f"/api/jobs/{job}", headers=auth()).json()["command"].endswith("hunter2")
    page = board.get("/")
    assert 'id="signin"' in page.text and page.headers["content-type"].startswith("text/html")
    assert board.get("/static/dashboard.js").status_code == 200  # the sign-in page's script
    # the page's script trades the token for a cookie, which the browser sends with each read
    signed = board.post("/api/session", headers={**auth(), "Origin": board.url})
    assert signed.status_code == 204, signed.text
    cookies = dict(signed.cookies)
    assert board.get(f"/api/jobs/{job}", cookies=cookies).status_code == 200
    with httpx.stream("GET", f"{board.url}/api/runs/{running}/follow", cookies=cookies) as s:
        assert s.status_code == 200
    assert board.get("/", cookies={name: "forged" for name in cookies}).status_code == 401


def test_a_wildcard_bind_answers_to_the_machines_names_and_addresses(
    dashboard: Callable[..., Dashboard],
) -> None:
    """--host 0.0.0.0 accepted only 'Host: 0.0.0.0', which no browser sends."""
    board = dashboard(extra=("--host", "0.0.0.0"))
    names = ["127.0.0.1", "localhost", socket.gethostname(), this_machines_address()]
    for name in filter(None, names):
        answer = board.get("/api/pods", headers={**auth(), "Host": f"{name}:{board.port}"})
        assert answer.status_code == 200, (name, answer.text)
    for foreign in ("evil.example", "10.255.255.254"):
        rebound = board.get("/api/pods", headers={**auth(), "Host": f"{foreign}:{board.port}"})
        assert rebound.status_code == 400, foreign
