"""What a person sees of a pod of slices (issue 39): `tpupod status` names each worker's
slice and the pod's layout; a summary of many workers is a line per slice, the odd slices
first; the dashboard's pod and run pages show each worker's slice. Pods made with the CLI,
the CLI run as a process, the dashboard through its HTTP server."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable

from tests.conftest import CliResult
from tests.dashboard_server import Dashboard, dashboard_fixture  # noqa: F401 (a fixture)
from tpupod.fanout.report import print_summary
from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
from tpupod.pod.record import Pod
from tpupod.pod.state import WorkerBrief
from tpupod.transport.base import ExitStatus

# worker 13 (slice 1 of a pod of 32 in 4 slices) fails; the others print
FAIL_13 = 'echo hi; if [ "$TPUPOD_WORKER_ID" = 13 ]; then exit 3; fi'


def up(cli: Callable[..., CliResult], name: str, workers: int, slices: int = 1) -> None:
    given = ("--slices", str(slices)) if slices > 1 else ()
    made = cli("up", "--name", name, "--local", str(workers), *given)
    assert made.code == 0, made.err


def summary(err: str, title: str) -> list[str]:
    """The summary's lines: from its headline (``exec on big: ...``) to the end."""
    lines = err.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{title}: ")]
    assert starts, err
    return lines[starts[-1] :]


# -- tpupod status ---------------------------------------------------------------------------


def test_status_names_each_workers_slice_and_the_layout(cli: Callable[..., CliResult]) -> None:
    up(cli, "ms", 4, 2)
    shown = cli("status", "--pod", "ms")
    assert shown.code == 0, shown.err
    lines = shown.out.splitlines()
    assert lines[0].startswith("pod 'ms': 4 local workers in 2 slices"), lines
    assert lines[1] == "2 slices of 2 workers: w0-w1, w2-w3"
    assert lines[2].split()[:3] == ["WORKER", "SLICE", "HOSTNAME"]
    assert [line.split()[:3] for line in lines[3:7]] == [
        ["0", "0", lines[3].split()[2]],
        ["1", "0", lines[4].split()[2]],
        ["2", "1", lines[5].split()[2]],
        ["3", "1", lines[6].split()[2]],
    ]
    assert all(line.split()[3] == "yes" for line in lines[3:7])
    as_json = json.loads(cli("status", "--pod", "ms", "--format", "json").out)
    assert as_json["slices"] == 2
    assert [(w["worker"], w["slice"]) for w in as_json["workers"]] == [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 1),
    ]


def test_status_of_a_pod_of_one_slice_has_no_slices(cli: Callable[..., CliResult]) -> None:
    up(cli, "one", 2)
    shown = cli("status", "--pod", "one")
    assert shown.code == 0, shown.err
    assert "SLICE" not in shown.out and "slices" not in shown.out, shown.out
    assert shown.out.splitlines()[1].split() == [
        "WORKER",
        "HOSTNAME",
        "REACHABLE",
        "ANSWER",
        "TIME",
    ]
    as_json = json.loads(cli("status", "--pod", "one", "--format", "json").out)
    assert as_json["slices"] == 1 and {w["slice"] for w in as_json["workers"]} == {None}


# -- summaries ---------------------------------------------------------------------------------


