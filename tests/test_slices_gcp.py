"""Slices on Cloud TPUs (issue 39): separate TPUs (``up --gcp --slices N``) and a multislice
queued resource (``--node-count N``) on the strict TPU API stand-in, with simulated hosts.

Separate slices get their ``MEGASCALE_*`` from tpupod; a multislice queued resource from
GCP's ``tpu-env``, which tpupod reads and checks but never overrides. A preempted separate
slice is replaced alone; a queued resource, whole (GCP suspends it whole).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, tpupod_argv
from tests.fakes.tpu_api import TpuApiStandIn
from tests.test_recovery_gcp import (
    assert_same_arrays,
    expected_value,
    record_of,
    start_run,
    steps_done,
    wait_for,
    wait_until_step,
)
from tests.test_slices import SHOW_ENV, envs
from tpupod.sim import SimPod

UP = ("up", "--gcp", "--zone", "us-central2-b", "--project", "proj", "--user", "root")
PYTHON = sys.executable


# -- bad input: refused before any call ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--slices", "2", "--node-count", "2"), "pick one form"),
        (("--slices", "65"), "--slices: must be at most 64"),
        (("--node-count", "65"), "--node-count: must be at most 64"),
        (("--slices", "0"), "--slices: must be at least 1"),
        (("--name", "a" * 62, "--slices", "2"), "longer than the API's 63 characters"),
        # a queued resource names its slices' nodes NAME-0..N-1 too (from the slices trial)
        (("--name", "a" * 62, "--node-count", "2"), "longer than the API's 63 characters"),
    ],
)
def test_bad_slices_are_one_line_before_any_call(
    args: tuple[str, ...],
    words: str,
    cli_in_process: Callable[..., CliResult],
    bare_tpu_api: tuple[TpuApiStandIn, str],
) -> None:
    api, endpoint = bare_tpu_api
    named = () if "--name" in args else ("--name", "bad")
    for extra in (("--dry-run",), ()):
        result = cli_in_process(
            *UP, *named, "--tpu-type", "v4-8", *args, *extra,
            env={"TPUPOD_TPU_API_ENDPOINT": endpoint},
        )  # fmt: skip
        assert result.code == 2, result.err
        error, hint = result.err.strip().splitlines()[-2:]
        assert error.startswith("error: ") and words in error, result.err
        assert hint.startswith("hint: ") and "Traceback" not in result.err
    assert api.calls == []


# -- what the workers see ----------------------------------------------------------------------


def test_separate_slices_get_their_megascale_variables_from_tpupod(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    made = cli(*UP, "--name", "sep", "--tpu-type", "v4-16", "--slices", "2")
    assert made.code == 0, made.err
    assert "v4-16 x 2 separate slices" in made.out
    assert sorted(tpu_api.alive()) == ["sep-0", "sep-1"]
    hosts = json.loads(cli("hosts", "--pod", "sep", "--format", "json").out)
    assert [(w["id"], w["slice"]) for w in hosts] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    result = cli("run", "--pod", "sep", "--", PYTHON, "-c", SHOW_ENV)
    assert result.code == 0, result.err
    seen = envs(result)
    first = hosts[0]["internal_address"]
    for worker, env in seen.items():
        assert env["TPUPOD_WORKER_ID"] == str(worker)
        assert env["TPUPOD_SLICE_ID"] == env["MEGASCALE_SLICE_ID"] == str(worker // 2)
        assert env["MEGASCALE_NUM_SLICES"] == "2" and env["TPU_WORKER_ID"] == str(worker % 2)
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{first}:8080"
    # -w s1: one slice alone is a pod of one slice (no MEGASCALE_*: JAX's single slice)
    alone = envs(cli("run", "--pod", "sep", "-w", "s1", "--", PYTHON, "-c", SHOW_ENV))
    assert sorted(alone) == [0, 1] and not any("MEGASCALE_NUM_SLICES" in e for e in alone.values())
    gone = cli("down", "--pod", "sep")
    assert gone.code == 0, gone.err
    assert {("DELETE", "nodes/sep-0"), ("DELETE", "nodes/sep-1")} <= set(tpu_api.calls)
    assert not tpu_api.resources


@pytest.fixture
def metadata_on_hosts(
    tpu_api: TpuApiStandIn, sim_hosts_up: SimPod, monkeypatch: pytest.MonkeyPatch
) -> TpuApiStandIn:
    """The stand-in, restarted where simulated hosts reach its metadata server."""
    tpu_api.stop()
    endpoint = tpu_api.start("0.0.0.0")
    monkeypatch.setenv("TPUPOD_TPU_API_ENDPOINT", endpoint)
    url = f"http://{sim_hosts_up.gateway}:{tpu_api.port}/computeMetadata/v1"
    monkeypatch.setenv("TPUPOD_METADATA_URL", url)
    return tpu_api


def test_a_queued_resources_tpu_env_is_read_and_checked_never_overridden(
    metadata_on_hosts: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    api = metadata_on_hosts
    assert cli(*UP, "--name", "qr", "--tpu-type", "v4-16", "--node-count", "2").code == 0
    result = cli("run", "--pod", "qr", "--", PYTHON, "-c", SHOW_ENV)
    assert result.code == 0, result.err
    seen = envs(result)
    assert sorted(seen) == [0, 1, 2, 3]
    for worker, env in seen.items():  # tpupod's own variables; MEGASCALE_* are GCP's
        assert env["TPUPOD_SLICE_ID"] == str(worker // 2) and env["TPUPOD_NUM_SLICES"] == "2"
        assert not any(key.startswith("MEGASCALE_") for key in env)
    # GCP's view and the pod's disagree: refused, both values named, nothing started
    api.tpu_env_override = {"MEGASCALE_NUM_SLICES": "3"}
    wrong = cli("run", "--pod", "qr", "--", PYTHON, "-c", SHOW_ENV)
    assert wrong.code != 0 and "[w0] env" not in wrong.out
    error = next(line for line in wrong.err.splitlines() if line.startswith("error: "))
    assert "tpu-env says MEGASCALE_NUM_SLICES '3', tpupod's run has 2" in error, wrong.err
    assert "w0 (slice 0)" in error and "Traceback" not in wrong.err
    assert any(line.startswith("hint: ") for line in wrong.err.splitlines())
    # one slice of a queued resource alone: its workers would join every slice
    api.tpu_env_override = {}
    alone = cli("run", "--pod", "qr", "-w", "s1", "--", "true")
    assert alone.code != 0
    assert "tpu-env says MEGASCALE_NUM_SLICES '2', tpupod's run has 1" in alone.err, alone.err
    assert cli("down", "--pod", "qr").code == 0


# -- recovery: a separate slice alone, a queued resource whole -----------------------------------


def addresses(cli: Callable[..., CliResult], name: str) -> list[tuple[int, str]]:
    hosts = json.loads(cli("hosts", "--pod", name, "--format", "json").out)
    return [(w["slice"], w["internal_address"]) for w in hosts]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("shape", "preempted", "deleted", "created"),
    [
        # separate spot slices: each its own queued resource; only sp-1 goes and comes back
        (("--slices", "2"), "sp-1", ["queuedResources/sp-1"], 3),
        # one multislice queued resource: a slice's preemption suspends it whole
        (("--node-count", "2"), "sp-1", ["queuedResources/sp"], 2),
    ],
)
def test_a_preempted_slice_is_replaced_as_gcp_preempts_it(
    shape: tuple[str, ...],
    preempted: str,
    deleted: list[str],
    created: int,
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
) -> None:
    assert cli(*UP, "--name", "sp", "--tpu-type", "v4-8", "--spot", *shape).code == 0
    before = addresses(cli, "sp")
    run = start_run("sp", shared_dir, 12, "--retries", "2", save_every=4)
    wait_for(shared_dir / "3.ckpt", run, timeout=60)
    wait_until_step(shared_dir, 5, run)
    spot_api.preempt_with_notice(preempted)
    _, err = run.communicate(timeout=180)
    assert run.returncode == 0, err
    assert (shared_dir / "final").read_text() == str(expected_value(12))
    record = record_of(state_home, "sp")
    assert [a["cause"] for a in record["attempts"]] == ["preempted", "ok"], err
    done = steps_done(shared_dir)
    assert len(done) == len(set(done)) == 12, done  # saved at the notice, nothing redone
    deletes = [call for method, call in spot_api.calls if method == "DELETE"]
    assert deletes == deleted, spot_api.calls
    assert spot_api.calls.count(("POST", "queuedResources/")) == created
    after = addresses(cli, "sp")
    assert [s for s, _ in after] == [0, 1]
    if "--slices" in shape:  # slice 0 stayed up: same host, never handed out again
        assert after[0] == before[0] and spot_api.generation[before[0][1]] == 1
        assert "replacing slice 1 alone; slice 0 stays up" in err, err
        assert after[1] != before[1]  # a new TPU: other hosts, booted fresh
    assert set(spot_api.alive()) == (
        {"sp-0", "sp-1"} | ({"sp"} if "--node-count" in shape else set())
    )


TRAIN = str(Path(__file__).parents[1] / "examples" / "multislice_train.py")


def train(ckpt: Path, out: Path, steps: int, save_every: int) -> tuple[str, ...]:
    return (PYTHON, TRAIN, "--ckpt", str(ckpt), "--steps", str(steps), "--save-every",
            str(save_every), "--step-seconds", "0.3", "--out", str(out))  # fmt: skip


@pytest.mark.timeout(420)  # JAX on two hosts, three times, on a busy machine
def test_a_multislice_jax_run_survives_a_slice_replaced_with_the_same_parameters(
    spot_api: TpuApiStandIn,
    cli: Callable[..., CliResult],
    shared_dir: Path,
    state_home: Path,
) -> None:
    """examples/multislice_train.py on two separate spot slices; slice 1 preempted mid-run,
    replaced alone; Orbax restores into the new mesh: the final parameters are an
    undisturbed run's, bit for bit (the same mesh, the same reduction order)."""
    steps = 24
    local = cli("up", "--name", "ref", "--local", "2", "--slices", "2")
    assert local.code == 0, local.err
    reference = cli(
        "run", "--pod", "ref", "--",
        *train(shared_dir / "ref", shared_dir / "ref.npz", steps, 50), timeout=200,
    )  # fmt: skip
    assert reference.code == 0, reference.err
    assert cli(*UP, "--name", "jx", "--tpu-type", "v4-8", "--spot", "--slices", "2").code == 0
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", "jx", "--retries", "2", "--",
                    *train(shared_dir / "ckpt", shared_dir / "out.npz", steps, 4)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(shared_dir / "ckpt" / "4", run, timeout=200)  # Orbax saves steps 0, 4, 8, ...
    time.sleep(1)  # a step or two past the periodic save
    spot_api.preempt_with_notice("jx-1")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert_same_arrays(shared_dir / "out.npz", shared_dir / "ref.npz")
    record = record_of(state_home, "jx")
    assert [a["cause"] for a in record["attempts"]] == ["preempted", "ok"]
    assert [c for m, c in spot_api.calls if m == "DELETE"] == ["queuedResources/jx-1"]
    resumed = re.findall(r"attempt 2, from step (\d+)", out)
    assert resumed and int(resumed[0]) > 4, out


