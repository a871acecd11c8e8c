"""Run records (``runs/LAUNCH_ID/run.json``) as typed records: order, lookup, following logs."""

from __future__ import annotations

import fcntl
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tests.test_launch import kill_launcher_once_started
from tpupod.errors import PodNotFound, UsageError
from tpupod.pod.record import Pod


def fake_run(
    state_home: Path, pod: str, launch_id: str, started: float, lines: list[str], **more: object
) -> Path:
    """A run folder as `tpupod run` writes it: run.json and one log per worker."""
    folder = state_home / "pods" / pod / "runs" / launch_id
    folder.mkdir(parents=True)
    record = {
        "launch_id": launch_id,
        "command": "python train.py",
        "workers": [{"id": 0, "hostname": "h0"}, {"id": 1, "hostname": "h1"}],
        "coordinator": "127.0.0.1:8476",
        "started": started,
        "finished": None,
        **more,
    }
    (folder / "run.json").write_text(json.dumps(record))
    for worker in (0, 1):
        (folder / f"w{worker}.log").write_text("".join(f"{line}\n" for line in lines))
    return folder


def finished(exit_code: int = 0) -> dict[str, object]:
    return {
        "finished": time.time(),
        "exit_code": exit_code,
        "results": [
            {"worker": 0, "outcome": "exit 0", "last_line": "done"},
            {"worker": 1, "outcome": f"exit {exit_code}", "last_line": "done"},
        ],
    }


# Two launches in the same second: the random part of the id sorts them the wrong way round.
EARLIER = "20250101-120000-ffffff"
LATER = "20250101-120000-000000"


