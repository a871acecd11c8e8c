"""`tpupod bench checkpoint` never passes silently (issue 21, section 4): a config that
cannot run is refused before anything starts, nothing measured is never a result, a
baseline is compared only like with like, and a comparison of nothing fails."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult, tpupod_argv, wait_until_gone
from tests.test_bench_checkpoint import SMALL, results_of, write_config
from tpupod.bench import baseline
from tpupod.bench.config import parse_config
from tpupod.bench.results import CombinationResult, RepeatStats, Results, Status
from tpupod.errors import BenchConfigError
from tpupod.pod.record import Pod


def small(**changes: Any) -> dict[str, Any]:
    """SMALL (2 workers x 2 devices, use_zarr3 swept), one repeat, with changes by key path."""
    config: dict[str, Any] = json.loads(json.dumps(SMALL))
    config["num_repeats"] = 1
    for path, value in changes.items():
        *parents, last = path.split("__")
        place = config
        for key in parents:
            place = place[int(key)] if isinstance(place, list) else place[key]
        place[last] = value
    return config


def bench(
    cli: Callable[..., CliResult], pod: Pod, config: Path, out: Path, *more: str
) -> CliResult:
    return cli(
        "bench", "checkpoint", "--pod", pod.name, "-c", str(config), "-o", str(out), *more,
        timeout=120,
    )  # fmt: skip


def test_a_mesh_larger_than_the_pod_is_refused_before_anything_starts(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path, state_home: Path
) -> None:
    # The config: DCN data 4 x ICI model 2 = 8 devices, on 2 workers x 2 devices.
    pod = make_pod(workers=2, devices=2)
    config = write_config(tmp_path, small(mesh_config__dcn_parallelism={"data": 4}))
    out = tmp_path / "out"

    run = bench(cli, pod, config, out)

    assert run.code == 2, run.out + run.err
    lines = run.err.strip().splitlines()
    line = config.read_text().splitlines().index("mesh_config:") + 1  # issue 36: its place
    assert lines == [
        f"error: {config}:{line}:1: mesh_config: needs 8 devices (data 4 x model 2), the pod has 4",
        "hint: give a mesh whose ICI x DCN parallelism multiplies to the pod's 4 devices "
        "(workers x devices per worker)",
    ]
    assert run.out == "" and "runs/s" not in run.err  # no progress: nothing started
    assert not out.exists()  # no results.json for a later --baseline latest to compare with
    assert not (state_home / "pods" / pod.name / "runs").exists()  # no launch


@pytest.mark.timeout(180)  # an SSH pod
def test_workers_refuse_a_mesh_their_pod_cannot_hold(
    make_ssh_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    # An SSH pod's device count is known only on its hosts (one CPU device each here): the
    # workers check the config before the first combination, and nothing is written.
    pod = make_ssh_pod(workers=2)  # SMALL's mesh needs 2 x 2 devices
    shared = tempfile.mkdtemp(prefix="tpupod-bench-", dir="/var/tmp")
    out = tmp_path / "out"
    run = bench(
        cli, pod, write_config(tmp_path, small()), out,
        "--checkpoint-dir", shared, "--worker-python", sys.executable,
    )  # fmt: skip
    assert run.code == 2, run.out + run.err  # the workers' exit: a config error
    said = run.out + run.err
    assert "mesh_config: needs 4 devices (data 2 x model 2), the pod has 2" in said
    assert "bench 1/2" not in said and "Traceback" not in said  # no combination ran
    assert not list(out.glob("*/*/results.json"))


@pytest.mark.timeout(240)  # two or three runs on a pod, on a busy machine
def test_a_baseline_where_nothing_was_measured_fails(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(workers=2, devices=2)
    config = write_config(tmp_path, small())
    out = tmp_path / "out"
    first = bench(cli, pod, config, out)
    assert first.code == 0, first.err
    # What the run that skipped every combination wrote before: the same config, no metric.
    path, _ = results_of(out)
    empty = json.loads(path.read_text())
    for combo in empty["combinations"]:
        combo.update(status="skipped", reason="the mesh has 8 devices, the pod 4")
        combo.update(samples=[], hosts={}, repeats={})
    path.write_text(json.dumps(empty))

    again = bench(cli, pod, config, out, "--baseline", "latest")

    assert again.code == 1, again.out + again.err
    assert (
        "  not compared: PyTreeCheckpointBenchmark use_zarr3=True\n    skipped in the baseline\n"
    ) in again.out
    assert again.err.strip().splitlines()[-2:] == [
        "error: nothing compared with the baseline: "
        "PyTreeCheckpointBenchmark use_zarr3=True: skipped in the baseline",
        "hint: compare with a run of the same config on as many workers",
    ]
    assert len(list(out.glob("*/*/results.json"))) == 2  # this run's results are kept


@pytest.mark.timeout(300)  # two or three runs on a pod, on a busy machine
def test_a_baseline_of_another_config_is_compared_like_with_like(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(workers=2, devices=2)
    out = tmp_path / "out"
    first = bench(cli, pod, write_config(tmp_path, small()), out)
    assert first.code == 0, first.err

    # The same suite name and labels, arrays twice as large: no combination is like any.
    larger = small(checkpoint_config__spec__w__shape=[128, 32])
    refused = bench(
        cli, pod, write_config(tmp_path, larger, "larger.yaml"), out, "--baseline", "latest"
    )
    assert refused.code == 2, refused.out + refused.err
    assert refused.err.startswith("error: --baseline ") and "Traceback" not in refused.err
    assert (
        ": no combination of this config ran there (PyTreeCheckpointBenchmark use_zarr3=True: "
        "the baseline's differs: checkpoint.spec.w.shape [64, 32] -> [128, 32])"
    ) in refused.err
    assert refused.out == "" and len(list(out.glob("*/*/results.json"))) == 1  # nothing ran

    # Another sweep: the combinations that are the same are compared, the rest named.
    swept = small(benchmarks__0__options={"use_zarr3": [True, False], "use_ocdbt": [True, False]})
    config = write_config(tmp_path, swept, "swept.yaml")
    run = bench(cli, pod, config, out, "--baseline", "latest", "--threshold", "100")
    assert run.code == 0, run.out + run.err
    for zarr3 in ("True", "False"):
        # (labels name swept options in the config's order, which safe_dump sorts)
        compared = f"  PyTreeCheckpointBenchmark use_ocdbt=True use_zarr3={zarr3}\n"
        assert f"{compared}    save_blocking_s: " in run.out and "    save_total_s: " in run.out
        assert (
            f"  not compared: PyTreeCheckpointBenchmark use_ocdbt=False use_zarr3={zarr3}\n"
            "    the baseline's differs: options.use_ocdbt true -> false\n"
        ) in run.out
    assert "REGRESSION" not in run.out
    ours = [line for line in run.out.splitlines() if str(out) not in line]  # not the paths
    assert max(len(line.rstrip()) for line in ours) <= 100, run.out


# -- in process -----------------------------------------------------------------------


def measured(config: dict[str, Any], workers: int = 2, seconds: float = 1.0) -> Results:
    """Results of a config as a run writes them, every combination's save taking ``seconds``
    in each of 5 repeats (enough to tell a change from noise)."""
    plan = parse_config(config)
    combos = [
        CombinationResult(
            index=c.index,
            label=c.label,
            generator=c.generator,
            options=c.options,
            swept=c.swept,
            mesh=c.mesh,
            checkpoint=c.checkpoint,
            status=Status.OK,
            repeats={"save_total_s": RepeatStats.of([seconds] * 5)},
        )
        for c in plan.combinations
    ]
    return Results(
        suite_name=plan.suite_name, launch_id="x", started="", seconds=1.0, commit="c",
        pod="p", workers=workers, machine={}, versions={}, config=config, combinations=combos,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("changed", "workers", "differs"),
    [
        (small(mesh_config__dcn_parallelism={"data": 1}), 2, "mesh.dcn_parallelism.data 2 -> 1"),
        (
            small(mesh_config__ici_parallelism={"model": 2, "data": 2}),
            2,
            "mesh.ici_parallelism.data 1 -> 2",
        ),
        (small(), 4, "workers 2 -> 4"),
        (small(checkpoint_config__spec__step="str"), 2, 'checkpoint.spec.step "int" -> "str"'),
    ],
    ids=["dcn", "ici", "workers", "spec"],
)
def test_unlike_combinations_are_not_compared(
    changed: dict[str, Any], workers: int, differs: str
) -> None:
    before = measured(small(), seconds=1.0)
    now = measured(changed, workers=workers, seconds=10.0)  # would be a regression if compared
    comparison = baseline.compare(now, before, "b.json")
    assert comparison.changes == [] and comparison.regressions == []
    assert comparison.skipped == [
        (f"PyTreeCheckpointBenchmark use_zarr3={z}", f"the baseline's differs: {differs}")
        for z in ("True", "False")
    ]


def test_like_combinations_are_compared_by_what_they_are_not_their_place() -> None:
    # The same two combinations, swept in the other order: each is compared with its like.
    before = measured(small(), seconds=1.0)
    now = measured(small(benchmarks__0__options={"use_zarr3": [False, True]}), seconds=1.0)
    now.combinations[1].repeats["save_total_s"] = RepeatStats.of([5.0] * 5)  # use_zarr3=True
    comparison = baseline.compare(now, before, "b.json")
    assert [(c.label, c.regressed) for c in comparison.changes] == [
        ("PyTreeCheckpointBenchmark use_zarr3=False", False),
        ("PyTreeCheckpointBenchmark use_zarr3=True", True),
    ]


@pytest.mark.parametrize(
    ("generator", "options", "problem"),
    [
        ("pytree", {"use_zarr3": "maybe"}, "use_zarr3: 'maybe'; allowed: true or false"),
        ("pytree", {"use_ocdbt": [True, 1]}, "use_ocdbt: 1; allowed: true or false"),
        (
            "pytree",
            {"save_concurrent_gb": "lots"},
            "save_concurrent_gb: 'lots'; allowed: a whole number or null",
        ),
        ("CheckpointManagerBenchmark", {"train_steps": 2.5}, "train_steps: 2.5; allowed: a whole"),
        (
            "V1CheckpointerCancelBenchmark",
            {"cancel_delay_secs": "soon"},
            "cancel_delay_secs: 'soon'; allowed: a number",
        ),
    ],
    ids=["bool", "bool-in-sweep", "int-or-null", "int", "float"],
)
def test_options_take_only_values_of_their_type(
    generator: str, options: dict[str, Any], problem: str
) -> None:
    config = small(benchmarks=[{"generator": generator, "options": options}])
    with pytest.raises(BenchConfigError) as caught:
        parse_config(config, "bench.yaml")
    assert caught.value.message.startswith(f"bench.yaml: benchmarks[0].options.{problem}")


def test_options_of_their_type_are_taken() -> None:
    options = {"use_zarr3": [True, False], "save_concurrent_gb": [None, 1], "use_ocdbt": True}
    assert len(parse_config(small(benchmarks__0__options=options)).combinations) == 4
    cancel = {"generator": "V1CheckpointerCancelBenchmark", "options": {"cancel_delay_secs": 1}}
    assert parse_config(small(benchmarks=[cancel])).combinations  # a whole number is a number


def test_a_hand_edited_baseline_matches_nothing_rather_than_crashing() -> None:
    before = measured(small())
    before.config = {k: v for k, v in before.config.items() if k != "mesh_config"}
    comparison = baseline.compare(measured(small()), before, "b.json")
    assert comparison.changes == []
    assert comparison.skipped[0][1].startswith("the baseline's differs: mesh.mesh_axes null -> [")


def test_a_negative_threshold_is_refused_before_anything_runs(
    cli_in_process: Callable[..., CliResult], tmp_path: Path
) -> None:
    # -1 made 1 / (1 + threshold) divide by zero once a whole run had compared its metrics
    config = write_config(tmp_path, small())
    args = ("bench", "checkpoint", "-c", str(config), "-o", str(tmp_path / "out"))
    run = cli_in_process(*args, "--baseline", "latest", "--threshold", "-1")
    assert run.code == 2, run.out + run.err
    assert (
        run.err.startswith("error: --threshold -1: must be at least 0")
        and "Traceback" not in run.err
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(300)  # two runs on a pod, on a busy machine
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_or_killed_benchmark_leaves_no_checkpoints_behind(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path, how: int
) -> None:
    """A stopped (TERM) or killed (-9) benchmark left its scratch checkpoints in
    OUTPUT/checkpoints/LAUNCH for good, and later runs did not clear them: with real
    checkpoints, gigabytes per interrupted run. A stopped run removes its own; the next
    run removes what a killed one left."""
    pod = make_pod(workers=2, devices=2)
    config = write_config(tmp_path, small(num_repeats=60))
    out = tmp_path / "out"
    scratch = out / "checkpoints"
    argv = ["bench", "checkpoint", "--pod", pod.name, "-c", str(config), "-o", str(out)]
    proc = subprocess.Popen(tpupod_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not any(scratch.glob("*/*")):  # a launch's checkpoints are being written
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(how)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    if how == signal.SIGTERM:
        assert list(scratch.iterdir()) == []
        return
    wait_until_gone(pod.name, timeout=15)
    assert list(scratch.iterdir()) != []  # kill -9: nothing ran after
    again = bench(cli, pod, write_config(tmp_path, small()), out)
    assert again.code == 0, again.err
    assert list(scratch.iterdir()) == []
