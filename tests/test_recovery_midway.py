"""``tpupod run --retries`` on a spot TPU preempted in the middle of something (issue 23):
while the code is synced (the recovery syncs again on the new TPU), and while a real Orbax
checkpoint is written (the step cut short is skipped on restore)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, tpupod_argv
from tests.fakes.tpu_api import TpuApiStandIn
from tests.test_recovery_gcp import (
    PROGRAM,
    UP,
    expected_value,
    record_of,
    wait_for,
)
from tpupod.sim import SimPod

ORBAX_PROGRAM = str(Path(__file__).parent / "programs" / "orbax_steps.py")


def host_indexes(cli: Callable[..., CliResult], sim: SimPod, pod: str) -> list[int]:
    """The simulated hosts the pod's TPU was handed."""
    addresses = {
        w["internal_address"]
        for w in json.loads(cli("hosts", "--pod", pod, "--format", "json").out)
    }
    return [h.index for h in sim.hosts if h.address in addresses]


def popen(argv: list[str], cwd: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )


@pytest.mark.timeout(300)
def test_preempted_during_sync_syncs_the_new_tpu_and_finishes(
    spot_api: TpuApiStandIn,
    sim_hosts_up: SimPod,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
    tmp_path: Path,
) -> None:
    repo = tmp_path / "code"
    repo.mkdir()
    (repo / "train.txt").write_text("the code every attempt runs\n")
    git = ("git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t")
    for args in (("init", "-q"), ("add", "."), ("commit", "-q", "-m", "code")):
        subprocess.run([*git, *args], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert cli(*UP, "--name", "sy", "--tpu-type", "v4-16", "--spot", "--api", "tpu-vm").code == 0
    # The first TPU's hosts check out slowly (a hook in their own, fresh home): the sync is
    # still under way when the preemption comes. A recreated TPU's hosts have no such hook.
    hooks = shared_dir / "hooks"
    hooks.mkdir()
    (hooks / "post-checkout").write_text(
        f"#!/bin/sh\ntouch {shared_dir}/syncing-$(hostname)\nsleep 120\n"
    )
    (hooks / "post-checkout").chmod(0o755)
    first = host_indexes(cli, sim_hosts_up, "sy")
    for index in first:
        done = sim_hosts_up.run_on(index, f"git config --global core.hooksPath {hooks}")
        assert done.returncode == 0, done.stderr
    command = (sys.executable, PROGRAM, str(shared_dir), "6", "0.2")
    run = popen(
        tpupod_argv("run", "--pod", "sy", "--retries", "1", "--sync", "code", "--", *command),
        cwd=repo,
    )  # fmt: skip
    wait_for(shared_dir / f"syncing-host-{first[0]}", run, timeout=90)
    spot_api.preempt_with_notice("sy")
    _, err = run.communicate(timeout=200)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(6))
    record = record_of(state_home, "sy")
    assert [a["cause"] for a in record["attempts"]] == ["preempted", "ok"], err
    assert record["commit"] == head.strip()
    assert not (shared_dir / "started-1").exists()  # attempt 1 never got past its sync
    assert (shared_dir / "started-2").read_text() == "0"
    assert err.count(f"every worker at {head[:12]} in code") == 1  # the new TPU's sync
    # only the first TPU's hosts ran the hook: the new ones were synced from nothing
    synced = {p.name for p in shared_dir.glob("syncing-*")}
    assert synced <= {f"syncing-host-{i}" for i in first}, synced


def orbax_final(steps: int) -> bytes:
    import numpy as np

    value = np.arange(4, dtype=np.int64)
    for step in range(steps):
        value = (value * 31 + step) % 1_000_003
    return value.tobytes()


@pytest.mark.timeout(300)
def test_preempted_during_a_checkpoint_write_skips_the_cut_step_on_restore(
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
) -> None:
    import numpy as np

    ckpt, final, cut_at, steps = shared_dir / "ckpt", shared_dir / "final.npy", 3, 6
    assert cli(*UP, "--name", "cw", "--tpu-type", "v4-16", "--spot").code == 0
    run = popen(
        tpupod_argv("run", "--pod", "cw", "--retries", "1", "--",
                    sys.executable, ORBAX_PROGRAM, str(ckpt), str(steps), str(cut_at), str(final))
    )  # fmt: skip
    wait_for(shared_dir / "cut", run, timeout=120)  # step 3 written, its commit under way
    assert sorted(p.name for p in ckpt.iterdir()) == ["0", "1", "2", "3.orbax-checkpoint-tmp"]
    spot_api.preempt_with_notice("cw")
    out, err = run.communicate(timeout=200)
    assert run.returncode == 0, err
    record = record_of(state_home, "cw")
    assert [a["cause"] for a in record["attempts"]] == ["preempted", "ok"], err
    assert "worker 0 attempt 2 from step 3" in out  # the cut step skipped: redone
    assert np.load(final).tobytes() == orbax_final(steps)  # as an uninterrupted run ends
    assert sorted(p.name for p in ckpt.iterdir()) == [str(s) for s in range(steps)]
