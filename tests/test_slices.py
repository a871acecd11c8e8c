"""Pods of slices (issue 39, part 1): local pods of slices, the variables every worker sees,
``tpupod.mesh`` across slices against one process, a failure named by slice, bad input."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tests.test_launch import needs_jax
from tpupod.pod.record import Pod

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "multislice_train.py"
PYTHON = sys.executable
SHOW_ENV = (
    "import json, os; print('env', json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('TPUPOD_', 'MEGASCALE_', 'TPU_WORKER'))}))"
)


def up_slices(cli: Callable[..., CliResult], name: str = "ms") -> None:
    made = cli("up", "--name", name, "--local", "4", "--slices", "2", "-d", "2")
    assert made.code == 0, made.err
    assert "4 local workers in 2 slices" in made.out


def envs(result: CliResult) -> dict[int, dict[str, str]]:
    """Each worker's printed variables, by its [wN] prefix."""
    found = re.findall(r"^\[w(\d+)\] env (.*)$", result.out, re.M)
    return {int(worker): json.loads(text) for worker, text in found}


def test_every_worker_sees_its_slice_and_the_megascale_variables(
    cli: Callable[..., CliResult],
) -> None:
    up_slices(cli)
    result = cli("run", "--pod", "ms", "--", PYTHON, "-c", SHOW_ENV)
    assert result.code == 0, result.err
    seen = envs(result)
    assert sorted(seen) == [0, 1, 2, 3]
    port = seen[0]["MEGASCALE_PORT"]
    for worker, env in seen.items():
        assert env["TPUPOD_WORKER_ID"] == str(worker)  # one global numbering
        assert env["TPUPOD_NUM_WORKERS"] == "4"
        assert env["TPUPOD_SLICE_ID"] == env["MEGASCALE_SLICE_ID"] == str(worker // 2)
        assert env["TPUPOD_NUM_SLICES"] == env["MEGASCALE_NUM_SLICES"] == "2"
        assert env["TPUPOD_WORKERS_PER_SLICE"] == "2"
        # JAX's TPU cluster: id within the slice + slice id x workers per slice = global id
        assert env["TPU_WORKER_ID"] == str(worker % 2)
        assert env["TPU_WORKER_HOSTNAMES"] == "127.0.0.1,127.0.0.1"
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"127.0.0.1:{port}"
        assert env["MEGASCALE_PORT"] == port
    assert re.search(r"^w2\s+1\s+\S+\s+exit 0", result.err, re.M), result.err  # the slice column


def test_exec_selects_a_slice_and_sees_no_megascale(
    cli: Callable[..., CliResult],
) -> None:
    up_slices(cli)
    result = cli("exec", "--pod", "ms", "-w", "s1", "--", PYTHON, "-c", SHOW_ENV)
    assert result.code == 0, result.err
    seen = envs(result)
    assert sorted(seen) == [2, 3]
    assert all(env["TPUPOD_SLICE_ID"] == "1" for env in seen.values())
    assert not any(k.startswith("MEGASCALE_") for env in seen.values() for k in env)
    hosts = json.loads(cli("hosts", "--pod", "ms", "--format", "json").out)
    assert [w["slice"] for w in hosts] == [0, 0, 1, 1]


def test_a_run_of_one_slice_is_a_pod_of_one_slice(cli: Callable[..., CliResult]) -> None:
    up_slices(cli)
    result = cli("run", "--pod", "ms", "-w", "s1", "--", PYTHON, "-c", SHOW_ENV)
    assert result.code == 0, result.err
    seen = envs(result)
    assert sorted(seen) == [0, 1]  # renumbered 0..N-1, as JAX needs
    assert not any(k.startswith(("MEGASCALE_", "TPUPOD_SLICE")) for e in seen.values() for k in e)


def final_losses(result: CliResult) -> list[float]:
    return [float(x) for x in re.findall(r"final loss ([0-9.]+)", result.out)]


def test_training_across_slices_matches_one_process_with_every_device(
    cli: Callable[..., CliResult], make_pod: Callable[..., Pod]
) -> None:
    needs_jax()
    up_slices(cli)
    across = cli("run", "--pod", "ms", "--", PYTHON, str(TRAIN), "--steps", "4", timeout=120)
    assert across.code == 0, across.err[-2000:]
    assert "mesh {'data': 2, 'fsdp': 4}" in across.out
    one = make_pod(1, devices=8)  # one process, 8 devices: the same program, unchanged
    alone = cli("run", "--pod", one.name, "--", PYTHON, str(TRAIN), "--steps", "4", timeout=120)
    assert alone.code == 0, alone.err[-2000:]
    assert "mesh {'data': 1, 'fsdp': 8}" in alone.out
    losses, reference = final_losses(across), final_losses(alone)
    assert len(losses) == 4 and len(reference) == 1
    assert all(abs(loss - reference[0]) <= 1e-6 for loss in losses), (losses, reference)


def test_many_steps_without_sleeps_do_not_hang_on_cpu(
    cli: Callable[..., CliResult], make_pod: Callable[..., Pod]
) -> None:
    """The chaos harness's anchor run (issue 41): 2 workers of 2 devices, no
    --step-seconds. Steps left in flight hung every such run of 100 steps or more for good
    (gloo: each process waiting in a different step's collective)."""
    needs_jax()
    pod = make_pod(2, devices=2)
    result = cli(
        "run", "--pod", pod.name, "-q", "--", PYTHON, str(TRAIN), "--steps", "150", timeout=60
    )
    assert result.code == 0, result.err[-2000:]
    assert len(final_losses(result)) == 2


def test_a_failure_in_slice_1_ends_the_run_naming_slice_and_worker(
    cli: Callable[..., CliResult],
) -> None:
    needs_jax()
    up_slices(cli)
    program = (
        "import time, tpupod; me = tpupod.init_jax(); import jax; jax.devices()\n"
        "if me.slice == 1 and me.id == 2:\n"
        "    print('failing at', time.time(), flush=True); raise RuntimeError('slice 1 broke')\n"
        "time.sleep(120)"
    )
    result = cli("run", "--pod", "ms", "--grace", "2", "--", PYTHON, "-c", program, timeout=120)
    ended = time.time()
    assert result.code == 1, result.err[-2000:]
    failed_at = float(re.search(r"failing at ([0-9.]+)", result.out).group(1))  # type: ignore[union-attr]
    assert ended - failed_at < 5
    assert re.search(r"first failure: w2 \(slice 1, [^)]+\)", result.err), result.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--local", "4", "--slices", "3"), "--slices: 4 workers do not divide into 3 slices"),
        (("--local", "4", "--slices", "0"), "--slices: must be at least 1"),
        (("--ssh", "a,b", "--ssh", "c"), "--ssh: slice 1 has 1 host, slice 0 has 2"),
        (("--ssh", "a,b", "--ssh", "c,d", "--slices", "3"), "--slices 3 but --ssh is given 2"),
        (("--ssh", "a,b,c", "--slices", "2"), "--slices: 3 workers do not divide into 2 slices"),
    ],
)
def test_bad_slices_are_one_line_and_a_hint(
    args: tuple[str, ...], message: str, cli_in_process: Callable[..., CliResult]
) -> None:
    result = cli_in_process("up", "--name", "bad", *args)
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert message in lines[0], lines[0]


