"""What `tpupod status` and the dashboard's run page show of a run's progress and stacks
(issue 40): real `tpupod run`s of programs that call tpupod.heartbeat on a local pod, the
CLI as a user runs it, a real dashboard process over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.conftest import CliResult, end_run, tpupod_argv
from tests.dashboard_server import (  # noqa: F401 (fixtures)
    TOKEN,
    Browser,
    Dashboard,
    browser_fixture,
    dashboard_fixture,
)
from tpupod.launch.standing import HEARTBEAT, LINE, START, WorkerStanding
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir

pytestmark = pytest.mark.timeout(180)
T = TypeVar("T")

# Every worker beats each step (a marker a second at most); at step STOP, w1 waits in a
# data loader forever, and with "all" the others wait in a collective at the same step.
PROGRAM = """\
import os, sys, time
import tpupod

STOP, ALL = int(sys.argv[1]), sys.argv[2] == "all"
ME = int(os.environ["TPUPOD_WORKER_ID"])


def next_batch():
    time.sleep(600)


def all_reduce():
    time.sleep(600)


step = 0
while True:
    step += 1
    tpupod.heartbeat(step)
    if step == STOP and ME == 1:
        next_batch()
    if step == STOP and ALL:
        all_reduce()
    time.sleep(0.05)
"""
# no heartbeat: w0 prints a line, w1 prints nothing
SILENT = """\
import os, time
if os.environ["TPUPOD_WORKER_ID"] == "0":
    print("loading the data", flush=True)
time.sleep(600)
"""


def start_run(
    pod: Pod, folder: Path, program: str, *args: str, options: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    """`tpupod run` of ``program`` on every worker, as a user starts one."""
    path = folder / "prog.py"
    path.write_text(program)
    argv = ["run", "--pod", pod.name, *options, "--", sys.executable, str(path), *args]
    return subprocess.Popen(
        tpupod_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(name="running")
def running_fixture() -> Iterator[Callable[[subprocess.Popen[str]], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield lambda run: started.append(run) or run  # type: ignore[func-returns-value]
    for run in started:
        end_run(run)


def poll(check: Callable[[], T | None], what: str, timeout: float = 60) -> T:
    """``check()``'s first truthy answer, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout} s: {what}")


def status_json(cli: Callable[..., CliResult], pod: Pod) -> dict[str, Any]:
    done = cli("status", "--pod", pod.name, "--format", "json")
    assert done.code == 0, done.err
    found: dict[str, Any] = json.loads(done.out)
    return found


def run_of(cli: Callable[..., CliResult], pod: Pod) -> dict[str, Any] | None:
    """The status's one run, once every worker has a heartbeat."""
    shown = status_json(cli, pod)["runs"]
    assert isinstance(shown, list)
    if len(shown) != 1 or any(w["step"] is None for w in shown[0]["workers"]):
        return None
    found: dict[str, Any] = shown[0]
    return found