def test_exec_on_a_large_pod_of_slices_sums_up_a_line_per_slice_odd_first(
    cli: Callable[..., CliResult],
) -> None:
    up(cli, "big", 32, 4)
    result = cli("exec", "--pod", "big", "--", FAIL_13)
    assert result.code == 3, result.err
    lines = summary(result.err, "exec on big")
    assert re.fullmatch(r"exec on big: 31/32 ok in \S+", lines[0]), lines
    assert lines[1:5] == [
        "slice 1  w8-w15   7 ok, 1 failed (w13: exit 3)",
        "slice 0  w0-w7    8 ok",
        "slice 2  w16-w23  8 ok",
        "slice 3  w24-w31  8 ok",
    ]
    assert lines[5].startswith("first failure: w13 (slice 1, "), lines  # as it was
    assert len(lines) == 6

    every = cli("exec", "--pod", "big", "--verbose", "--", "echo hi")  # a row per worker
    assert every.code == 0, every.err
    table = summary(every.err, "exec on big")
    assert table[1].split()[:3] == ["worker", "slice", "host"]
    assert [row.split()[:2] for row in table[2:]] == [[f"w{i}", str(i // 8)] for i in range(32)]


def test_a_failed_run_on_a_large_pod_of_slices_puts_the_failing_slice_first(
    cli: Callable[..., CliResult],
) -> None:
    up(cli, "big", 32, 4)
    # --on-fail wait: every other worker ends by itself (with kill, a loaded machine's
    # stop can end a worker "unreachable": a fault of the stop, not of the summary)
    program = 'echo hi; case "$TPUPOD_WORKER_ID" in 12|13) exit 3;; esac'
    result = cli("run", "--pod", "big", "--on-fail", "wait", "--", "bash", "-c", program)
    assert result.code == 3, result.err
    launch = re.search(r"launch (\S+): 32 workers", result.err)
    assert launch, result.err
    lines = summary(result.err, f"run {launch.group(1)}")
    assert re.fullmatch(r"run \S+: 30/32 ok in \S+", lines[0]), lines
    assert lines[1:5] == [
        "slice 1  w8-w15   6 ok, 2 failed (w12, w13: exit 3)",
        "slice 0  w0-w7    8 ok",
        "slice 2  w16-w23  8 ok",
        "slice 3  w24-w31  8 ok",
    ]
    assert re.match(r"first failure: w1[23] \(slice 1, ", lines[5]), lines
    assert len(lines) == 6


def test_a_small_pod_of_slices_keeps_its_table(cli: Callable[..., CliResult]) -> None:
    up(cli, "ms", 4, 2)
    result = cli("exec", "--pod", "ms", "--", 'echo hi; [ "$TPUPOD_WORKER_ID" != 2 ] || exit 3')
    assert result.code == 3, result.err
    lines = summary(result.err, "exec on ms")
    assert lines[1].split()[:5] == ["worker", "slice", "host", "result", "time"]
    assert [row.split()[:2] for row in lines[2:6]] == [
        ["w0", "0"],
        ["w1", "0"],
        ["w2", "1"],
        ["w3", "1"],
    ]
    assert not any(line.startswith("slice ") for line in lines), lines
    assert lines[6].startswith("first failure: w2 (slice 1, "), lines


def result_of(outcomes: dict[int, WorkerResult | None], workers: int, slices: int) -> FanoutResult:
    """A fan-out's result on ``workers`` in ``slices``: ok where ``outcomes`` says None."""
    per = workers // slices
    rows = []
    for i in range(workers):
        found = outcomes.get(i)
        worker = WorkerBrief(i, f"host-{i}", i // per)
        rows.append(
            WorkerResult(worker, Outcome.OK, 1.0, ExitStatus(0, None), tail=("hi",))
            if found is None
            else WorkerResult(
                worker,
                found.outcome,
                1.0,
                found.status,
                error=found.error,
                stopped_by=found.stopped_by,
            )
        )
    order = [i for i in outcomes if outcomes[i] is not None]
    return FanoutResult("train", rows, 3.0, order)


def test_slices_are_ordered_first_failure_then_own_failures_then_stopped_then_ok() -> None:
    nobody = WorkerBrief(0, "", None)
    failed = WorkerResult(nobody, Outcome.FAILED, 0, ExitStatus(1, None))
    other = WorkerResult(nobody, Outcome.FAILED, 0, ExitStatus(2, None))
    lost = WorkerResult(nobody, Outcome.UNREACHABLE, 0, error="no route to host")
    stopped = WorkerResult(nobody, Outcome.STOPPED, 0, ExitStatus(None, 15), stopped_by=40)
    outcomes: dict[int, WorkerResult | None] = {40: failed, 41: other, 42: other, 3: lost}
    outcomes |= dict.fromkeys(range(48, 64), stopped)
    shown = io.StringIO()
    print_summary(result_of(outcomes, 64, 4), shown, "run x", color=False)
    assert shown.getvalue().splitlines()[1:5] == [
        "slice 2  w32-w47  13 ok, 3 failed (w40: exit 1; w41, w42: exit 2)",
        "slice 0  w0-w15   15 ok, 1 unreachable (w3)",
        "slice 3  w48-w63  16 stopped (after w40 failed (killed by SIGTERM))",
        "slice 1  w16-w31  16 ok",
    ]


def test_a_large_silent_success_is_its_headline_alone() -> None:
    shown = io.StringIO()
    quiet = result_of({}, 32, 4)
    for r in quiet.workers:
        r.tail = ()
    print_summary(quiet, shown, "exec on big", color=False)
    assert shown.getvalue() == "exec on big: 32/32 ok in 3.00s\n"


# -- the dashboard ---------------------------------------------------------------------------


def wait_for_sample(board: Dashboard, pod: str, within: float = 60.0) -> str:
    """The pod's page once its workers have been sampled."""
    deadline = time.monotonic() + within
    while 'id="workers"' not in (page := board.get(f"/pods/{pod}").text):
        assert time.monotonic() < deadline, "the pod was not sampled in time"
        time.sleep(0.2)
    return page


def test_the_dashboard_shows_each_workers_slice_on_pod_and_run_pages(
    cli: Callable[..., CliResult],
    make_pod: Callable[..., Pod],
    dashboard: Callable[..., Dashboard],
) -> None:
    up(cli, "ms", 4, 2)
    plain = make_pod(2)
    failing = 'echo hi; if [ "$TPUPOD_WORKER_ID" = 2 ]; then exit 3; fi; sleep 60'
    ran = cli("run", "--pod", "ms", "--grace", "2", "--", "bash", "-c", failing, timeout=60)
    assert ran.code == 3, ran.err
    board = dashboard()

    page = wait_for_sample(board, "ms")
    assert '<p id="slices">2 slices of 2 workers: w0-w1, w2-w3</p>' in page
    assert "<th>worker</th><th>slice</th><th>host</th>" in page
    for worker in range(4):
        row = page.split(f'<tr data-worker="{worker}"')[1].split("</tr>")[0]
        assert f'<td>w{worker}</td><td class="slice">{worker // 2}</td>' in row, row
    listed = board.get("/pods").text
    assert re.search(r'href="/pods/ms">ms</a></td><td>local</td><td>4 in 2 slices</td>', listed)

    other = wait_for_sample(board, plain.name)  # a pod of one slice: no slice anywhere
    assert 'class="slice"' not in other and "<th>slice</th>" not in other
    assert 'id="slices"' not in other

    runs = board.get("/api/runs?pod=ms").json()["data"]["runs"]
    assert len(runs) == 1 and runs[0]["slices"] == 2, runs
    launch = runs[0]["id"]
    detail = board.get(f"/api/runs/{launch}").json()
    assert [(w["worker"], w["slice"]) for w in detail["worker_list"]] == [
        (2, 1),
        (0, 0),
        (1, 0),
        (3, 1),
    ]  # the first failure first
    run = board.get(f"/runs/{launch}").text
    assert "<h2>w2 (slice 1) failed first: exit 3</h2>" in run
    table = run.split('id="run-workers"')[1].split("</table>")[0]
    assert "<th>worker</th><th>slice</th><th>host</th>" in table
    assert re.findall(r'<td>w(\d)</td><td class="slice">(\d)</td>', table) == [
        ("2", "1"),
        ("0", "0"),
        ("1", "0"),
        ("3", "1"),
    ]
    assert "<small>slice 1</small>" in run.split('id="logs"')[1]  # each log's heading
    assert "4 in 2 slices" in board.get("/runs").text
