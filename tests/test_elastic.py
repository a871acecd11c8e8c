"""``run --retries K --elastic`` (issue 42): training goes on while a preempted slice comes
back, on the strict TPU API stand-in with simulated hosts: 3 slices of 2 workers (v4-16)
on a simulated pod of 8 hosts of this module's, the rest on the session's 4 (v4-8 slices,
one host each)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    CliResult,
    require,
    reset_sim,
    spot_stand_in,
    tpupod_argv,
)
from tests.fakes.tpu_api import TpuApiStandIn
from tests.test_recovery_gcp import (
    PROGRAM,
    expected_value,
    record_of,
    start_run,
    steps_done,
    wait_for,
    wait_until_step,
)
from tpupod.sim import SimPod, missing_prerequisites

UP = ("up", "--gcp", "--zone", "us-central2-b", "--project", "proj", "--user", "root")


@pytest.fixture(scope="module")
def sim8() -> Iterator[SimPod]:
    """A simulated pod of 8 hosts: 3 slices of 2, and 2 for the slice made again."""
    missing = missing_prerequisites()
    require(not missing, f"a simulated pod needs {', '.join(missing)}")
    with SimPod(8) as pod:
        yield pod


@pytest.fixture
def spot_api8(sim8: SimPod, monkeypatch: pytest.MonkeyPatch) -> Iterator[TpuApiStandIn]:
    """conftest's spot_api over ``sim8``."""
    yield from spot_stand_in(sim8, monkeypatch)
    reset_sim(sim8)