def test_status_shows_each_worker_s_step_and_names_the_one_that_stopped(
    make_pod: Callable[..., Pod],
    cli_in_process: Callable[..., CliResult],
    cli: Callable[..., CliResult],
    running: Callable[[subprocess.Popen[str]], subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    pod = make_pod(3)
    running(start_run(pod, tmp_path, PROGRAM, "30", "one"))

    def w1_stalled() -> dict[str, Any] | None:
        found = run_of(cli_in_process, pod)
        return found if found and found["workers"][1]["stalled"] else None

    shown = poll(w1_stalled, "w1 shown stalled")
    assert isinstance(shown, dict) and shown["running"] and shown["stacks"] is None
    w0, w1, w2 = shown["workers"]
    # a heartbeat prints once a second at most: the step shown is the last one printed
    assert 1 < w1["step"] <= 30 and w1["source"] == HEARTBEAT and w1["seconds_since"] >= 5
    assert w0["step"] > 30 and not w0["stalled"] and 5 <= w0["steps_per_s"] <= 25
    assert w2["step"] > 30 and not w2["stalled"]

    text = cli_in_process("status", "--pod", pod.name)
    assert text.code == 0, text.err
    block = text.out.split(f"run {shown['id']} running for ", 1)[1].splitlines()
    assert block[1].startswith("  w0  step ") and "steps/s, last step" in block[1]
    assert block[2].startswith(f"  w1  step {w1['step']}, no step for ")
    assert block[2].endswith("steps/s before)")

    # stacks taken: the status shows their digest, w1 in its data loader first
    taken = cli("stacks", "--pod", pod.name, timeout=60)
    assert taken.code == 0, taken.err
    again = cli_in_process("status", "--pod", pod.name).out
    digest = again.split("  stacks taken ", 1)[1].splitlines()
    assert digest[1].startswith("    w1 (1 of 3): next_batch prog.py:9 <- <module> prog.py:21")
    assert digest[2].startswith("    w0, w2 (2 of 3): ")
    assert digest[3].startswith("    saved in ") and digest[3].endswith(".txt")
    stacks = status_json(cli_in_process, pod)["runs"][0]["stacks"]
    assert stacks["digest"][0].startswith("w1 (1 of 3): next_batch prog.py:9")
    assert Path(stacks["path"]).is_file()


def test_status_of_a_run_without_heartbeats_says_when_each_worker_last_printed(
    make_pod: Callable[..., Pod],
    cli_in_process: Callable[..., CliResult],
    running: Callable[[subprocess.Popen[str]], subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    pod = make_pod(2)
    running(start_run(pod, tmp_path, SILENT))

    def printed() -> list[dict[str, Any]] | None:
        shown = status_json(cli_in_process, pod)["runs"]
        assert isinstance(shown, list)
        return shown[0]["workers"] if shown and shown[0]["workers"][0]["source"] == LINE else None

    w0, w1 = poll(printed, "w0's line")
    assert w0["step"] is None and w0["text"].startswith("last line ")
    assert w1["source"] == START and w1["text"].startswith("no output for ")
    text = cli_in_process("status", "--pod", pod.name).out
    assert "\n  w0  last line " in text and "\n  w1  no output for " in text
    assert "stacks" not in text.split("running for ", 1)[1]


def test_a_hung_run_shows_why_and_its_digest_in_status_and_on_its_page(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    cli_in_process: Callable[..., CliResult],
    dashboard: Callable[..., Dashboard],
    tmp_path: Path,
) -> None:
    pod = make_pod(3)
    run = start_run(pod, tmp_path, PROGRAM, "5", "all", options=("--hang-timeout", "3s"))
    try:
        run.communicate(timeout=60)
    finally:
        end_run(run)
    assert run.returncode == 124

    shown = status_json(cli_in_process, pod)["runs"]
    assert isinstance(shown, list) and len(shown) == 1
    hung = shown[0]
    assert hung["state"] == "hung" and not hung["running"]
    assert hung["hung"].startswith("hung: no worker progressed for 3s")
    assert hung["hung"].endswith("not where the others are: w1")
    assert hung["stacks"]["digest"][0].startswith("w1 (1 of 3): next_batch prog.py:9")
    assert all(w["step"] <= 5 and w["stalled"] for w in hung["workers"])
    text = cli_in_process("status", "--pod", pod.name).out
    block = text.split(f"run {hung['id']} hung after ", 1)[1].splitlines()
    assert block[1] == f"  {hung['hung']}"
    assert "    w1 (1 of 3): next_batch prog.py:9 <- <module> prog.py:21" in block

    board = dashboard()
    page = board.get(f"/runs/{hung['id']}").text
    assert hung["hung"] in page and "next_batch prog.py:9" in page
    assert 'id="take-stacks"' not in page  # not running: no button
    refused = board.post(
        f"/api/runs/{hung['id']}/stacks", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert refused.status_code == 400 and "is not running" in refused.json()["detail"]


def test_the_run_page_follows_progress_and_its_button_takes_stacks_with_the_token(
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    running: Callable[[subprocess.Popen[str]], subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    pod = make_pod(3)
    running(start_run(pod, tmp_path, PROGRAM, "30", "one"))
    board = dashboard()
    found = poll(lambda: board.get("/api/runs").json()["data"]["runs"], "the run listed")
    launch_id = found[0]["id"]
    run_dir = StateDir().pod_dir(pod.name) / "runs" / launch_id

    def stepping() -> dict[str, Any] | None:
        view = board.get(f"/api/runs/{launch_id}").json()
        steps = [w["progress"]["step"] for w in view["worker_list"]]
        return view if None not in steps and view["worker_list"][1]["progress"]["stalled"] else None

    view = poll(stepping, "every worker's step, w1 stalled")
    assert isinstance(view, dict) and view["stacks"] is None
    page = board.get(f"/runs/{launch_id}").text
    assert 'id="take-stacks"' in page and 'class="progress stalled"' in page
    assert f'<td class="step">{view["worker_list"][1]["progress"]["step"]}</td>' in page

    # the follow sends the workers' progress as it changes
    url = f"{board.url}/api/runs/{launch_id}/follow"
    with httpx.stream("GET", url, timeout=httpx.Timeout(10, read=10)) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line == "event: progress":
                sent = json.loads(next(lines).removeprefix("data: "))
                break
    assert [w["worker"] for w in sent] == [0, 1, 2] and sent[1]["stalled"]

    # the button's POST: refused without the token (nothing taken), then taken with it
    take = f"/api/runs/{launch_id}/stacks"
    assert board.post(take).status_code == 401
    assert not list(run_dir.glob("stacks-*"))  # nothing was taken
    done = board.post(take, headers={"Authorization": f"Bearer {TOKEN}", "Origin": board.url})
    assert done.status_code == 200, done.text
    digest = done.json()["digest"]
    assert digest[0].startswith("w1 (1 of 3): next_batch prog.py:9 <- <module> prog.py:21")
    assert Path(done.json()["saved"]).is_file()
    page = board.get(f"/runs/{launch_id}").text
    assert "w1 (1 of 3): next_batch prog.py:9 &lt;- &lt;module&gt; prog.py:21" in page


SAID = [
    (WorkerStanding(0, "h", 61, 9.98, 99.0, HEARTBEAT), "step 61, 9.98 steps/s, last step 1s ago"),
    (WorkerStanding(0, "h", 31, 9.9, 75.0, HEARTBEAT), "step 31, no step for 25s (9.90 steps/s before)"),  # noqa: E501
    # in a run that ended hung, every step stood still: the watchdog said so
    (WorkerStanding(0, "h", 7, 5.0, 98.0, HEARTBEAT, 0.0), "step 7, no step for 2s (5.00 steps/s before)"),  # noqa: E501
    # a slow step (0.1 steps/s) is not stalled until three of its steps have passed
    (WorkerStanding(0, "h", 3, 0.1, 75.0, HEARTBEAT), "step 3, 0.10 steps/s, last step 25s ago"),
    (WorkerStanding(0, "h", None, None, 97.0, LINE), "last line 3s ago"),
    (WorkerStanding(0, "h", None, None, 88.0, START), "no output for 12s"),
]  # fmt: skip


@pytest.mark.parametrize(("standing", "text"), SAID)
def test_a_worker_s_progress_in_words(standing: WorkerStanding, text: str) -> None:
    assert standing.text(100.0) == text
    assert standing.stalled(100.0) is ("no step" in text)


def test_in_a_browser_the_steps_move_without_a_reload_and_the_button_shows_the_digest(
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
    browser: Callable[[], Browser],
    running: Callable[[subprocess.Popen[str]], subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    pod = make_pod(3)
    running(start_run(pod, tmp_path, PROGRAM, "30", "one"))
    board = dashboard()
    launch_id = poll(lambda: board.get("/api/runs").json()["data"]["runs"], "the run")[0]["id"]
    seen = browser()
    page = seen.page
    page.goto(f"{board.url}/runs/{launch_id}")
    step = page.locator('#run-workers tr[data-worker="0"] td.step')
    page.wait_for_function(
        "() => Number(document.querySelector('#run-workers tr[data-worker=\"0\"] td.step')"
        ".textContent) > 0",
        timeout=30_000,
    )
    before = int(step.inner_text())
    updated = page.evaluate("() => document.getElementById('content').dataset.updated || ''")
    page.wait_for_function(  # by the follow's progress events, not a reload of the page
        f"() => Number(document.querySelector('#run-workers tr[data-worker=\"0\"] td.step')"
        f".textContent) > {before}",
        timeout=10_000,
    )
    assert page.evaluate("() => document.getElementById('content').dataset.updated || ''") == (
        updated
    )
    page.locator('#run-workers tr[data-worker="1"] td.progress.stalled').wait_for(timeout=30_000)

    page.fill("#token", TOKEN)
    page.dispatch_event("#token", "change")
    page.locator("#take-stacks button").click()
    digest = page.locator("#stacks-digest")
    digest.wait_for(timeout=30_000)
    assert digest.inner_text().startswith("w1 (1 of 3): next_batch prog.py:9 <- <module>")
    assert "stacks taken in" in page.locator("#action-result").inner_text()
    assert not seen.errors
