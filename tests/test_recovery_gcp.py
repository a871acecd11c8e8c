"""``tpupod run --retries`` on a spot TPU of the Cloud TPU API stand-in (issue 23).

The stand-in preempts as GCE does: the node PREEMPTED, the hosts' metadata
answering ``instance/preempted`` TRUE, TERM to every process on its hosts, and
after the notice window the hosts killed and taken away. A recreated TPU gets
freshly booted simulated hosts (nothing from before: no code, no setup).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult, tpupod_argv, wait_until
from tests.fakes.tpu_api import TpuApiStandIn
from tpupod.pod.record import Pod

PROGRAM = str(Path(__file__).parent / "programs" / "steps.py")
UP = ("up", "--gcp", "--zone", "us-central2-b", "--project", "proj", "--user", "root")


def expected_value(steps: int) -> int:
    value = 1
    for step in range(steps):
        value = (value * 31 + step) % 1_000_003
    return value


def start_run(
    name: str, ckpt: Path, steps: int, *options: str, save_every: int = 1
) -> subprocess.Popen[str]:
    """``tpupod run`` as a user runs it: default options (the rendezvous on worker 0, as
    ``auto`` puts it for a Cloud TPU reached at its external addresses) but ``options``."""
    command = (sys.executable, PROGRAM, str(ckpt), str(steps), "0.4", str(save_every))
    return subprocess.Popen(
        tpupod_argv("run", "--pod", name, *options, "--", *command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )


def wait_for(path: Path, run: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            out, err = run.communicate()
            pytest.fail(f"{path} did not appear:\n{out}\n{err}")
        time.sleep(0.05)


def steps_done(ckpt: Path) -> list[int]:
    """The steps worker 0 did, in order (a step redone shows twice)."""
    log = ckpt / "steps-w0.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [int(line.split()[0]) for line in lines]


def wait_until_step(ckpt: Path, step: int, run: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while step not in steps_done(ckpt):
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            out, err = run.communicate()
            pytest.fail(f"step {step} was not reached:\n{out}\n{err}")
        time.sleep(0.05)


def record_of(state_home: Path, name: str) -> dict[str, Any]:
    [path] = (state_home / "pods" / name / "runs").glob("*/recovery.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.mark.timeout(240)  # two attempts and a recreate, on a busy machine
@pytest.mark.parametrize(
    ("shape", "kind", "seen_by"),
    [
        ((), "queuedResources", "state"),
        (("--api", "tpu-vm"), "nodes", "state"),
        (("--api", "tpu-vm"), "nodes", "metadata"),  # the API's state is not read in time
    ],
)
def test_preempted_once_mid_run_finishes_with_the_same_result(
    shape: tuple[str, ...],
    kind: str,
    seen_by: str,
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if seen_by == "metadata":
        monkeypatch.setenv("TPUPOD_RECOVERY_WATCH_S", "1000")
        spot_api.notice_s = 20.0  # the hosts answer their metadata until then
    assert cli(*UP, "--name", "sp", "--tpu-type", "v4-16", "--spot", *shape).code == 0
    before = json.loads(cli("hosts", "--pod", "sp", "--format", "json").out)
    # Checkpoints every 4 steps: the notice comes 2 steps past one, and only the save at
    # the notice keeps them (the rendezvous on worker 0 must outlive the notice's TERM).
    run = start_run("sp", shared_dir, 12, "--retries", "2", save_every=4)
    wait_for(shared_dir / "3.ckpt", run, timeout=60)
    wait_until_step(shared_dir, 5, run)
    spot_api.preempt_with_notice("sp")
    out, err = run.communicate(timeout=180)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(12))
    record = record_of(state_home, "sp")
    causes = [a["cause"] for a in record["attempts"]]
    assert causes == ["preempted", "ok"], err
    assert "--retries 2" in err and "1 recovery (preempted or lost)" in err
    detail = record["attempts"][0]["detail"]
    assert ("instance/preempted is TRUE on w0, w1" in detail) == (seen_by == "metadata"), detail
    # the notice was honoured: the step under way was saved, no step was done twice
    done = steps_done(shared_dir)
    assert len(done) == len(set(done)) == 12, done
    # a new TPU (never the preempted one), on other hosts, fresh
    assert spot_api.calls.count(("POST", f"{kind}/")) == 2
    assert ("DELETE", f"{kind}/sp") in spot_api.calls and "sp" in spot_api.alive()
    after = json.loads(cli("hosts", "--pod", "sp", "--format", "json").out)
    assert {w["internal_address"] for w in after}.isdisjoint(
        {w["internal_address"] for w in before}
    )
    assert "worker 0 attempt 2 from step" in out


EXAMPLE = str(Path(__file__).parents[1] / "examples" / "preemptible_train.py")


def assert_same_arrays(got_file: Path, want_file: Path) -> None:
    """The two .npz files hold the same arrays, bit for bit."""
    import numpy as np

    got, want = np.load(got_file), np.load(want_file)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].tobytes() == want[name].tobytes(), name


def train(ckpt: Path, out: Path, steps: int, save_every: int = 5) -> tuple[str, ...]:
    every = str(save_every)
    return (sys.executable, EXAMPLE, "--ckpt", str(ckpt), "--steps", str(steps),
            "--save-every", every, "--step-seconds", "0.3", "--out", str(out))  # fmt: skip


@pytest.mark.timeout(420)  # JAX on two hosts, three times, on a busy machine
def test_a_preempted_jax_run_ends_bit_for_bit_as_an_uninterrupted_one(
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    make_pod: Callable[..., Pod],
    shared_dir: Path,
    state_home: Path,
) -> None:

    steps = 24
    local = make_pod(workers=2)
    reference = cli(
        "run", "--pod", local.name, "--",
        *train(shared_dir / "ref", shared_dir / "ref.npz", steps), timeout=200,
    )  # fmt: skip
    assert reference.code == 0, reference.err
    assert cli(*UP, "--name", "jx", "--tpu-type", "v4-16", "--spot").code == 0
    # A user's default options: the rendezvous on worker 0 (a Cloud TPU reached at its
    # external addresses), the default notice grace; checkpoints far apart, so that only a
    # save at the notice keeps the steps done since the last one.
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", "jx", "--retries", "2", "--",
                    *train(shared_dir / "ckpt", shared_dir / "out.npz", steps, save_every=50)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(shared_dir / "ckpt" / "0", run, timeout=200)
    time.sleep(2)  # a few steps past the last periodic save
    spot_api.preempt_with_notice("jx")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert_same_arrays(shared_dir / "out.npz", shared_dir / "ref.npz")
    record = record_of(state_home, "jx")
    assert [a["cause"] for a in record["attempts"]] == ["preempted", "ok"]
    # The notice was honoured: saved at the preemption sync point, resumed right after it.
    logs = cli("logs", "--pod", "jx", record["attempts"][0]["launch_id"]).out
    saved = {int(line.rsplit(" ", 1)[-1]) for line in logs.splitlines() if "saved step" in line}
    [resumed] = {
        int(line.rsplit(" ", 1)[-1])
        for line in out.splitlines()
        if "from step" in line and "attempt 2" in line
    }
    assert saved == {resumed - 1}, f"attempt 1:\n{logs}\nthe run:\n{out}\n{err}"


# -- issue 37: the cloud around a recovery ---------------------------------------------------


def runs_of(state_home: Path, name: str) -> list[dict[str, Any]]:
    """Every --retries run's record of the pod, oldest first."""
    paths = sorted((state_home / "pods" / name / "runs").glob("*/recovery.json"))
    return [json.loads(path.read_text()) for path in paths]