@pytest.mark.ssh
@pytest.mark.timeout(300)
def test_a_preempted_slice_is_made_again_while_the_run_goes_on_then_it_grows_back(
    spot_api8: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    """3 slices of 2 workers; slice 2 preempted at step 6 with 20 s of provisioning: the
    run goes on with slices 0-1 within 15 s of the confirmation, slice 2 comes back, the
    run grows back to 3 slices at a checkpoint, and ends with an undisturbed run's value,
    each change redoing at most one checkpoint interval (2 steps)."""
    spot_api = spot_api8
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-16", "--spot", "--slices", "3").code == 0
    steps = 60
    run = start_run("el", shared_dir, steps, "--retries", "2", "--elastic", save_every=2)
    wait_until_step(shared_dir, 6, run, timeout=90)
    spot_api.provision_s = 20
    spot_api.preempt_with_notice("el-2")
    preempted = time.monotonic()
    wait_for(shared_dir / "started-2", run, timeout=60)
    assert time.monotonic() - preempted < 15 + 3  # + the stand-in's notice window
    wait_for(shared_dir / "started-3", run, timeout=120)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(steps))
    record = record_of(state_home, "el")
    causes = [a["cause"] for a in record["attempts"]]
    assert causes == ["preempted", "grown", "ok"], err
    assert [a["slices"] for a in record["attempts"]] == [None, [0, 1], None]
    assert "slice 2 being made again: going on with 2 of 3 slices" in err, err
    # the slice, not the pod (a trial: "TPU 'el' is SUSPENDED" for el-2 alone)
    assert re.search(r"TPU 'el-2' \(slice 2\) is [A-Z]+: preempted", err), err
    assert re.search(r"preempted \(TPU 'el-2' \(slice 2\) (was|is) [A-Z]+\)", err), err
    assert "could not free the accelerator" not in err, err  # the lost slice's hosts: gone
    assert re.search(r"slice 2 is back after \d+ s", err), err
    assert "growing to 3 of 3 slices at a checkpoint" in err, err
    done = steps_done(shared_dir)
    assert sorted(set(done)) == list(range(steps))
    assert len(done) - steps <= 2 * 2, done  # at most one interval redone per change
    deletes = [call for method, call in spot_api.calls if method == "DELETE"]
    assert deletes == ["queuedResources/el-2"], spot_api.calls
    status = cli("status", "--pod", "el")
    assert "slice 2 is back" in status.out and "goodput" in status.out, status.out
    assert re.search(r"attempt 2: grown, exit \d+; launch [-\d\w]+; on slice 0, 1;", status.out)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--elastic",), "hint: e.g. --retries 3 --elastic"),
        (("--retries", "1", "--min-slices", "2"), "--min-slices is --elastic's"),
        (("--retries", "1", "--elastic", "--min-slices", "4"), "--min-slices 4: pod 'el'"),
        (("--retries", "1", "--elastic", "-w", "s0"), "leave -w out"),
    ],
)
def test_elastic_options_are_refused_before_any_work(
    args: tuple[str, ...], words: str, tpu_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-8", "--slices", "3").code == 0
    refused = cli("run", "--pod", "el", *args, "--", "true")
    assert refused.code == 2 and words in refused.err, refused.err


def test_elastic_on_a_pod_of_one_slice_is_refused(
    make_pod: Callable[..., object], cli: Callable[..., CliResult]
) -> None:
    cli("up", "--name", "one", "--local", "2")
    refused = cli("run", "--pod", "one", "--retries", "1", "--elastic", "--", "true")
    assert refused.code == 2, refused.err
    assert "is not a pod of separate TPU slices" in refused.err
    assert "hint: make one with 'tpupod up --gcp --slices N'" in refused.err


def start_elastic(
    shared_dir: Path, steps: int, *options: str, wrap: str = ""
) -> subprocess.Popen[str]:
    """``run --retries 3 --elastic`` of tests/programs/steps.py on pod 'el' (``wrap``: a
    shell line that runs before it, in the worker's environment)."""
    command = [sys.executable, PROGRAM, str(shared_dir), str(steps), "0.4", "2"]
    if wrap:  # the workers' python is no longer the command's: named
        command = ["bash", "-c", f'{wrap}; exec "$@"', "wrap", *command]
        options = (*options, "--worker-python", sys.executable)
    return subprocess.Popen(
        tpupod_argv("run", "--pod", "el", "--retries", "3", "--elastic", *options, "--",
                    *command),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def ends_well(run: subprocess.Popen[str], shared_dir: Path, steps: int) -> str:
    """The run's stderr, once it ended well with an undisturbed run's value."""
    _, err = run.communicate(timeout=200)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(steps)), err
    return err


@pytest.mark.timeout(300)
def test_with_fewer_slices_left_than_min_slices_the_run_waits_and_says_so(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-8", "--spot", "--slices", "3").code == 0
    run = start_elastic(shared_dir, 40, "--min-slices", "2")
    wait_until_step(shared_dir, 4, run, timeout=90)
    spot_api.provision_s = 15
    spot_api.preempt_with_notice("el-1")
    spot_api.preempt_with_notice("el-2")
    err = ends_well(run, shared_dir, 40)
    assert re.search(r"1 of 3 slices there, --min-slices 2: waiting for slice 1, 2 to come "
                     r"back", err), err  # fmt: skip
    assert "going on with 1 of 3" not in err, err  # a trial: said, then waited
    record = record_of(state_home, "el")
    assert record["attempts"][-1]["slices"] is None, record["attempts"]
    # a trial: two slices back at once made a launch on 2 grow at once (0.6 s)
    wasted = [a for a in record["attempts"] if a["cause"] == "grown" and a["phases"]["run"] < 3]
    assert not wasted, record["attempts"]


@pytest.mark.timeout(300)
def test_a_program_that_cannot_run_on_fewer_slices_falls_back_to_waiting_for_all(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-8", "--spot", "--slices", "3").code == 0
    refuses = ('[ "$TPUPOD_NUM_SLICES" = 3 ] || { echo "cannot restore into '
               '$TPUPOD_NUM_SLICES slices" >&2; exit 3; }')  # fmt: skip
    run = start_elastic(shared_dir, 30, wrap=refuses)
    wait_until_step(shared_dir, 4, run, timeout=90)
    spot_api.provision_s = 10
    spot_api.preempt_with_notice("el-2")
    err = ends_well(run, shared_dir, 30)
    record = record_of(state_home, "el")
    causes = [a["cause"] for a in record["attempts"]]
    assert causes == ["preempted", "program error", "ok"], err
    assert record["counters"]["error_reruns"] == 0
    assert "the program failed on 2 of 3 slices" in err, err
    assert "waiting for every slice" in err


@pytest.mark.timeout(300)
def test_a_launcher_killed_between_shrink_and_grow_is_resumed_and_grows_back(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-8", "--spot", "--slices", "3").code == 0
    run = start_elastic(shared_dir, 90)
    wait_until_step(shared_dir, 4, run, timeout=90)
    spot_api.provision_s = 20
    spot_api.preempt_with_notice("el-2")
    wait_for(shared_dir / "started-2", run, timeout=60)
    run.kill()  # kill -9: its workers on slices 0-1 go on, slice 2 is half made
    run.communicate()
    run_id = record_of(state_home, "el")["run_id"]
    resumed = subprocess.Popen(
        tpupod_argv("run", "--pod", "el", "--resume", run_id),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    err = ends_well(resumed, shared_dir, 90)
    assert "slice 2 is back" in err and "growing to 3 of 3" in err, err
    record = record_of(state_home, "el")
    assert [a["slices"] for a in record["attempts"]][-1] is None
    deletes = [c for m, c in spot_api.calls if m == "DELETE"]
    assert deletes == ["queuedResources/el-2"], spot_api.calls  # the half-made one kept


@pytest.mark.timeout(300)
def test_a_preemption_during_a_grow_shrinks_again_and_the_run_ends_well(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-8", "--spot", "--slices", "3").code == 0
    run = start_elastic(shared_dir, 90)
    assert run.stderr is not None
    wait_until_step(shared_dir, 4, run, timeout=90)
    spot_api.provision_s = 10
    spot_api.preempt_with_notice("el-2")
    seen = ""
    for line in run.stderr:
        seen += line
        if "growing to 3 of 3 slices" in line:
            spot_api.preempt_with_notice("el-0")  # while the attempt saves to grow
            break
    err = seen + ends_well(run, shared_dir, 90)
    deletes = [c for m, c in spot_api.calls if m == "DELETE"]
    assert sorted(deletes) == ["queuedResources/el-0", "queuedResources/el-2"], err
    assert "slice 0 is back" in err, err
    record = record_of(state_home, "el")
    assert record["attempts"][-1]["slices"] is None, record["attempts"]


TRAIN = str(Path(__file__).parents[1] / "examples" / "multislice_train.py")


def train(ckpt: Path, out: Path, steps: int) -> tuple[str, ...]:
    # a global batch of 48 splits evenly over 3 slices and over 2 (x devices of a slice)
    return (sys.executable, TRAIN, "--ckpt", str(ckpt), "--steps", str(steps), "--save-every",
            "4", "--step-seconds", "0.3", "--batch", "48", "--out", str(out))  # fmt: skip


@pytest.mark.timeout(480)  # JAX on three hosts, then two, then three, and a reference
def test_a_jax_run_goes_on_with_fewer_slices_and_ends_with_an_undisturbed_runs_parameters(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    """examples/multislice_train.py on 3 separate slices, slice 2 preempted: it goes on
    with 2 (Orbax restores the checkpoint into the smaller mesh), grows back to 3, and ends
    with the parameters of an undisturbed run on 3 slices within float32 rounding: the
    global batch is the same on 2 slices, only the order of the gradients' reduction
    changes with the mesh (a few ulps a step; 1e-5 relative after 80 steps of plain
    gradient descent at lr 0.1 leaves a margin of ten)."""
    import numpy as np

    steps = 80  # time enough to grow back: ~20 s of steps after the notice
    assert cli("up", "--name", "ref", "--local", "3", "--slices", "3").code == 0
    ref = train(shared_dir / "ref", shared_dir / "ref.npz", steps)
    reference = cli("run", "--pod", "ref", "--", *ref, timeout=300)
    assert reference.code == 0, reference.err
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-8", "--spot", "--slices", "3").code == 0
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", "el", "--retries", "2", "--elastic", "--",
                    *train(shared_dir / "ckpt", shared_dir / "out.npz", steps)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(shared_dir / "ckpt" / "4", run, timeout=240)
    spot_api.provision_s = 8
    spot_api.preempt_with_notice("el-2")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    record = record_of(state_home, "el")
    assert [a["slices"] for a in record["attempts"]][:2] == [None, [0, 1]], err
    assert "grown" in [a["cause"] for a in record["attempts"]], err
    got, want = np.load(shared_dir / "out.npz"), np.load(shared_dir / "ref.npz")
    for name in want.files:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(300)
def test_a_run_cancelled_while_a_slice_is_made_again_deletes_it_and_recreate_mends_the_pod(
    spot_api: TpuApiStandIn, cli: Callable[..., CliResult], shared_dir: Path, state_home: Path
) -> None:
    """A trial: `tpupod cancel` during a regrowth left the slice being made (PROVISIONING,
    then ACTIVE) with the pod's record still on the preempted host, and the hint's
    `up --recreate` refused ('el-0 is ACTIVE'): only down and up mended it. The slice a
    stopped run was making is deleted, as a stopped recovery's, and the hint works."""
    assert cli(*UP, "--name", "el", "--tpu-type", "v4-8", "--spot", "--slices", "3").code == 0
    run = start_elastic(shared_dir, 200)
    wait_until_step(shared_dir, 4, run, timeout=90)
    spot_api.provision_s = 60
    spot_api.preempt_with_notice("el-2")
    wait_for(shared_dir / "started-2", run, timeout=60)
    run_id = record_of(state_home, "el")["run_id"]
    assert cli("cancel", "--pod", "el", run_id).code == 0
    _, err = run.communicate(timeout=60)
    assert "deleting el-2, which the run was making again" in err, err
    hint = "'tpupod up --name el --recreate'"
    assert hint in err, err
    spot_api.provision_s = 0
    mended = cli("up", "--name", "el", "--recreate", timeout=120)
    assert mended.code == 0, mended.err
    ran = cli("exec", "--pod", "el", "--", "true", timeout=60)  # every worker answers
    assert ran.code == 0, ran.err


@pytest.mark.timeout(180)
def test_the_example_saves_at_the_notice_on_one_process_too(
    make_pod: Callable[..., object], cli: Callable[..., CliResult], shared_dir: Path
) -> None:
    """A trial: an elastic run down to one slice of one worker was grown back with the
    notice (SIGTERM), and the example died without its save (`[w0] Terminated`): JAX's
    preemption sync point is jax.distributed's, and one process has none. The example
    catches SIGTERM itself there and saves at the end of the step."""
    import psutil

    cli("up", "--name", "one", "--local", "1")
    ckpt = str(shared_dir / "ckpt")
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", "one", "--", sys.executable, TRAIN, "--ckpt", ckpt,
                    "--steps", "500", "--step-seconds", "0.1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert run.stdout is not None
    try:
        for line in run.stdout:
            if "step 5 loss" in line:
                break
        # python TRAIN --ckpt CKPT ..., not the tpupod run that has them among its arguments
        [worker] = [
            p for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [])[1:2] == [TRAIN] and ckpt in p.info["cmdline"]
        ]  # fmt: skip
        worker.terminate()  # the notice
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
        run.communicate()
    assert re.search(r"worker 0: preempted, saved step [0-9]+", out), out + err
    assert run.returncode == 143, err
