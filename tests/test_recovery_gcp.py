"""``tpupod run --retries`` on a spot TPU of the Cloud TPU API stand-in (issue 23).

The stand-in preempts as GCE does: the node PREEMPTED, the hosts' metadata
answering ``instance/preempted`` TRUE, TERM to every process on its hosts, and
after the notice window the hosts killed and taken away. A recreated TPU gets
freshly booted simulated hosts (nothing from before: no code, no setup).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult, tpupod_argv
from tests.fakes.tpu_api import TpuApiStandIn, on_sim_hosts
from tpupod.pod import Pod
from tpupod.sim import SimPod

PROGRAM = str(Path(__file__).parent / "programs" / "steps.py")
UP = ("up", "--gcp", "--zone", "us-central2-b", "--project", "proj", "--user", "root")
NOTICE_S = 3.0  # the stand-in's notice window: TERM, then this long before the hosts go


@pytest.fixture
def spot_api(sim_hosts_up: SimPod, monkeypatch: pytest.MonkeyPatch) -> Iterator[TpuApiStandIn]:
    """The stand-in, handing out the simulated hosts and preempting them as GCE does."""
    sim = sim_hosts_up
    api = on_sim_hosts(sim, NOTICE_S)
    monkeypatch.setenv("TPUPOD_TPU_API_ENDPOINT", api.start("0.0.0.0"))
    monkeypatch.setenv("TPUPOD_GCP_POLL_S", "0.05")
    monkeypatch.setenv("TPUPOD_RECOVERY_WATCH_S", "0.3")
    metadata = f"http://{sim.gateway}:{api.port}/computeMetadata/v1"
    monkeypatch.setenv("TPUPOD_METADATA_URL", metadata)
    yield api
    api.stop()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder every simulated host sees and writes (their /tmp and home are their own):
    where a real run keeps checkpoints (a bucket)."""
    path = Path("/dev/shm") / f"tpupod-recovery-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
    assert "--retries 2" in err and "1 recoveries" in err
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
    import numpy as np

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
    got, want = np.load(shared_dir / "out.npz"), np.load(shared_dir / "ref.npz")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes()
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
