"""`tpupod dashboard` in a real browser (headless Chromium through playwright) against a real
dashboard process: a simulated pod losing a host, a real `tpupod run` where worker 2 raises,
a job store of 1,000 jobs; no console errors; usable at 375 and 1,440 px."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tpupod_argv
from tests.dashboard_server import (  # noqa: F401 (fixtures)
    TOKEN,
    Browser,
    Dashboard,
    browser_fixture,
    dashboard_fixture,
    start,
    start_run,
    stop,
)
from tests.fakes.runs import write_runs
from tests.test_jobs import db_url, postgres  # noqa: F401 (fixtures: SQLite and PostgreSQL)
from tpupod.jobs.models import JobRequest
from tpupod.jobs.store import Store
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod

# a real browser and a real dashboard process: generous under load, bounded
pytestmark = pytest.mark.timeout(180)

PROGRAM = """\
import os, pathlib, sys, time
w = int(os.environ["TPUPOD_WORKER_ID"])
d = pathlib.Path(sys.argv[1])
print(f"w{w} started", flush=True)
while not (d / "go").exists():
    time.sleep(0.02)
print(f"w{w} saw go", flush=True)
while not (d / "fail").exists():
    time.sleep(0.02)
if w == 2:
    print("w2 about to fail", flush=True)
    raise ValueError("worker 2 fails on purpose")
