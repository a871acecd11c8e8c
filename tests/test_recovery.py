"""``tpupod run --retries``: which endings are rerun, with what identity (issue 23).

On local and SSH pods: no cloud, so nothing is recreated (a lost worker is rerun); the
program's own failures are rerun only with --retry-errors or a listed exit code, and
every attempt sees the same TPUPOD_RUN_ID.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult, tpupod_argv, wait_until_gone
from tests.test_recovery_gcp import PROGRAM, expected_value
from tpupod.pod.record import Pod
from tpupod.sim import SimPod

# Fails (exit $1) on its first attempt, succeeds after; prints its identity.
FLAKY = (
    'echo "id=$TPUPOD_RUN_ID attempt=$TPUPOD_ATTEMPT resumed=${{TPUPOD_RESUMED:-0}}"; '
    '[ "$TPUPOD_ATTEMPT" -gt 1 ] || exit {code}'
)


def attempts_of(state_home: Path, pod: Pod) -> dict[str, Any]:
    [record] = (state_home / "pods" / pod.name / "runs").glob("*/recovery.json")
    data: dict[str, Any] = json.loads(record.read_text())
    return data


def test_a_program_error_is_not_rerun_without_retry_errors(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(workers=2)
    result = cli(
        "run", "--pod", pod.name, "--retries", "2", "--", "bash", "-c", FLAKY.format(code=3)
    )
    assert result.code == 3, result.err
    assert "attempt=1" in result.out and "attempt=2" not in result.out
    record = attempts_of(state_home, pod)
    assert record["state"] == "failed"
    assert [a["cause"] for a in record["attempts"]] == ["program error"]
    assert "0 reruns after errors" in result.err


def test_retry_errors_reruns_with_the_same_run_id(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(workers=2)
    result = cli(
        "run", "--pod", pod.name, "--retry-errors", "1", "--", "bash", "-c", FLAKY.format(code=3)
    )
    assert result.code == 0, result.err
    record = attempts_of(state_home, pod)
    run_id = record["run_id"]
    assert f"id={run_id} attempt=1 resumed=0" in result.out
    assert result.out.count(f"id={run_id} attempt=2 resumed=1") == 2
    assert record["state"] == "done" and record["exit_code"] == 0
    assert [a["cause"] for a in record["attempts"]] == ["program error", "ok"]
    assert f"run {run_id}: done after 2 attempts" in result.err


def test_a_listed_exit_code_is_rerun(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(workers=2)
    command = ("bash", "-c", FLAKY.format(code=42))
    result = cli("run", "--pod", pod.name, "--retry-exit-codes", "42,75", "--", *command)
    assert result.code == 0, result.err
    assert [a["cause"] for a in attempts_of(state_home, pod)["attempts"]] == [
        "listed exit code",
        "ok",
    ]
    # its id (what --resume and cancel take) can be found again: a trial found only launches
    run_id = attempts_of(state_home, pod)["run_id"]
    listed = cli("logs", "--pod", pod.name, "--list")
    assert listed.code == 0, listed.err
    # a launch's command as given, not behind the workdir's "cd /path &&"
    assert "&& bash -c" not in listed.out.splitlines()[1], listed.out
    section = listed.out.split("runs with --retries (--resume and cancel take these ids):\n")
    assert len(section) == 2, listed.out
    row = section[1].splitlines()[1].split()
    assert row[0] == run_id and row[3] == "done" and row[4] == "2:", listed.out
    unknown = cli("run", "--pod", pod.name, "--resume", "20990101-000000-abcdef")
    assert unknown.code == 2 and "'tpupod logs --list' lists them" in unknown.err, unknown.err
    bad = cli("run", "--pod", pod.name, "--retry-exit-codes", "42,x", "--", "true")
    assert bad.code == 2 and "'x' is not an exit code" in bad.err and "Traceback" not in bad.err


@pytest.mark.timeout(240)
def test_on_an_ssh_pod_a_lost_worker_is_rerun_without_recreating(
    make_ssh_pod: Callable[..., Pod],
    sim_hosts_up: SimPod,
    shared_dir: Path,
    state_home: Path,
) -> None:
    pod = make_ssh_pod(2)
    argv = tpupod_argv("run", "--pod", pod.name, "--retries", "1", "--",
                       sys.executable, PROGRAM, str(shared_dir), "12", "0.4")  # fmt: skip
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (shared_dir / "3.ckpt").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    # A killed accelerator holder's stale lockfile on worker 0 (it would fail the preflight)
    sim_hosts_up.run_on(0, "touch /tmp/libtpu_lockfile")
    sim_hosts_up.stop_host(1)  # worker 1's host crashes: it stops answering
    time.sleep(3)
    sim_hosts_up.start_host(1)  # and comes back, empty
    sim_hosts_up.wait_ready([1])
    _, err = run.communicate(timeout=180)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(12))
    record = attempts_of(state_home, pod)
    assert [a["cause"] for a in record["attempts"]] == ["lost worker", "ok"], err
    assert "w1 stopped answering" in record["attempts"][0]["detail"]
    assert sim_hosts_up.run_on(0, "ls /tmp/libtpu_lockfile").returncode != 0  # freed first


def test_status_shows_the_latest_runs_attempts_causes_and_phase_times(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(workers=2)
    before = cli("status", "--pod", pod.name).out.splitlines()
    assert not [line for line in before if line.startswith("run ")], before  # no such run yet
    flaky = ("bash", "-c", FLAKY.format(code=3))
    assert cli("run", "--pod", pod.name, "--retry-errors", "1", "--", *flaky).code == 0
    record = attempts_of(state_home, pod)
    run_id, (first, second) = record["run_id"], record["attempts"]
    shown = cli("status", "--pod", pod.name)
    assert shown.code == 0, shown.err
    lines = shown.out.splitlines()
    at = lines.index(f"run {run_id}: done after 2 attempts")
    # the record's own lines (one reader: RecoveryRecord), each phase with its time
    assert lines[at + 1 : at + 3] == [
        f"  attempt 1: program error, exit 3; launch {first['launch_id']}; "
        f"run {first['phases']['run']:.1f}s",
        f"  attempt 2: ok, exit 0; launch {second['launch_id']}; "
        f"run {second['phases']['run']:.1f}s",
    ]
    as_json = json.loads(cli("status", "--pod", pod.name, "--format", "json").out)
    assert as_json["recovery"]["run_id"] == run_id
    assert [a["cause"] for a in as_json["recovery"]["attempts"]] == ["program error", "ok"]


def test_the_probe_budget_has_one_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from tpupod import settings

    monkeypatch.delenv("TPUPOD_RECOVERY_PROBE_S", raising=False)
    monkeypatch.delenv("TPUPOD_RECOVERY_PROBE_TRIES", raising=False)
    from tpupod.recovery.policy import RetryPolicy

    policy = RetryPolicy()
    assert settings.recovery_probe() == (policy.probe_s, policy.probe_tries) == (120.0, 0)


def test_cancel_stops_a_plain_run_too(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    """'tpupod cancel RUN' refused a run started without --retries ("has no recovery
    record", exit 2) and the run went on; the dashboard could stop it. It stops any run."""
    pod = make_pod(2)
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--", "sleep 60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        runs = state_home / "pods" / pod.name / "runs"
        deadline = time.monotonic() + 30
        while not list(runs.glob("*/w1.log")):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr
            time.sleep(0.05)
        (launch,) = [p.name for p in runs.iterdir()]
        started = time.monotonic()
        # no RUN: the one run going on the pod (a trial: "missing argument 'RUN'")
        cancelled = cli("cancel", "--pod", pod.name)
        assert cancelled.code == 0, cancelled.err
        # what ended it, once: not "stopped (stopped (exit 130); its launcher ... stopped it)"
        said = f"run {launch}: stopped (exit 130): stopped by 'tpupod cancel' (pid "
        assert cancelled.out.startswith(said), cancelled.out
        assert run.wait(timeout=30) == 130 and time.monotonic() - started < 15
        # the launcher's terminal names the cancel too, not "interrupted (Ctrl-C)"
        launcher_said = run.stderr.read()  # type: ignore[union-attr]
        assert "tpupod: stopped by 'tpupod cancel' (pid " in launcher_said, launcher_said
        assert "Ctrl-C" not in launcher_said and "stopped by SIGINT" not in launcher_said
        assert wait_until_gone(pod.name) == []
        again = cli("cancel", "--pod", pod.name, launch)
        assert again.code == 0, again.err
        assert again.out.startswith(f"run {launch} is already over: stopped (exit 130): stopped by")
        assert "'tpupod cancel' (pid " in again.out  # the run's ending names who stopped it
    finally:
        run.kill()
        run.wait()
        run.stderr.close()  # type: ignore[union-attr]
    unknown = cli("cancel", "--pod", pod.name, "20990101-000000-abcdef")
    assert unknown.code == 2 and "no run '20990101-000000-abcdef'" in unknown.err
    idle = cli("cancel", "--pod", pod.name)
    assert idle.code == 2, idle.err
    assert f"error: no run is going on pod {pod.name!r}" in idle.err, idle.err
    assert "tpupod logs --list" in idle.err, idle.err


def test_a_worker_killed_from_outside_is_lost_even_when_a_peer_failed_first() -> None:
    """From the slices trial: w2 killed by kill -9; w0's collective failed at once and its
    report reached the launcher first. The attempt was lost (rerun), not a program error."""
    from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
    from tpupod.pod.record import Worker
    from tpupod.recovery.loop import ended_by
    from tpupod.recovery.policy import Cause, RetryPolicy
    from tpupod.transport.base import ExitStatus

    workers = [Worker(id=i, hostname=f"h{i}", internal_address="127.0.0.1") for i in range(4)]
    gloo = "JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: Connection reset by peer"
    rows = [
        WorkerResult(workers[0], Outcome.FAILED, 7.0, ExitStatus(1), tail=(gloo,)),
        WorkerResult(workers[1], Outcome.STOPPED, 7.1, ExitStatus(None, 15), stopped_by=0),
        WorkerResult(workers[2], Outcome.FAILED, 7.0, ExitStatus(None, 9)),
        WorkerResult(workers[3], Outcome.STOPPED, 7.1, ExitStatus(None, 15), stopped_by=0),
    ]
    ending = ended_by(FanoutResult("train", rows, 7.1, [0, 2, 1, 3]), RetryPolicy(retries=2))
    assert ending.cause is Cause.LOST, ending
    assert ending.detail == "w2 (h2) killed by SIGKILL", ending.detail
    # a program's own error, the others stopped by tpupod: an error, not rerun
    own = [rows[0], rows[1], WorkerResult(workers[2], Outcome.STOPPED, 7.1, ExitStatus(None, 9),
                                          stopped_by=0), rows[3]]  # fmt: skip
    ending = ended_by(FanoutResult("train", own, 7.1, [0, 1, 2, 3]), RetryPolicy(retries=2))
    assert ending.cause is Cause.ERROR