def test_slices_in_the_spec_file(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    spec = tmp_path / "tpupod.yaml"
    spec.write_text("name: ms\nworkers: 6\nslices: 3\n")
    made = cli("up", "-f", str(spec))
    assert made.code == 0, made.err
    hosts = json.loads(cli("hosts", "--pod", "ms", "--format", "json").out)
    assert [w["slice"] for w in hosts] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        ("s2", "slice 2 does not exist: the pod has slices 0-1"),
        ("s1-0", "range 's1-0' runs backwards"),
        ("0-2", "the selected workers are 2 of slice 0, 1 of slice 1"),
    ],
)
def test_bad_slice_selections(selection: str, message: str, cli: Callable[..., CliResult]) -> None:
    up_slices(cli)
    result = cli("run", "--pod", "ms", "-w", selection, "--", "true")
    assert result.code == 2, result.err
    assert message in result.err and "hint: " in result.err


def test_a_slice_selection_on_a_pod_without_slices(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    """A pod of one slice is slice 0 (from the slices trial: a script written for a pod of
    slices, with -w s0, runs unchanged on one); s1 does not exist there."""
    pod = make_pod(2)
    result = cli("exec", "--pod", pod.name, "-w", "s0", "--", "true")
    assert result.code == 0, result.err
    assert "2/2 ok" in result.err or result.err == "", result.err
    wrong = cli("exec", "--pod", pod.name, "-w", "s1", "--", "true")
    assert wrong.code == 2
    assert "slice 1 does not exist: the pod is one slice, s0" in wrong.err


def test_a_run_on_workers_that_do_not_start_at_0_prints_their_output(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    """A subset is renumbered 0..N-1 for the run; the terminal's printer knew only the
    pod's ids (``-w 2,3``: an internal error, KeyError, at the first line)."""
    pod = make_pod(4)
    result = cli("run", "--pod", pod.name, "-w", "2,3", "--", "echo", "hi")
    assert result.code == 0, result.err
    assert sorted(result.out.splitlines()) == ["[w0] hi", "[w1] hi"]


def test_an_ssh_pod_of_two_slices_of_two_hosts(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_ssh_pod(4, slices=2)
    addresses = [w.internal_address for w in pod.workers]
    assert [w.slice for w in pod.workers] == [0, 0, 1, 1]
    result = cli("run", "--pod", pod.name, "--", PYTHON, "-c", SHOW_ENV, timeout=60)
    assert result.code == 0, result.err
    seen = envs(result)
    for worker, env in seen.items():
        assert env["TPUPOD_WORKER_ID"] == str(worker)
        assert env["MEGASCALE_SLICE_ID"] == env["TPUPOD_SLICE_ID"] == str(worker // 2)
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{addresses[0]}:8080"
        mine = addresses[2 * (worker // 2) : 2 * (worker // 2) + 2]
        assert env["TPU_WORKER_HOSTNAMES"] == ",".join(mine)
    assert sorted(seen) == [0, 1, 2, 3]


def test_logs_of_a_run_on_one_slice_says_how_it_numbered_its_workers(
    cli: Callable[..., CliResult],
) -> None:
    """From the slices trial: 'logs RUN -w 2' of a run on slice 1 said "see 'tpupod hosts'",
    whose list has a worker 2; the run numbered the pod's w2, w3 as its w0, w1."""
    up_slices(cli)
    ran = cli("run", "--pod", "ms", "-w", "s1", "--", "true")
    assert ran.code == 0, ran.err
    launch = re.search(r"launch (\S+):", ran.err)
    assert launch is not None, ran.err
    found = cli("logs", "--pod", "ms", launch[1], "-w", "2")
    assert found.code == 2, found.err
    assert f"error: run {launch[1]} has no worker 2" in found.err
    assert "hint: its workers are w0 to w1: the pod's w2, w3, numbered from 0" in found.err