def test_status_and_recreate_see_each_separate_slice(
    tpu_api: TpuApiStandIn, cli: Callable[..., CliResult]
) -> None:
    """One slice's TPU gone: status names it, asks only the other slice's workers, and
    `up --recreate` makes that slice alone again, keeping the other."""
    up = (*UP, "--name", "st", "--tpu-type", "v4-8", "--spot", "--slices", "2")
    assert cli(*up).code == 0
    kept = addresses(cli, "st")[0]
    tpu_api.preempt("st-1")
    tpu_api.handle(
        "DELETE", "/v2/projects/proj/locations/us-central2-b/queuedResources/st-1", {}, {}
    )
    found = cli("status", "--pod", "st")
    assert found.code == 255, found.err
    assert "cloud state st-0 ACTIVE, st-1 GONE" in found.out, found.out
    rows = [line.split() for line in found.out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert rows[0][3] == "yes" and rows[1][3] == "NO" and "its TPU is gone" in found.out
    assert "hint: the TPU of slice 1 no longer exists" in found.err, found.err
    data = json.loads(cli("status", "--pod", "st", "--format", "json").out)
    assert data["slice_states"] == ["ACTIVE", "GONE"] and not data["healthy"]
    posts = tpu_api.calls.count(("POST", "queuedResources/"))
    again = cli(*up, "--recreate")
    assert again.code == 0, again.err
    assert "st-0: ACTIVE; kept" in again.err, again.err
    assert tpu_api.calls.count(("POST", "queuedResources/")) == posts + 1
    assert addresses(cli, "st")[0] == kept
    assert cli("status", "--pod", "st").code == 0
    # nothing broken: --recreate refuses, as for one TPU
    refused = cli(*up, "--recreate")
    assert refused.code != 0 and "--recreate replaces a preempted or failed one" in refused.err
    assert cli("down", "--pod", "st").code == 0
