"""``tpupod run --retries`` when things go wrong around it (issue 23): preempted again and
again, the program's own errors, a failing API and a silent worker, Ctrl-C/cancel while
waiting for capacity, and a launcher killed mid-recovery (then ``--resume``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, wait_until
from tests.fakes.tpu_api import TpuApiStandIn
from tests.test_recovery_gcp import UP, expected_value, record_of, start_run
from tpupod.sim import SimPod


def running_attempt(state_home: Path, name: str, attempt: int, ckpt: Path) -> Callable[[], bool]:
    """True once attempt ``attempt``'s program runs and has saved a step."""
    started = ckpt / f"started-{attempt}"

    def check() -> bool:
        if not started.exists():
            return False
        first = int(started.read_text())
        return (ckpt / f"{first}.ckpt").exists() and (
            ckpt / f"{first}.ckpt"
        ).stat().st_mtime >= started.stat().st_mtime

    return check


@pytest.mark.timeout(300)
def test_preempted_three_times_with_two_retries_ends_clearly_and_leaves_nothing(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    assert cli(*UP, "--name", "p3", "--tpu-type", "v4-16", "--spot", "--api", "tpu-vm").code == 0
    run = start_run("p3", shared_dir, 500, "--retries", "2")
    for attempt in (1, 2, 3):
        wait_until(running_attempt(state_home, "p3", attempt, shared_dir), run, timeout=90)
        spot_api.preempt_with_notice("p3")
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[-2].startswith("error: run ") and "preempted again after 2 recoveries" in lines[-2]
    assert lines[-1].startswith("hint: ") and "Traceback" not in err
    causes = [a["cause"] for a in record_of(state_home, "p3")["attempts"]]
    assert causes == ["preempted"] * 3
    assert spot_api.resources == {}  # the TPU the recovery made is gone


@pytest.mark.timeout(240)
def test_a_program_error_on_a_spot_tpu_recreates_nothing(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], state_home: Path
) -> None:
    assert cli(*UP, "--name", "pe", "--tpu-type", "v4-16", "--spot", "--api", "tpu-vm").code == 0
    fails = ("run", "--pod", "pe", "--retries", "2")
    program = (sys.executable, "-c", "raise SystemExit(3)")
    result = cli(*fails, "--", *program, timeout=120)
    assert result.code == 3, result.err
    again = cli(*fails, "--retry-errors", "1", "--", *program, timeout=120)
    assert again.code == 3, again.err
    assert "1 rerun after errors" in again.err
    assert spot_api.calls.count(("POST", "nodes/")) == 1  # the first, by `up`
    assert not [call for call in spot_api.calls if call[0] == "DELETE"]


@pytest.mark.timeout(300)
def test_a_failing_api_and_a_silent_worker_are_not_a_preemption(
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
    sim_hosts_up: SimPod,
) -> None:
    assert cli(*UP, "--name", "ok", "--tpu-type", "v4-16", "--spot", "--api", "tpu-vm").code == 0
    [w1] = [h.index for h in sim_hosts_up.hosts if h.address == _address(cli, "ok", 1)]
    run = start_run("ok", shared_dir, 60, "--retries", "2")
    wait_until(running_attempt(state_home, "ok", 1, shared_dir), run, timeout=90)
    spot_api.unavailable(30)  # every API call answers 503 for 30 s, past the unplugging
    sim_hosts_up.unplug(w1)  # and worker 1's network is gone for 20 s
    time.sleep(20)
    sim_hosts_up.plug(w1)
    _, err = run.communicate(timeout=200)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(60))
    causes = [a["cause"] for a in record_of(state_home, "ok")["attempts"]]
    assert causes[-1] == "ok" and "preempted" not in causes, err
    assert spot_api.calls.count(("POST", "nodes/")) == 1
    assert not [call for call in spot_api.calls if call[0] == "DELETE"]
    assert spot_api.unavailable_answers, "the run never asked the failing API"
    # a retry names the call and the resource, not the whole URL
    assert "ServiceUnavailable: GET nodes/ok: " in err and "://" not in err, err


def _address(cli: Callable[..., CliResult], pod: str, worker: int) -> str:
    hosts = json.loads(cli("hosts", "--pod", pod, "--format", "json").out)
    return str(hosts[worker]["internal_address"])


def waiting_for_capacity(state_home: Path, name: str, api: TpuApiStandIn) -> Callable[[], bool]:
    """True once the recovery creates the TPU again and the API holds it back."""

    def check() -> bool:
        try:
            record = record_of(state_home, name)
        except (ValueError, FileNotFoundError):
            return False
        return record["phase"] == "create" and api.calls.count(("POST", "queuedResources/")) == 2

    return check