def test_the_latest_run_is_the_last_started_not_the_last_by_name(
    make_pod: Callable[..., Pod], state_home: Path, cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    fake_run(state_home, pod.name, EARLIER, 1000.0, ["first"], **finished())
    fake_run(state_home, pod.name, LATER, 1000.5, ["second"], **finished(3))
    logs = cli("logs", "--pod", pod.name)
    assert logs.code == 0, logs.err
    assert sorted(logs.out.splitlines()) == ["[w0] second", "[w1] second"]
    assert f"run {LATER} ended with exit code 3" in logs.err


def test_runs_are_typed_records_in_start_order(
    make_pod: Callable[..., Pod], state_home: Path
) -> None:
    from tpupod import RunRecord, get_run, runs

    pod = make_pod(1)
    fake_run(state_home, pod.name, EARLIER, 1000.0, ["a"], **finished(2))
    fake_run(state_home, pod.name, LATER, 1000.5, ["b"])
    (state_home / "pods" / pod.name / "runs" / "half-made").mkdir()  # no run.json yet
    found = runs(pod.name)
    assert [r.launch_id for r in found] == [EARLIER, LATER]
    first = found[0]
    assert isinstance(first, RunRecord)
    assert first.done and first.exit_code == 2 and first.command == "python train.py"
    assert [(w.id, w.hostname) for w in first.workers] == [(0, "h0"), (1, "h1")]
    assert [(r.worker, r.outcome) for r in first.results] == [(0, "exit 0"), (1, "exit 2")]
    assert not found[1].done and found[1].exit_code is None
    assert get_run(pod.name).launch_id == LATER
    assert get_run(pod.name, EARLIER) == first


def test_lookup_errors(make_pod: Callable[..., Pod], state_home: Path) -> None:
    from tpupod import get_run, runs

    pod = make_pod(1)
    with pytest.raises(UsageError, match="has no runs yet"):
        get_run(pod.name)
    fake_run(state_home, pod.name, EARLIER, 1000.0, ["a"])
    with pytest.raises(UsageError, match="no run 'x'") as info:
        get_run(pod.name, "x")
    assert info.value.hint is not None and EARLIER in info.value.hint
    with pytest.raises(PodNotFound, match="no pod named 'nope'"):
        runs("nope")


def test_following_reads_every_line_until_the_run_ends(
    make_pod: Callable[..., Pod], state_home: Path
) -> None:
    from tpupod.launch.records import get_run, read_logs

    pod = make_pod(1)
    folder = fake_run(state_home, pod.name, LATER, time.time(), ["one"])

    def finish_later() -> None:
        time.sleep(0.3)
        with (folder / "w1.log").open("a") as log:
            log.write("tw")
            log.flush()
            time.sleep(0.3)  # a line half-written is not shown in two pieces
            log.write("o\n")
        record = json.loads((folder / "run.json").read_text())
        (folder / "run.json").write_text(json.dumps({**record, **finished()}))

    writer = threading.Thread(target=finish_later)
    writer.start()
    seen = [(w.id, text) for w, text in read_logs(get_run(pod.name), [1], follow=True, poll_s=0.05)]
    writer.join()
    assert seen == [(1, "one"), (1, "two")]


def test_a_real_run_reads_back(make_pod: Callable[..., Pod], cli: Callable[..., CliResult]) -> None:
    from tpupod import get_run

    pod = make_pod(2)
    program = "import tpupod; me = tpupod.rendezvous('start'); print(f'hi {me.id}')"
    assert cli("run", "--pod", pod.name, "--", sys.executable, "-c", program).code == 0
    record = get_run(pod.name)
    assert record.done and record.exit_code == 0 and len(record.workers) == 2
    assert [r.outcome for r in record.results] == ["exit 0", "exit 0"]


def test_following_a_run_whose_launcher_was_killed_ends_and_says_so(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    pid = kill_launcher_once_started(pod, "echo started; sleep 60")  # "finished" stays null
    follow = cli("logs", "--pod", pod.name, "--follow", timeout=30)  # waited forever before
    assert follow.code == 1, follow.err  # it exited 0, as for a run that went well
    assert sorted(follow.out.splitlines()) == ["[w0] started", "[w1] started"]
    assert f"its launcher (pid {pid}) is gone" in follow.err
    listed = cli("logs", "--pod", pod.name, "--list")
    assert listed.code == 0, listed.err
    assert "launcher gone" in listed.out.splitlines()[1], listed.out


def test_logs_list_shows_every_run_and_how_it_stands(
    make_pod: Callable[..., Pod], state_home: Path, cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    assert cli("logs", "--pod", pod.name, "--list").err == f"pod {pod.name!r} has no runs yet\n"
    fake_run(state_home, pod.name, EARLIER, 1000.0, ["a"], **finished(3))
    running = fake_run(state_home, pod.name, LATER, 1000.5, ["b"])
    with (running / "launcher.lock").open("wb") as lock:  # as a live launcher holds it
        fcntl.flock(lock, fcntl.LOCK_EX)
        listed = cli("logs", "--pod", pod.name, "--list")
        shown = cli("logs", "--pod", pod.name)
    assert shown.err == f"run {LATER} is still running ('-f' follows it)\n", shown.err
    assert listed.code == 0, listed.err
    header, first, second = listed.out.splitlines()
    assert header.split() == ["run", "started", "workers", "state", "command"]
    assert first.startswith(EARLIER) and "  failed (exit 3)  " in first
    assert "python train.py" in first
    assert second.startswith(LATER) and "  running  " in second
    assert cli("logs", "--pod", pod.name, "--list").out.splitlines()[2].split()[4:6] == [
        "launcher",
        "gone",
    ]
    refused = cli("logs", "--pod", pod.name, "--list", "-f")
    assert refused.code == 2 and refused.err.startswith("error: --list takes no RUN")


def test_a_run_s_ending_is_typed_in_its_record(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    """run.json keeps how the run ended (state, first failure, who stopped it, why), written
    once by its launcher; logs, the dashboard and cancel read it, no text parsed back."""
    from tpupod import get_run
    from tpupod.fanout.results import RunState

    pod = make_pod(workers=3)
    line = 'if [ "$TPUPOD_WORKER_ID" = 2 ]; then echo "disk full" >&2; exit 3; fi; sleep 30'
    assert cli("run", "--pod", pod.name, "--grace", "1", "--", line).code == 3
    record = get_run(pod.name)
    written = json.loads((record.folder / "run.json").read_text())["ending"]
    assert written["state"] == "failed" and written["first_failure"] == 2
    assert written["exit_code"] == 3 and written["stopped_by"] is None
    assert written["why"].startswith("w2 (") and written["why"].endswith("exit 3: disk full")
    assert record.ending.state is RunState.FAILED and record.state() == "failed (exit 3)"
    shown = cli("logs", "--pod", pod.name)
    assert shown.err.splitlines()[-1] == (
        f"run {record.launch_id} ended with exit code 3: failed (exit 3): {written['why']}"
    )
    timed = cli("run", "--pod", pod.name, "--timeout", "0.5", "--grace", "1", "--", "sleep 30")
    assert timed.code == 124
    ending = get_run(pod.name).ending
    assert ending.state is RunState.TIMED_OUT and ending.why.startswith("timed out: w0, w1, w2")
