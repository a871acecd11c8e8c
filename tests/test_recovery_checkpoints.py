"""``tpupod.latest_checkpoint``: the newest complete Orbax step, local or gs:// (issue 23)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tpupod
from tests.conftest import CliResult
from tests.test_launch import needs_jax
from tpupod.pod.record import Pod


def test_the_newest_complete_step_of_a_real_checkpoint_manager(tmp_path: Path) -> None:
    import numpy as np
    import orbax.checkpoint as ocp

    assert tpupod.latest_checkpoint(tmp_path / "none") is None  # a first attempt
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    for step in (0, 5, 10):
        manager.save(step, args=ocp.args.StandardSave({"w": np.full(4, step, np.float32)}))
    manager.wait_until_finished()
    assert tpupod.latest_checkpoint(tmp_path / "ckpt") == 10
    # A write a preemption cut short: Orbax's temporary folder for step 15, never renamed.
    (tmp_path / "ckpt" / "15.orbax-checkpoint-tmp-1764230000").mkdir()
    (tmp_path / "ckpt" / "15.orbax-checkpoint-tmp-1764230000" / "partial").write_text("x")
    (tmp_path / "ckpt" / "notes").mkdir()
    assert tpupod.latest_checkpoint(str(tmp_path / "ckpt")) == 10
    restored = manager.restore(10, args=ocp.args.StandardRestore({"w": np.zeros(4, np.float32)}))
    assert restored["w"].tolist() == [10.0] * 4


def test_on_gs_a_step_counts_once_committed(gcs: Any) -> None:
    gcs.pipe("bkt/run/step_3/commit_success.txt", b"ok")
    gcs.pipe("bkt/run/step_3/state/data", b"x")
    gcs.pipe("bkt/run/step_8/state/data", b"x")  # no commit file: cut short
    gcs.invalidate_cache()
    assert tpupod.latest_checkpoint("gs://bkt/run") == 3
    gcs.pipe("bkt/run/step_8/commit_success.txt", b"ok")
    gcs.invalidate_cache()
    assert tpupod.latest_checkpoint("gs://bkt/run") == 8
    assert tpupod.latest_checkpoint("gs://bkt/nothing") is None


# On a pod: the examples' checkpoints on every worker (multi-host Orbax, through `tpupod run`).

TRAIN = str(Path(__file__).resolve().parents[1] / "examples" / "multislice_train.py")
PYTHON = sys.executable
CPU_2 = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}  # 2 workers x 2 devices


def train(ckpt: Path, steps: int, *options: str) -> tuple[str, ...]:
    return (PYTHON, TRAIN, "--steps", str(steps), "--ckpt", str(ckpt), "--save-every", "20",
            *options)  # fmt: skip


def starts(result: CliResult) -> list[tuple[int, int]]:
    """(worker, the step it starts from), as the example says it."""
    found = re.findall(r"worker (\d+): from step (\d+)", result.out)
    return sorted((int(worker), int(step)) for worker, step in found)


# Worker 2 alone looks in a folder of its own, as a host with its own disk would (no JAX).
LOOK = (
    "import sys, tpupod\n"
    "from pathlib import Path\n"
    "me = tpupod.worker()\n"
    "folder = Path(sys.argv[1]) / ('own' if me.id == 2 and len(sys.argv) > 2 else '')\n"
    "print('newest', tpupod.latest_checkpoint(folder))\n"
)


def test_on_a_pod_every_worker_gets_the_step_and_a_folder_of_its_own_is_refused(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(3)
    (tmp_path / "ckpt" / "7").mkdir(parents=True)
    (tmp_path / "ckpt" / "own" / "3").mkdir(parents=True)
    same = cli("run", "--pod", pod.name, "--", PYTHON, "-c", LOOK, str(tmp_path / "ckpt"))
    assert same.code == 0, same.err
    assert sorted(re.findall(r"^\[w(\d)\] newest (\S+)$", same.out, re.M)) == [
        ("0", "7"), ("1", "7"), ("2", "7")
    ]  # fmt: skip
    apart = cli("run", "--pod", pod.name, "--", PYTHON, "-c", LOOK, str(tmp_path / "ckpt"), "x")
    assert apart.code == 1, apart.err
    said = f"checkpoint folder {tmp_path / 'ckpt'} is not one folder for every worker: w2 ("
    assert said in apart.err, apart.err
    assert "newest" not in apart.out  # on every worker
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["7", "own"]  # no probe


@pytest.mark.timeout(180)
def test_a_checkpoint_folder_on_each_hosts_own_disk_is_refused_at_once_on_every_worker(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """The chaos harness's run (issue 41): --ckpt under /tmp on an SSH pod, where each
    simulated host has /tmp of its own, as separate machines have their own disks. Orbax's
    multi-host save needs one folder: w1 waited (10 minutes, Orbax's timeout) for a folder
    w0 had made on its own disk, w0 waited for w1, no step was ever committed, and the run
    said nothing for minutes on each of its attempts. Now every worker's
    ``tpupod.latest_checkpoint`` finds it before the first step, naming the workers that
    do not see the folder, and the run ends as the program's error: no attempt after it."""
    needs_jax()
    pod = make_ssh_pod(2, env=CPU_2)
    ckpt = tmp_path / "ckpt"  # /tmp: each host's own
    result = cli(
        "run", "--pod", pod.name, "--retries", "2", "--",
        *train(ckpt, 432, "--step-seconds", "0.25"), timeout=90,
    )  # fmt: skip
    assert result.code == 1, result.err[-3000:]
    said = f"checkpoint folder {ckpt} is not one folder for every worker: w1 ("
    assert said in result.err, result.err[-3000:]
    assert "step 0 " not in result.out  # before any step
    assert "attempt 2" not in result.err + result.out  # an error of the program: not rerun


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_the_example_checkpoints_and_resumes_on_two_workers_of_two_devices(
    kind: str,
    request: pytest.FixtureRequest,
    cli: Callable[..., CliResult],
    tmp_path: Path,
) -> None:
    """examples/multislice_train.py with --ckpt and no --step-seconds on 2 workers x 2 devices
    (where steps left in flight hung gloo), a local pod and an SSH pod with a folder the
    hosts share: every save is committed, and a second run resumes after the newest."""
    needs_jax()
    if kind == "local":
        pod = request.getfixturevalue("make_pod")(2, devices=2)
        ckpt = tmp_path / "ckpt"
    else:
        pod = request.getfixturevalue("make_ssh_pod")(2, env=CPU_2)
        ckpt = request.getfixturevalue("shared_dir") / "ckpt"
    first = cli("run", "--pod", pod.name, "-q", "--", *train(ckpt, 150), timeout=120)
    assert first.code == 0, first.err[-3000:]
    assert starts(first) == [(0, 0), (1, 0)]
    assert sorted(p.name for p in ckpt.iterdir()) == ["100", "120", "140"]  # no probe left
    assert tpupod.latest_checkpoint(ckpt) == 140
    again = cli("run", "--pod", pod.name, "-q", "--", *train(ckpt, 160), timeout=120)
    assert again.code == 0, again.err[-3000:]
    assert starts(again) == [(0, 141), (1, 141)]
