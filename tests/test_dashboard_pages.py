"""What the dashboard's pages show beside Ray's and SkyPilot's (issue 36), against a real
dashboard process, real runs and a real job runner: a start time and a duration on every
run, job and attempt; a pod's page lists its runs; a job links to its runs and shows its
result and its code as written; charts have axes and time labels and keep their history
across a restart of the dashboard."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tests.dashboard_server import Dashboard, dashboard_fixture  # noqa: F401 (a fixture)
from tpupod.pod.record import Pod

pytestmark = pytest.mark.timeout(240)

CODE = """import os

print("hello from", os.environ["TPUPOD_WORKER_ID"])
result = {"answer": 42}
"""
TIME = re.compile(r'<time datetime="\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ">')
TOOK = re.compile(r"\d+\.\d s|\d+ min \d\d s")


def test_a_pod_job_links_its_run_and_every_page_says_when_and_how_long(
    cli: Callable[..., CliResult],
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    tmp_path: Path,
) -> None:
    pod = make_pod(2)
    source = tmp_path / "job.py"
    source.write_text(CODE)
    job = cli("jobs", "submit", "--pod", pod.name, "--name", "answer", str(source)).out.strip()
    ran = cli("jobs", "worker", "--pod", pod.name, "--until-empty", "-q", timeout=180)
    assert ran.code == 0, ran.err
    board = dashboard()
    runs = board.get("/api/runs").json()["data"]["runs"]
    assert len(runs) == 1 and runs[0]["job"] == {"id": int(job), "attempt": 1}, runs
    launch = runs[0]["id"]

    page = board.get(f"/jobs/{job}").text
    code = re.search(r'<pre class="command" id="job-code">(.*?)</pre>', page, re.S)
    assert code and html.unescape(code.group(1)) == CODE  # its lines kept (was one line)
    assert '<code id="job-result">{&#34;answer&#34;: 42}</code>' in page
    facts = page.split('id="job-facts"')[1].split("</dl>")[0]
    assert len(TIME.findall(facts)) == 3, facts  # submitted, started, ended
    assert TOOK.search(page.split('id="job-took">')[1]), page
    attempt = page.split('<tr data-attempt="1">')[1].split("</tr>")[0]
    assert f'<a href="/runs/{launch}">{launch}</a>' in attempt and TIME.search(attempt), attempt

    run = board.get(f"/runs/{launch}").text
    assert f'<a href="/jobs/{job}">job {job}</a>, attempt 1' in run
    assert TIME.search(run) and "started" in run

    listed = board.get("/runs").text.split(f'<tr data-run="{launch}"')[1].split("</tr>")[0]
    assert TIME.search(listed) and TOOK.search(listed), listed
    jobs = board.get("/jobs").text.split(f'<tr data-job="{job}">')[1].split("</tr>")[0]
    assert len(TIME.findall(jobs)) == 2 and TOOK.search(jobs), jobs  # submitted, started

    on_pod = board.get(f"/pods/{pod.name}").text
    assert f'<tr data-run="{launch}"' in on_pod.split('id="pod-runs"')[1]


def series(board: Dashboard, key: str) -> list[list[float]]:
    found: list[list[float]] = board.get("/api/charts").json()["series"].get(key, [])
    return found


def test_charts_have_axes_and_keep_their_history_across_a_restart(
    make_pod: Callable[..., Pod], dashboard: Callable[..., Dashboard]
) -> None:
    pod = make_pod(1)
    first = dashboard(interval=0.5)
    key = f"reachable:{pod.name}"
    deadline = time.monotonic() + 60
    while len(series(first, key)) < 3:
        assert time.monotonic() < deadline, "no history"
        time.sleep(0.2)
    drawn = first.get(f"/pods/{pod.name}").text
    chart = drawn.split(f'aria-label="{pod.name}: workers reachable"')[1].split("</svg>")[0]
    labels = re.findall(r'<text class="axis (x|y)"[^>]*>([^<]*)</text>', chart)
    assert [v for axis, v in labels if axis == "y"] == ["0", "0.5", "1"], labels
    times = [v for axis, v in labels if axis == "x"]
    assert len(times) == 3 and all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in times), labels
    before = series(first, key)
    first.proc.terminate()
    first.proc.communicate(timeout=30)
    second = dashboard(interval=0.5)
    kept = series(second, key)
    assert kept[: len(before)] == before, (before, kept)  # was: empty after a restart
