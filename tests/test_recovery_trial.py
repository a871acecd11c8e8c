"""What a new user's trial of ``tpupod run --retries`` found (issue 37): ``down`` during a
recovery, a create the API refuses (quota, permission), a rendezvous that cannot start,
and the run's wording. Each test uses a user's default options, but for the stand-in's
short polls (``spot_api``: none of these faults depends on their pace)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CliResult, tpupod_argv, wait_until
from tests.fakes.tpu_api import TpuApiStandIn
from tests.test_recovery_gcp import UP, runs_of
from tpupod.pod.record import Pod

SLOW = (sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)")


@pytest.fixture
def popen() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``tpupod ARGS`` started as a user starts it; one still running at the end is killed."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            tpupod_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def last_two(err: str) -> tuple[str, str]:
    lines = err.strip().splitlines()
    assert len(lines) >= 2, err
    return lines[-2], lines[-1]


# -- 1. down during a run with --retries ------------------------------------------------------


@pytest.mark.timeout(120)
def test_down_refuses_a_pod_a_retries_run_is_running_on_and_force_cancels_it(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    state_home: Path,
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    """In its run phase: the refusal names the run (not its attempt's launch) and how to
    cancel it; --force cancels it as 'tpupod cancel' does, and says who did."""
    pod = make_pod(workers=2)
    run = popen("run", "--pod", pod.name, "--retries", "2", "--", *SLOW)

    def running() -> bool:
        found = runs_of(state_home, pod.name)
        return (
            bool(found)
            and found[0]["phase"] == "run"
            and bool(found[0]["attempts"][0]["launch_id"])
        )

    wait_until(running, run, timeout=60)
    run_id = runs_of(state_home, pod.name)[0]["run_id"]
    refused = cli("down", "--pod", pod.name)
    assert refused.code == 1, refused.err
    error, hint = last_two(refused.err)
    assert error.startswith("error: ") and f"run {run_id}" in error, refused.err
    assert hint.startswith("hint: ") and f"tpupod cancel --pod {pod.name} {run_id}" in hint
    assert run.poll() is None  # the run goes on
    forced = cli("down", "--pod", pod.name, "--force", timeout=60)
    assert forced.code == 0, forced.err
    assert f"pod {pod.name!r} is down" in forced.out
    _, err = run.communicate(timeout=30)
    assert run.returncode == 130, err
    assert "cancelled by 'tpupod down --force'" in err, err
    assert "attempt 2" not in err
    assert pod.name not in cli("list").out


@pytest.mark.timeout(180)
def test_down_during_a_recovery_waiting_for_capacity_is_refused_and_force_leaves_nothing(
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    state_home: Path,
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    """The repro: a recovery waits for capacity (WAITING_FOR_RESOURCES). ``down`` said "down"
    (exit 0) and the run made the TPU again. Now it is refused, naming the run; ``--force``
    cancels the run (the TPU it was making deleted) and nothing is made afterwards. The TPU
    is preempted before the run starts (the run makes it first): no program needs to run."""
    assert cli(*UP, "--name", "sp", "--tpu-type", "v4-16", "--spot").code == 0
    spot_api.preempt("sp")
    spot_api.no_capacity = 10_000
    run = popen("run", "--pod", "sp", "--retries", "3", "--", "true")

    def waiting() -> bool:
        found = runs_of(state_home, "sp")
        return (
            bool(found)
            and found[0]["phase"] == "create"
            and (spot_api.calls.count(("POST", "queuedResources/")) == 2)
        )

    wait_until(waiting, run, timeout=60)
    run_id = runs_of(state_home, "sp")[0]["run_id"]
    refused = cli("down", "--pod", "sp", timeout=60)
    assert refused.code == 1, refused.out + refused.err
    error, hint = last_two(refused.err)
    assert error.startswith("error: ") and f"run {run_id}" in error, refused.err
    assert hint.startswith("hint: ") and f"tpupod cancel --pod sp {run_id}" in hint
    assert "is down" not in refused.out and run.poll() is None
    assert "sp" in spot_api.alive()  # nothing was deleted
    forced = cli("down", "--pod", "sp", "--force", timeout=120)
    assert forced.code == 0, forced.err
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "cancelled by 'tpupod down --force'" in err, err
    assert runs_of(state_home, "sp") == []  # the pod's folder went with it
    time.sleep(1)  # nothing comes back afterwards
    assert spot_api.resources == {}, err
    assert spot_api.calls.count(("POST", "queuedResources/")) == 2
    assert "sp" not in cli("list").out


# -- 2. a create the API refuses ---------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("status", "message", "said"),
    [
        (
            "RESOURCE_EXHAUSTED",
            "Quota 'TPUV4_SPOT_PODS' exhausted. Limit 0.0 in region us-central2.",
            ("quota", "--zones"),
        ),
        (
            "PERMISSION_DENIED",
            "Permission 'tpu.queuedResources.create' denied on 'projects/proj'.",
            ("roles/tpu.admin",),
        ),
    ],
)
def test_a_create_refused_for_quota_or_permission_ends_the_run_with_the_apis_message(
    status: str,
    message: str,
    said: tuple[str, ...],
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    state_home: Path,
) -> None:
    """A 429 or 403 to the recovery's create was taken for a preemption (the TPU then reads
    GONE) and retried at once, every retry spent in a second, the verdict "preempted again"
    without the API's word. Now it ends the run at once: one error with the API's message,
    a hint that says what to do, the attempt recorded as an error. The TPU is preempted
    before the run starts (the run makes it first): no program needs to run."""
    assert cli(*UP, "--name", "sp", "--tpu-type", "v4-16", "--spot").code == 0
    spot_api.preempt("sp")
    for _ in range(4):  # every create the run could try
        spot_api.fail("POST", "queuedResources", status, message)
    result = cli("run", "--pod", "sp", "--retries", "3", "--", "true", timeout=90)
    assert result.code == 1, result.err
    error, hint = last_two(result.err)
    assert error.startswith("error: ") and message in error, result.err
    assert hint.startswith("hint: ") and all(word in hint for word in said), hint
    assert ": preempted" not in result.err and "preempted again" not in result.err
    [record] = runs_of(state_home, "sp")
    assert [a["cause"] for a in record["attempts"]] == ["error"], result.err
    assert record["state"] == "failed" and record["counters"].get("recoveries", 0) == 0
    assert spot_api.calls.count(("POST", "queuedResources/")) == 2  # up's, and one try


# -- 3. a rendezvous that cannot start ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_rendezvous_that_cannot_start_ends_a_retries_run_as_it_ends_a_plain_one(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], state_home: Path
) -> None:
    """Default options on a Cloud TPU: the rendezvous on worker 0, run by its python3, which
    has no tpupod. The plain run says so and how to fix it; the --retries run called it a
    program error and offered a rerun that would fail the same way."""
    assert cli(*UP, "--name", "rz", "--tpu-type", "v4-16", "--spot").code == 0
    plain = cli("run", "--pod", "rz", "--", "true", timeout=90)
    assert plain.code != 0 and "--worker-python" in plain.err, plain.err
    retried = cli("run", "--pod", "rz", "--retries", "2", "--", "true", timeout=90)
    assert retried.code == plain.code, retried.err
    assert last_two(retried.err) == last_two(plain.err), retried.err
    assert "--retry-errors 1" not in retried.err and "program error" not in retried.err
    [record] = runs_of(state_home, "rz")
    assert [a["cause"] for a in record["attempts"]] == ["error"], retried.err


# -- 4. wording --------------------------------------------------------------------------------


def test_counts_have_one_correct_plural_and_an_attempt_line_no_dangling_separator() -> None:
    from tpupod.recovery.policy import Counters
    from tpupod.recovery.record import AttemptRecord, RecoveryRecord

    assert Counters(1, 1, 2).describe() == (
        "1 recovery (preempted or lost), 1 rerun after errors, 2 after listed exit codes"
    )
    assert Counters(2, 0, 1).describe() == (
        "2 recoveries (preempted or lost), 0 reruns after errors, 1 after listed exit codes"
    )
    lost = AttemptRecord(1, 0.0, launch_id="L1", cause="launcher lost")  # no phase timed
    record = RecoveryRecord("R", "p", ["true"], {}, 0.0, 1, attempts=[lost])
    assert record.lines() == ["attempt 1: launcher lost; launch L1"]


@pytest.mark.timeout(60)
def test_a_passing_api_failure_is_said_without_stray_punctuation(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    # the next create gets a 503 whose message ends with a full stop (a 1 s outage from
    # now was over on a loaded machine before 'up' had started and made its first call)
    spot_api.fail("POST", "queuedResources", "UNAVAILABLE", "The service is currently unavailable.")
    made = cli(*UP, "--name", "un", "--tpu-type", "v4-8", "--spot", timeout=60)
    assert made.code == 0, made.err
    assert "The service is currently unavailable; retrying for up to" in made.err, made.err
    assert ".;" not in made.err


@pytest.mark.timeout(60)
def test_a_cancel_in_the_run_phase_is_named_in_the_attempts_summary_too(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    state_home: Path,
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    """The attempt's summary said "stopped by SIGINT" under "cancelled by 'tpupod cancel'"."""
    pod = make_pod(workers=2)
    run = popen("run", "--pod", pod.name, "--retries", "1", "--", *SLOW)
    logs = state_home / "pods" / pod.name / "runs"
    wait_until(lambda: any("started" in p.read_text() for p in logs.glob("*/w*.log")), run, 60)
    run_id = runs_of(state_home, pod.name)[0]["run_id"]
    assert cli("cancel", "--pod", pod.name, run_id, timeout=60).code == 0
    _, err = run.communicate(timeout=30)
    assert run.returncode == 130, err
    assert "stopped by 'tpupod cancel': 2 workers did not finish" in err, err
    assert "SIGINT" not in err


@pytest.mark.timeout(90)
def test_recreate_of_a_healthy_tpu_names_an_up_command_that_works(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    """The hint said "then 'tpupod up' again", which lacks the --gcp flags: it names the
    whole command now, and that command (after the down it names) makes the TPU again."""
    made = ("--name", "hr", "--tpu-type", "v4-8", "--spot", "--internal")
    assert cli(*UP, *made).code == 0
    refused = cli("up", "--recreate", "--name", "hr", timeout=60)
    assert refused.code != 0, refused.err
    _, hint = last_two(refused.err)
    assert "'tpupod down --pod hr', then '" in hint, hint
    command = hint.split("then '", 1)[1].split("'", 1)[0]
    assert command.startswith("tpupod up --gcp "), hint
    assert cli("down", "--pod", "hr", timeout=60).code == 0
    again = cli(*shlex.split(command)[1:], timeout=60)
    assert again.code == 0, again.err
    assert spot_api.tier("hr") == "spot"
    hosts = json.loads(cli("hosts", "--pod", "hr", "--format", "json").out)
    assert len(hosts) == 1