time.sleep(60)
"""


def test_a_killed_host_is_shown_unreachable_within_two_intervals(
    make_ssh_pod: Callable[..., Pod],
    sim_hosts_up: SimPod,
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
) -> None:
    pod = make_ssh_pod(4)
    board = dashboard(interval=2.0)
    seen = browser()
    page = seen.page
    page.goto(f"{board.url}/pods/{pod.name}")
    reach = page.locator("#workers td.reach")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#workers td.reach')]"
        ".filter(td => td.textContent.trim() === 'yes').length === 4",
        timeout=30_000,
    )
    assert reach.count() == 4
    sim_hosts_up.stop_host(3)
    killed = time.monotonic()
    page.locator('#workers tr[data-worker="3"] td.reach', has_text="unreachable").wait_for(
        timeout=20_000
    )
    seconds = time.monotonic() - killed
    assert seconds <= 2 * board.interval + 1.0, seconds  # two intervals, a second to draw
    assert page.locator('#workers tr[data-worker="0"] td.reach').inner_text() == "yes"
    assert not seen.errors


def test_a_run_page_names_worker_2_first_and_follows_logs_live(
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
    tmp_path: Path,
) -> None:
    pod = make_pod(4)
    run = start_run(pod.name, PROGRAM, tmp_path)
    try:
        board = dashboard(interval=1.0)
        seen = browser()
        page = seen.page
        page.goto(f"{board.url}/runs")
        link = page.locator("table a").first
        link.wait_for(timeout=30_000)
        link.click()
        logs = page.locator('#logs pre[data-worker="1"]')
        page.wait_for_function(
            "() => [...document.querySelectorAll('#logs pre')]"
            ".filter(p => p.textContent.includes('started')).length === 4",
            timeout=30_000,
        )
        (tmp_path / "go").touch()
        said = time.monotonic()
        page.wait_for_function(
            "() => document.querySelector('#logs pre[data-worker=\"1\"]')"
            ".textContent.includes('saw go')",
            timeout=10_000,
        )
        seconds = time.monotonic() - said
        assert seconds <= 1.0 + 0.5, seconds  # the 1 s, a half second for the browser
        assert "w1 saw go" in logs.inner_text()
        (tmp_path / "fail").touch()
        run.communicate(timeout=60)
        first = page.locator("#first-failure")
        first.wait_for(timeout=20_000)
        assert first.locator("h2").inner_text().startswith("w2 failed first")
        assert "ValueError: worker 2 fails on purpose" in first.locator("pre").inner_text()
        assert page.locator("#run-workers tbody tr").first.locator("td").first.inner_text() == "w2"
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert not seen.errors


def test_a_thousand_jobs_filter_page_and_cancel(
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
    db_url: str,  # noqa: F811 (the fixture imported above)
) -> None:
    store = Store.open(db_url)
    try:
        see_a_thousand_jobs(store, dashboard(interval=1.0, extra=("--db", db_url)), browser())
    finally:
        store.close()


def see_a_thousand_jobs(store: Store, board: Dashboard, seen: Browser) -> None:
    ids = store.submit_many([JobRequest(command=f"echo {i}", name=f"job-{i}") for i in range(1000)])
    for job in ids[:30]:
        store.cancel(job)
    page = seen.page
    page.goto(f"{board.url}/jobs")
    rows = page.locator("#job-list tbody tr")
    assert rows.count() == 50
    assert rows.first.get_attribute("data-job") == str(ids[-1])
    page.locator("nav.pager a[rel=next]").click()
    page.wait_for_url(f"**before={ids[-50]}")
    assert rows.first.get_attribute("data-job") == str(ids[-51])
    assert rows.count() == 50
    page.locator('nav.filters a[data-status="cancelled"]').click()
    page.wait_for_url("**status=cancelled")
    assert rows.count() == 30
    assert set(page.locator("#job-list td.status").all_inner_texts()) == {"cancelled"}
    assert page.locator("nav.pager a[rel=next]").count() == 0  # 30: one page

    page.goto(f"{board.url}/jobs")
    page.on("dialog", lambda dialog: dialog.accept())  # "Cancel job N (name)?"
    target = ids[-1]
    row = page.locator(f'#job-list tr[data-job="{target}"]')
    row.locator("button").click()
    page.locator("#action-result", has_text="401").wait_for(timeout=10_000)
    assert store.get(target).status.value == "pending"
    page.fill("#token", TOKEN)
    page.dispatch_event("#token", "change")
    row.locator("button").click()
    page.locator("#action-result", has_text="done").wait_for(timeout=10_000)
    assert store.get(target).status.value == "cancelled"
    row.locator("td.status", has_text="cancelled").wait_for(timeout=10_000)
    assert not [e for e in seen.errors if "401" not in e]  # the refused POST is logged


def test_every_page_usable_at_375_and_1440_px_without_console_errors(
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
) -> None:
    pod = make_pod(2)
    Store.open().submit(JobRequest(command="true", name="a job with a rather long name"))
    board = dashboard(interval=1.0)
    seen = browser()
    page = seen.page
    paths = ["/", "/pods", f"/pods/{pod.name}", "/runs", "/serving", "/jobs", "/jobs/1", "/charts"]
    for width in (375, 1440):
        page.set_viewport_size({"width": width, "height": 800})
        for path in paths:
            page.goto(board.url + path)
            page.locator("main h1").wait_for()
            wide = page.evaluate("document.documentElement.scrollWidth")
            assert wide <= width, f"{path} at {width} px is {wide} px wide"
            assert page.locator("header nav a").first.is_visible()
    assert not seen.errors, seen.errors


JOB = "echo first; while [ ! -e {go} ]; do sleep 0.02; done; echo after go; echo last"


def test_a_job_page_follows_its_log_live(
    dashboard: Callable[..., Dashboard], browser: Callable[[], Browser], tmp_path: Path
) -> None:
    store = Store.open()
    job = store.submit(JobRequest(command=JOB.format(go=tmp_path / "go"), name="follow"))
    store.close()
    runner = subprocess.Popen(
        tpupod_argv("jobs", "worker", "--local", "--until-empty", "--quiet"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        board = dashboard(interval=1.0)
        seen = browser()
        page = seen.page
        page.goto(f"{board.url}/jobs/{job}")
        log = page.locator("#logs pre")
        page.wait_for_function(
            "() => document.querySelector('#logs pre').textContent.includes('first')",
            timeout=30_000,
        )
        (tmp_path / "go").touch()
        said = time.monotonic()
        page.wait_for_function(
            "() => document.querySelector('#logs pre').textContent.includes('after go')",
            timeout=10_000,
        )
        seconds = time.monotonic() - said
        assert seconds <= 1.0 + 0.5, seconds
        page.locator("b.status", has_text="completed").wait_for(timeout=20_000)
        assert log.inner_text().splitlines() == ["first", "after go", "last"]
        assert page.locator("#attempts tbody tr").count() == 1
        runner.communicate(timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
    assert not seen.errors, seen.errors


def test_stop_a_run_from_its_page_with_the_token(
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
) -> None:
    pod = make_pod(2)
    argv = ["run", "--pod", pod.name, "--grace", "1", "--", "echo up; sleep 60"]
    run = subprocess.Popen(tpupod_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        board = dashboard(interval=1.0)
        seen = browser()
        page = seen.page
        page.goto(f"{board.url}/runs")
        page.locator("table a").first.click()
        page.locator('#logs pre[data-worker="1"]', has_text="up").wait_for(timeout=30_000)
        page.fill("#token", TOKEN)
        page.dispatch_event("#token", "change")
        page.on("dialog", lambda dialog: dialog.accept())  # "Stop run ID on every worker?"
        page.locator("form[data-action] button", has_text="stop the run").click()
        page.locator("#action-result", has_text="done").wait_for(timeout=10_000)
        _, err = run.communicate(timeout=30)
        assert "interrupted" in err.decode()
        page.locator("#run-state", has_text="stopped").wait_for(timeout=10_000)  # not failed
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert not seen.errors, seen.errors


def suite_results(output: Path) -> Path:
    """A results folder as `tpupod bench checkpoint` leaves it: results.json and its plots."""
    from tpupod.bench import baseline
    from tpupod.bench.plots import write_plots
    from tpupod.bench.results import CombinationResult, RepeatStats, Results, Status

    def combo(i: int, flag: bool) -> CombinationResult:
        speeds = {"save_gbps": 0.5 + i, "restore_gbps": 2.0 + i}
        return CombinationResult(
            index=i, label=f"async={flag}", generator="orbax.PyTreeCheckpointBenchmark",
            options={"async_enabled": flag}, swept={"async_enabled": flag}, mesh=None,
            checkpoint=0, status=Status.OK,
            repeats={m: RepeatStats(mean=v, std=0.01) for m, v in speeds.items()},
        )  # fmt: skip

    combos = [combo(i, flag) for i, flag in enumerate((True, False))]
    results = Results(
        suite_name="Small suite", launch_id="20261127-080000-abcdef", started="now",
        seconds=3.0, commit="c", pod="dev", workers=2, machine={}, versions={}, config={},
        combinations=combos,
    )  # fmt: skip
    folder = Path(baseline.suite_dir(str(output), results.suite_name)) / results.launch_id
    folder.mkdir(parents=True)
    (folder / baseline.RESULTS_FILE).write_text(results.model_dump_json())
    write_plots(results, str(folder))
    return folder


def test_checkpoint_results_with_their_plots(
    dashboard: Callable[..., Dashboard], browser: Callable[[], Browser], tmp_path: Path
) -> None:
    folder = suite_results(tmp_path / "bench")
    board = dashboard(extra=("--bench", str(tmp_path / "bench")))
    seen = browser()
    page = seen.page
    page.goto(f"{board.url}/checkpoints")
    page.locator("#checkpoint-runs a", has_text=folder.name).click()
    rows = page.locator("#combinations tbody tr")
    assert rows.count() == 2
    assert rows.first.inner_text().split("\t") == ["async=True", "ok", "2", "0.5"]
    image = page.locator("figure.plot img").first
    image.wait_for()
    page.wait_for_function("() => document.querySelector('figure.plot img').naturalWidth > 0")
    assert board.get(f"/checkpoints/{folder.parent.name}/{folder.name}/../x.png").status_code == 404
    assert not seen.errors, seen.errors


def test_open_signs_in_with_a_base64_token_beyond_loopback(
    dashboard: Callable[..., Dashboard], browser: Callable[[], Browser], tmp_path: Path
) -> None:
    """--open put the token in the URL unquoted and the page read a base64 token's '+' as a
    space: every action failed 401. Bound beyond loopback the page itself needs the token:
    the fragment signs the browser in (a cookie), and other pages and actions follow."""
    token = "Ab+Cd/Ef+gh/IJ=="
    opened = tmp_path / "opened"
    fake_browser = tmp_path / "browser.sh"  # what webbrowser runs when $BROWSER names it
    fake_browser.write_text(
        f'#!/bin/sh\nprintf "%s" "$1" > {opened}.part && mv {opened}.part {opened}\n'
    )
    fake_browser.chmod(0o755)
    store = Store.open()
    job = store.submit(JobRequest(command="sleep 60", name="to cancel"))
    try:
        board = dashboard(
            token=token, extra=("--host", "0.0.0.0", "--open"), env={"BROWSER": str(fake_browser)}
        )
        url = opened.read_text()
        assert url.startswith(f"http://127.0.0.1:{board.port}/#token="), url
        seen = browser()
        page = seen.page
        page.on("dialog", lambda dialog: dialog.accept())
        page.goto(url)
        page.locator("main h1", has_text="Overview").wait_for(timeout=20_000)
        assert "token" not in page.url  # the fragment is gone from the address bar
        page.goto(f"{board.url}/jobs")  # the session goes on
        page.locator(f'#job-list tr[data-job="{job}"] button').click()
        page.locator("#action-result", has_text="done").wait_for(timeout=10_000)
        assert store.get(job).status.value == "cancelled"
    finally:
        store.close()
    # the first load of the page is the sign-in page, served with 401 (Chromium logs that)
    assert [e for e in seen.errors if "401" not in e] == [], seen.errors


def test_a_wrong_token_on_the_sign_in_page_says_so(
    dashboard: Callable[..., Dashboard], browser: Callable[[], Browser]
) -> None:
    board = dashboard(extra=("--host", "0.0.0.0"))
    seen = browser()
    page = seen.page
    page.goto(f"{board.url}/runs")
    page.fill("#signin-token", "not the token")
    page.locator("#signin button").click()
    page.locator("#action-result", has_text="wrong token").wait_for(timeout=10_000)
    page.fill("#signin-token", TOKEN)
    page.locator("#signin button").click()
    page.locator("main h1", has_text="Runs").wait_for(timeout=10_000)
    assert page.url == f"{board.url}/runs"
    assert [e for e in seen.errors if "401" not in e] == []  # the refused sign-in is logged


def pane_lines(page: Any, worker: int) -> list[str]:
    text: str = page.locator(f'#logs pre[data-worker="{worker}"]').inner_text()
    return text.splitlines()


def test_a_reconnected_page_repeats_no_line_and_says_while_it_is_away(
    make_pod: Callable[..., Pod], browser: Callable[[], Browser], state_home: Path
) -> None:
    """After a reconnect the page appended the whole log again (141 lines twice), and
    nothing said it had been disconnected."""
    pod = make_pod(2)
    running = write_runs(StateDir(), pod.name, 2, 0)  # 20 lines a worker; stays running
    log = StateDir().pod_dir(pod.name) / "runs" / running / "w0.log"
    first = start()
    try:
        seen = browser()
        page = seen.page
        page.goto(f"{first.url}/runs/{running}")
        page.locator('#logs pre[data-worker="0"]', has_text="w0 line 19").wait_for(timeout=30_000)
        assert page.locator("#connection").is_hidden()
    finally:
        stop(first)  # the dashboard goes away
    page.locator("#connection").wait_for(state="visible", timeout=10_000)
    with log.open("a") as file:
        file.write("written while it was away\n")
    second = start(port=first.port)  # and comes back on the same address
    try:
        pane = page.locator('#logs pre[data-worker="0"]', has_text="written while it was away")
        pane.wait_for(timeout=30_000)
        page.locator("#connection").wait_for(state="hidden", timeout=10_000)
        lines = pane_lines(page, 0)
        assert lines == [*(f"w0 line {k}" for k in range(20)), "written while it was away"]
    finally:
        stop(second)
    # what the browser logs of the gap: the streams' failed reconnects while it was away
    assert [e for e in seen.errors if "ERR_CONNECTION_REFUSED" not in e] == [], seen.errors


def test_logs_follow_the_end_unless_scrolled_up_search_and_download(
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
) -> None:
    pod = make_pod(1)
    running = write_runs(StateDir(), pod.name, 1, 0)
    log = StateDir().pod_dir(pod.name) / "runs" / running / "w0.log"
    with log.open("a") as file:
        file.write("".join(f"step {k} loss {k / 10}\n" for k in range(200)))
    board = dashboard()
    seen = browser()
    page = seen.page
    page.goto(f"{board.url}/runs/{running}")
    pane = page.locator('#logs pre[data-worker="0"]')
    pane.filter(has_text="step 199 loss").wait_for(timeout=30_000)
    at_end = "p => p.scrollTop + p.clientHeight >= p.scrollHeight - 4"
    assert pane.evaluate("p => p.scrollHeight > p.clientHeight")  # it scrolls
    assert pane.evaluate(at_end)  # opened at the end
    with log.open("a") as file:
        file.write("step 200 loss 20\n")
    pane.filter(has_text="step 200 loss").wait_for(timeout=10_000)
    assert pane.evaluate(at_end)  # and kept there while following
    pane.evaluate("p => { p.scrollTop = 0; p.dispatchEvent(new Event('scroll')); }")
    with log.open("a") as file:
        file.write("step 201 loss 20.1\n")
    pane.filter(has_text="step 201 loss").wait_for(timeout=10_000)
    assert pane.evaluate("p => p.scrollTop") == 0  # the user's place is kept
    page.fill("#log-search", "LOSS 1")  # any case
    kept = log.read_text().splitlines()
    wanted = [line for line in kept if "loss 1" in line]
    assert pane_lines(page, 0) == wanted and len(wanted) == 110
    assert page.locator("#log-matches").inner_text() == "110 matching lines shown"
    page.fill("#log-search", "")
    assert len(pane_lines(page, 0)) == 222  # 20 + 202: the whole tail again
    with page.expect_download() as download:
        page.locator("#logs a.download").first.click()
    assert Path(download.value.path()).read_bytes() == log.read_bytes()
    assert download.value.suggested_filename == f"{running}-w0.log"
    assert not seen.errors, seen.errors


def test_a_cancel_asks_first_and_a_no_does_nothing(
    dashboard: Callable[..., Dashboard], browser: Callable[[], Browser]
) -> None:
    """Stop, cancel and restart acted on one click."""
    store = Store.open()
    job = store.submit(JobRequest(command="sleep 60", name="keep me"))
    try:
        board = dashboard()
        seen = browser()
        page = seen.page
        page.goto(f"{board.url}/jobs/{job}")
        page.fill("#token", TOKEN)
        page.dispatch_event("#token", "change")
        asked: list[str] = []

        def answer(dialog: Any) -> None:
            asked.append(dialog.message)
            dialog.dismiss()

        page.once("dialog", answer)
        page.locator("form[data-action] button", has_text="cancel").click()
        assert asked == [f"Cancel job {job} (keep me)?"]
        assert page.locator("#action-result").inner_text() == ""  # nothing was sent
        assert store.get(job).status.value == "pending"
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator("form[data-action] button", has_text="cancel").click()
        page.locator("#action-result", has_text="done").wait_for(timeout=10_000)
        assert store.get(job).status.value == "cancelled"
    finally:
        store.close()
    assert not seen.errors, seen.errors
