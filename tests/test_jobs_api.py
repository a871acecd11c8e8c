"""The job API over real HTTP (uvicorn on loopback, httpx): tokens, validation, and a log
follow that reconnects from its offset without missing or repeating a line."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from tpupod.jobs import claims
from tpupod.jobs.api import create_app
from tpupod.jobs.models import JobStatus
from tpupod.jobs.store import Store

pytestmark = pytest.mark.local  # a server on loopback

TOKEN = "test-token-not-secret"


@pytest.fixture
def store(tmp_path: Path, state_home: Path) -> Iterator[Store]:
    """A store of the test's own; its runners keep their journals in its state directory."""
    opened = Store.open(f"sqlite:///{tmp_path / 'jobs.db'}")
    yield opened
    opened.close()


@contextmanager
def serving(store: Store) -> Iterator[httpx.Client]:
    """The API on a free loopback port (uvicorn in a thread), and a client with the token."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(store, TOKEN), host="127.0.0.1", port=port, log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def api(store: Store) -> Iterator[httpx.Client]:
    with serving(store) as client:
        yield client


def test_no_token_or_a_wrong_one_gets_401(api: httpx.Client) -> None:
    bare = httpx.get(f"{api.base_url}/jobs")
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(f"{api.base_url}/jobs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_bad_payloads_get_422_naming_the_field(api: httpx.Client) -> None:
    bad_timeout = api.post("/jobs", json={"command": "true", "timeout": -1})
    assert bad_timeout.status_code == 422
    assert bad_timeout.json()["detail"][0]["loc"] == ["body", "timeout"]
    both = api.post("/jobs", json={"command": "true", "code": "x = 1"})
    assert both.status_code == 422
    assert "exactly one of code and command" in both.json()["detail"][0]["msg"]


def test_a_job_for_a_pod_no_runner_would_serve_is_refused(
    api: httpx.Client, store: Store, state_home: Path
) -> None:
    """POST /jobs with a pod that does not exist got 201, and the job waited forever;
    'tpupod jobs submit --pod nope' refuses it unless the pod's runner is elsewhere."""
    refused = api.post("/jobs", json={"command": "echo hi", "pod": "nope"})
    assert refused.status_code == 422, refused.text
    assert "no pod named 'nope': no runner would take the job" in refused.json()["detail"]
    assert store.find(statuses=[], labels={}, since=None, limit=10) == []
    elsewhere = api.post("/jobs?remote_pod=true", json={"command": "echo hi", "pod": "nope"})
    assert elsewhere.status_code == 201 and store.get(elsewhere.json()["id"]).pod == "nope"
    anywhere = api.post("/jobs", json={"command": "echo hi"})
    assert anywhere.status_code == 201


def test_half_a_surrogate_pair_is_a_422_that_names_it(api: httpx.Client, store: Store) -> None:
    """JSON may escape half a UTF-16 surrogate pair ("\\ud800"); the store's database
    cannot hold it, and FastAPI's own 422 (which echoes the input) could not encode it:
    each was a 500 and a dropped connection. Now a 422 saying what is wrong, in JSON."""
    before = store.counts()

    def post(body: bytes) -> httpx.Response:
        return api.post("/jobs", content=body, headers={"content-type": "application/json"})

    for body in (
        b'{"command": "echo \\ud800"}',
        b'{"command": "echo hi", "name": "n\\udfff"}',
        b'{"command": "echo hi", "labels": {"team": "\\ud83d"}}',
        b'{"command": "echo hi", "timeout": -1, "name": "\\ud800"}',  # FastAPI's own 422
    ):
        response = post(body)
        assert response.status_code == 422, (body, response.text)
        detail = response.json()["detail"]
        assert detail and all("msg" in d for d in detail), detail
    said = post(b'{"command": "echo \\ud800"}').json()["detail"][0]["msg"]
    assert "\\ud800 is half of a UTF-16 surrogate pair" in said, said
    assert store.counts() == before
    whole = post(b'{"command": "echo \\ud83d\\ude00"}')  # one emoji
    assert whole.status_code == 201, whole.text


def test_submit_list_read_and_cancel(api: httpx.Client) -> None:
    seed = {"challenge_number": 1, "code": "result = 1", "timeout": 60, "status": "pending"}
    created = api.post("/jobs", json=seed)
    assert created.status_code == 201
    job_id = created.json()["id"]
    labelled = api.post("/jobs", json={"command": "true", "labels": {"team": "a"}}).json()["id"]
    job = api.get(f"/jobs/{job_id}").json()
    assert job["status"] == "pending" and job["metadata"]["challenge_number"] == 1
    assert [j["id"] for j in api.get("/jobs", params={"label": "team=a"}).json()] == [labelled]
    assert api.get("/jobs", params={"label": "team"}).status_code == 422
    assert api.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    pending = api.get("/jobs", params={"status": "pending"}).json()
    assert [j["id"] for j in pending] == [labelled]
    assert api.get("/jobs/999").status_code == 404


def _events(lines: Iterator[str], count: int | None) -> list[tuple[str, str, str]]:
    """(event, id, data) of a stream's next events, ``count`` of them (None: to its end)."""
    found: list[tuple[str, str, str]] = []
    fields: dict[str, str] = {}
    for raw in lines:
        if raw:
            name, _, value = raw.partition(": ")
            fields[name] = value
            continue
        found.append((fields.get("event", ""), fields.get("id", ""), fields.get("data", "")))
        fields = {}
        if count is not None and len(found) == count:
            break
    return found


def test_a_follow_that_reconnects_with_its_offset_gets_every_line_once(
    api: httpx.Client, store: Store
) -> None:
    job_id = api.post("/jobs", json={"command": "true"}).json()["id"]
    claim = claims.claim(store, "runner", pod=None, lease_s=60)
    assert claim is not None
    seq = claims.append_logs(store, claim, claim.next_seq, [(0, f"line {i}") for i in range(3)])
    with api.stream("GET", f"/jobs/{job_id}/logs", params={"follow": True}) as first:
        got = _events(first.iter_lines(), 2)  # the client drops after two lines
    last_id = got[-1][1]
    seq = claims.append_logs(store, claim, seq, [(1, "line 3"), (0, "line 4")])
    headers = {"Last-Event-ID": last_id}
    with api.stream("GET", f"/jobs/{job_id}/logs?follow=true", headers=headers) as again:
        stream = again.iter_lines()
        got += _events(stream, 3)
        claims.finish(store, claim, JobStatus.COMPLETED)
        got += _events(stream, None)
    lines = [json.loads(data)["line"] for event, _, data in got if event == "line"]
    assert lines == [f"line {i}" for i in range(5)]
    assert got[-1] == ("end", "", json.dumps({"status": "completed"}))
    plain = api.get(f"/jobs/{job_id}/logs", params={"offset": 3}).json()
    assert [(x["seq"], x["worker"], x["line"]) for x in plain] == [
        (4, 1, "line 3"),
        (5, 0, "line 4"),
    ]