@pytest.mark.timeout(400)  # a minute of outage inside a recovery, on a busy machine
def test_an_api_outage_after_a_preemption_costs_one_recovery(
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 37: a preemption, then 60 s of 503s. The default budget (120 s) is spent on
    time, not on a count of tries; every API call of the recovery (the delete, its
    operation, the create, the polls) waits the outage out; one preemption, one recovery."""
    monkeypatch.delenv("TPUPOD_RECOVERY_PROBE_S", raising=False)  # the user's default budget
    assert cli(*UP, "--name", "ou", "--tpu-type", "v4-16", "--spot").code == 0
    run = start_run("ou", shared_dir, 16, "--retries", "2")
    wait_for(shared_dir / "3.ckpt", run, timeout=60)
    spot_api.preempt_with_notice("ou")
    spot_api.unavailable(60)
    began = time.monotonic()
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert time.monotonic() - began >= 55  # it waited the outage out
    assert (shared_dir / "final").read_text() == str(expected_value(16))
    [record] = runs_of(state_home, "ou")
    assert [a["cause"] for a in record["attempts"]] == ["preempted", "ok"], err
    assert record["counters"]["recoveries"] == 1 and "1 recovery (preempted or lost)" in err
    # backoff 0.5, 1, 2, 4, 8, then 10 s: ~11 tries in the minute, fewer on a loaded machine
    assert spot_api.unavailable_answers >= 6, "the recovery never met the outage"
    assert spot_api.calls.count(("POST", "queuedResources/")) == 2  # up's, the recovery's
    assert set(spot_api.alive()) == {"ou"}
    assert "retrying" in err and "Traceback" not in err


@pytest.mark.timeout(300)
def test_a_second_recovering_run_on_a_pod_is_refused_and_the_first_recovers(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    """Issue 37: two --retries runs on one pod both recreated its TPU after a preemption, and
    the second's create overwrote the pod's key. Started at once, one is refused (naming
    the other), before it records anything; the other recovers, with the pod's own key."""
    assert cli(*UP, "--name", "two", "--tpu-type", "v4-16", "--spot").code == 0
    key = (state_home / "pods" / "two" / "id_ed25519").read_bytes()
    runs = [start_run("two", shared_dir / tag, 12, "--retries", "2") for tag in ("a", "b")]
    deadline = time.monotonic() + 60
    while all(r.poll() is None for r in runs) and time.monotonic() < deadline:
        time.sleep(0.05)
    [refused] = [r for r in runs if r.poll() is not None]
    [first] = [r for r in runs if r is not refused]
    _, refusal = refused.communicate()
    assert refused.returncode == 2, refusal
    [record] = runs_of(state_home, "two")  # the refused run left no record
    lines = refusal.strip().splitlines()
    assert lines[-2].startswith("error: ") and record["run_id"] in lines[-2], refusal
    stop = f"tpupod cancel --pod two {record['run_id']}"
    assert lines[-1].startswith("hint: ") and stop in lines[-1], refusal
    ckpt = shared_dir / ("a" if first is runs[0] else "b")
    wait_for(ckpt / "3.ckpt", first, timeout=60)
    spot_api.preempt_with_notice("two")
    _, err = first.communicate(timeout=200)
    assert first.returncode == 0, err
    assert (ckpt / "final").read_text() == str(expected_value(12))
    assert [a["cause"] for a in runs_of(state_home, "two")[0]["attempts"]] == ["preempted", "ok"]
    assert (state_home / "pods" / "two" / "id_ed25519").read_bytes() == key
    assert spot_api.calls.count(("POST", "queuedResources/")) == 2  # up's, one recovery's
    assert cli("exec", "--pod", "two", "--", "true").code == 0  # the new TPU takes the key


@pytest.mark.timeout(300)
def test_a_tpu_that_is_gone_is_a_state_and_a_new_run_creates_it_again(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    """Issue 37: after `cancel` deleted the TPU a recovery was making, `status` raised
    NotFound and a new --retries run probed the 404, called it a lost worker and never
    made the TPU. Gone is a state: status says so and how to bring it back; a run makes it."""
    assert cli(*UP, "--name", "gn", "--tpu-type", "v4-16", "--spot").code == 0
    run = start_run("gn", shared_dir / "a", 500, "--retries", "2")
    wait_for(shared_dir / "a" / "3.ckpt", run, timeout=60)
    spot_api.no_capacity = 10_000  # the recovery waits for capacity...
    spot_api.preempt_with_notice("gn")

    def creating() -> bool:
        return runs_of(state_home, "gn")[0]["phase"] == "create" and (
            spot_api.calls.count(("POST", "queuedResources/")) == 2
        )

    wait_until(creating, run, timeout=90)
    run_id = runs_of(state_home, "gn")[0]["run_id"]
    assert cli("cancel", "--pod", "gn", run_id, timeout=150).code == 0  # ...and is cancelled
    run.communicate(timeout=60)
    assert spot_api.resources == {}  # the TPU is gone
    shown = cli("status", "--pod", "gn")
    assert shown.code == 255 and "Traceback" not in shown.err, shown.err
    assert "cloud state GONE" in shown.out, shown.out
    hint = shown.err.strip().splitlines()[-1]
    assert hint.startswith("hint: ") and "tpupod up --recreate --name gn" in hint, shown.err
    as_json = json.loads(cli("status", "--pod", "gn", "--format", "json").out)
    assert as_json["cloud_state"] == "GONE" and not as_json["healthy"]
    spot_api.no_capacity = 0
    again = start_run("gn", shared_dir / "b", 6, "--retries", "1")
    _, err = again.communicate(timeout=200)
    assert again.returncode == 0, err
    assert (shared_dir / "b" / "final").read_text() == str(expected_value(6))
    new = runs_of(state_home, "gn")[-1]
    assert [a["cause"] for a in new["attempts"]] == ["ok"], err  # made first: no recovery
    assert "create" in new["attempts"][0]["phases"]
    assert new["counters"]["recoveries"] == 0
    assert "not answering" not in err and "within the budget" not in err
    assert set(spot_api.alive()) == {"gn"}
    assert cli("status", "--pod", "gn").code == 0