@pytest.mark.timeout(300)
def test_cancel_while_waiting_for_capacity_leaves_nothing(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    assert cli(*UP, "--name", "cc", "--tpu-type", "v4-16", "--spot").code == 0
    run = start_run("cc", shared_dir, 500, "--retries", "2")
    wait_until(running_attempt(state_home, "cc", 1, shared_dir), run, timeout=90)
    spot_api.no_capacity = 10_000  # no capacity anywhere, for as long as it takes
    spot_api.preempt_with_notice("cc")
    wait_until(waiting_for_capacity(state_home, "cc", spot_api), run, timeout=90)
    run_id = str(record_of(state_home, "cc")["run_id"])
    cancelled = cli("cancel", "--pod", "cc", run_id, timeout=150)
    assert cancelled.code == 0, cancelled.err
    assert "cancelled" in cancelled.out
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "WAITING_FOR_RESOURCES" in err  # the wait was shown
    assert spot_api.resources == {}, err  # the TPU it was creating is deleted
    assert record_of(state_home, "cc")["state"] == "cancelled"


@pytest.mark.timeout(300)
def test_a_launcher_killed_mid_recovery_is_resumed(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    assert cli(*UP, "--name", "rs", "--tpu-type", "v4-16", "--spot").code == 0
    run = start_run("rs", shared_dir, 16, "--retries", "2")
    wait_until(running_attempt(state_home, "rs", 1, shared_dir), run, timeout=90)
    spot_api.no_capacity = 10_000
    spot_api.preempt_with_notice("rs")
    wait_until(waiting_for_capacity(state_home, "rs", spot_api), run, timeout=90)
    run.kill()  # kill -9: the launcher dies mid-recovery
    run.communicate()
    run_id = str(record_of(state_home, "rs")["run_id"])
    shown = cli("status", "--pod", "rs").out  # the attempts, and how to go on
    assert (
        f"run {run_id}: recovering (create), attempt 2; its launcher is gone: "
        f"'tpupod run --resume {run_id}' goes on" in shown
    ), shown
    assert "  attempt 1: preempted" in shown and "  attempt 2: running (create)" in shown
    spot_api.no_capacity = 5  # capacity comes back after a few polls
    resumed = cli("run", "--pod", "rs", "--resume", run_id, timeout=200)
    assert resumed.code == 0, resumed.err
    assert f"resuming run {run_id} (attempt 3)" in resumed.err
    assert (shared_dir / "final").read_text() == str(expected_value(16))
    record = record_of(state_home, "rs")
    assert record["state"] == "done"
    causes = [a["cause"] for a in record["attempts"]]
    assert causes == ["preempted", "launcher lost", "ok"]
    assert "attempt 3 from step" in resumed.out
    assert set(spot_api.alive()) == {"rs"}  # the queued resource and its node


@pytest.mark.timeout(300)
def test_preempted_during_setup_recovers_and_sets_up_the_new_tpu(
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
    tmp_path: Path,
) -> None:
    assert cli(*UP, "--name", "su", "--tpu-type", "v4-16", "--spot", "--api", "tpu-vm").code == 0
    script = tmp_path / "setup.sh"  # slow, and says on which host it ran (a fresh host: again)
    script.write_text(f'echo "$(hostname) begins" >> {shared_dir}/setup.log; sleep 4\n')
    run = start_run("su", shared_dir, 6, "--retries", "1", "--setup", str(script))
    log = shared_dir / "setup.log"

    def both_began() -> bool:  # the first TPU's two hosts (a TERM before one begins: no line)
        return log.exists() and len(log.read_text().splitlines()) >= 2

    wait_until(both_began, run, timeout=60)
    spot_api.preempt_with_notice("su")
    _, err = run.communicate(timeout=200)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(6))
    record = record_of(state_home, "su")
    assert [a["cause"] for a in record["attempts"]] == ["preempted", "ok"], err
    assert "during setup" in record["attempts"][0]["detail"]
    assert "setup" in record["attempts"][1]["phases"]  # the new TPU was set up
    hosts = {line.split()[0] for line in log.read_text().splitlines()}
    assert hosts == {"host-0", "host-1", "host-2", "host-3"}


@pytest.mark.timeout(120)
def test_waiting_for_capacity_is_shown_and_its_polls_back_off(
    spot_api: TpuApiStandIn,
    state_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import asyncio
    import types

    from tpupod.pod.choices import Capacity
    from tpupod.pod.lifecycle import up
    from tpupod.pod.spec import GcpPodSpec
    from tpupod.pod.state import StateDir
    from tpupod.providers import gcp

    pauses: list[float] = []

    async def pause(seconds: float) -> None:  # what the provider waits between two reads
        pauses.append(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(gcp, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": pause}))
    spot_api.no_capacity = 12  # twelve reads of WAITING_FOR_RESOURCES, then capacity
    spec = GcpPodSpec(
        name="wc", provider="gcp", tpu_type="v4-8", zone="us-central2-b", project="proj",
        user="root", capacity=Capacity.SPOT,
    )  # fmt: skip
    up(spec, StateDir())
    shown = [line.split(": ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert [line.split(" (")[0] for line in shown if line.startswith("wc: ")] == [
        "wc: ACCEPTED", "wc: WAITING_FOR_RESOURCES", "wc: PROVISIONING", "wc: ACTIVE",
    ]  # fmt: skip
    # TPUPOD_GCP_POLL_S is 0.05: each read of a state that lasts waits 1.5 times longer, up
    # to 8 times the poll (0.4 s); a new state is read again at the poll's pace.
    waiting = pauses[1:]  # after ACCEPTED, the first read of WAITING_FOR_RESOURCES
    assert waiting[:4] == pytest.approx([0.05, 0.075, 0.1125, 0.16875]), pauses
    assert max(pauses) == pytest.approx(0.4) and sum(p == pytest.approx(0.4) for p in pauses) >= 5
