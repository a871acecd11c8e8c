"""`tpupod bench checkpoint` with Orbax's other generators: the ones that run on CPU hosts,
and the ones refused by name with the reason."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.conftest import CliResult
from tpupod.bench import orbax_harness
from tpupod.bench.config import load_config, parse_config
from tpupod.bench.results import Results
from tpupod.errors import BenchConfigError
from tpupod.pod.record import Pod

H = orbax_harness.HARNESS
# Orbax's format; every generator tpupod supports besides PyTreeCheckpointBenchmark, tiny.
EVERY = {
    "suite_name": "every generator",
    "num_repeats": 1,
    "mesh_config": {"mesh_axes": ["data", "model"], "ici_parallelism": {"data": 2, "model": 2}},
    "checkpoint_config": {
        "spec": {"array": {"dtype": "float32", "shape": [64, 32], "sharding": ["data", "model"]}}
    },
    "benchmarks": [
        {
            "generator": f"{H}.checkpoint_manager_benchmark.CheckpointManagerBenchmark",
            "options": {"train_steps": [2], "max_to_keep": [1]},
        },
        {"generator": "CheckpointManagerPerfBenchmark", "options": {"train_steps": 2}},
        {"generator": "DeleterBenchmark", "options": {"train_steps": 2}},
        {"generator": "ArrayHandlerBenchmark", "options": {"use_ocdbt": [True, False]}},
        {"generator": f"{H}.v1.benchmark.Benchmark", "options": {"async_enabled": True}},
        {
            "generator": "V1CheckpointerCancelBenchmark",
            "options": {"cancel_delay_secs": 0.0, "perform_cancellation": False},
        },
        {
            "generator": "CheckpointPolicyBenchmark",
            "options": {
                "num_checkpoints": 4,
                "checkpoint_policies_options": [
                    {
                        "preservation_policies": [{"policy_type": "LatestN", "n": 2}],
                        "save_decision_policies": [
                            {"policy_type": "FixedIntervalPolicy", "interval_steps": 1}
                        ],
                        "expected_preserve_checkpoints": [2, 3],
                    }
                ],
            },
        },
    ],
}


def configs() -> Path:
    spec = importlib.util.find_spec(H)
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "configs"


def run_suite(
    cli: Callable[..., CliResult], pod: Pod, config: Path, out: Path
) -> tuple[CliResult, Results]:
    args = ("bench", "checkpoint", "--pod", pod.name, "-c", str(config), "-o", str(out))
    run = cli(*args, timeout=110)  # eight generators on a loaded machine take more than 30 s
    assert run.code == 0, run.err
    (path,) = out.glob("*/*/results.json")
    return run, Results.model_validate_json(path.read_text())


@pytest.mark.timeout(180)
def test_every_supported_generator_runs_on_a_pod(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(workers=2, devices=2)
    config = tmp_path / "every.yaml"
    config.write_text(yaml.safe_dump(EVERY))
    run, results = run_suite(cli, pod, config, tmp_path / "out")

    ran = {c.label: c for c in results.combinations}
    assert all(c.status == "ok" for c in ran.values()), [(c.label, c.reason) for c in ran.values()]
    assert {c.generator for c in ran.values()} == set(orbax_harness.SUPPORTED) - {
        orbax_harness.PYTREE
    }
    for combo in ran.values():
        assert sorted(s.worker for s in combo.samples) == [0, 1]
        assert all(s.ops and not s.problems for s in combo.samples)  # Orbax's own checks passed
        assert all(s.seconds >= sum(s.ops.values()) * 0.99 for s in combo.samples)

    manager = ran["CheckpointManagerBenchmark"]
    for s in manager.samples:  # two saves of 64 x 32 floats, each waited for, one restore
        assert set(s.ops) >= {"save_0", "save_1", "restore_1", "correctness_check"}
        assert s.saves == 2 and s.restores == 1 and s.nbytes == 64 * 32 * 4
        assert s.save_total_s == pytest.approx(
            s.ops["save_0"] + s.ops["save_1"] + s.ops["wait_until_finished_0"]
            + s.ops["wait_until_finished_1"]
        )  # fmt: skip
    assert manager.repeats["op:save_#"].mean > 0 and manager.repeats["save_gbps"].mean > 0
    deleter = ran["DeleterBenchmark"]
    assert "op:delete_step_#_threads_#" in deleter.repeats and "restore_s" not in deleter.repeats
    assert all(s.restore_s is None for s in deleter.samples)
    handler = [c for c in ran.values() if c.generator.endswith("ArrayHandlerBenchmark")]
    assert [c.swept for c in handler] == [{"use_ocdbt": True}, {"use_ocdbt": False}]
    assert all("op:deserialize" in c.repeats and "restore_s" in c.repeats for c in handler)
    cancel = ran["V1CheckpointerCancelBenchmark"]
    assert "save_total_s" not in cancel.repeats and "op:async_save_dispatch" in cancel.repeats
    policy = ran["CheckpointPolicyBenchmark"]
    assert "op:saving step #" in policy.repeats
    # the table names the operations of a generator that neither saves nor restores the tree
    assert "V1CheckpointerCancelBenchmark" in run.out and "async_save_dispatch" in run.out
    pngs = {p.name for p in next((tmp_path / "out").glob("*/*/")).glob("*.png")}
    assert {"DeleterBenchmark.png", "V1CheckpointerCancelBenchmark.png"} <= pngs


@pytest.mark.timeout(120)
def test_orbax_own_checkpoint_manager_config_runs_unchanged(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(workers=2, devices=2)  # both its meshes have 4 devices
    config = configs() / "checkpoint_manager_benchmark.yaml"
    _, results = run_suite(cli, pod, config, tmp_path / "out")
    assert [(c.mesh, c.status.value) for c in results.combinations] == [(0, "ok"), (1, "ok")]
    for combo in results.combinations:
        assert sorted(s.worker for s in combo.samples) == [0, 1]
        assert all(s.nbytes == 1024 * 2048 * 4 and not s.problems for s in combo.samples)


SHIPPED = {
    "checkpoint_manager_benchmark.yaml": ["CheckpointManagerBenchmark"] * 2,
    "array_handler_benchmark.yaml": ["ArrayHandlerBenchmark"] * 40,
    "v1_checkpointer_cancel_benchmark.yaml": ["V1CheckpointerCancelBenchmark"] * 4,
    "checkpoint_policy_benchmark.yaml": ["CheckpointPolicyBenchmark"] * 6,
    "deleter_benchmark.yaml": ["DeleterBenchmark"] * 5,
}


@pytest.mark.parametrize("name", SHIPPED)
def test_orbax_own_configs_parse_unchanged(name: str) -> None:
    config = load_config(configs() / name)
    assert [c.label.split(" ")[0] for c in config.combinations] == SHIPPED[name]


REFUSED = [
    ("single_replica_benchmark.yaml", "needs several TPU slices"),
    ("emergency_checkpoint_manager_benchmark.yaml", "needs several TPU slices"),
    ("p2p_checkpoint_manager_benchmark.yaml", "needs several TPU slices"),
    ("multislice_broadcast_benchmark.yaml", "needs several TPU slices"),
    ("multihost_dispatchers_benchmark.yaml", "needs a Pathways"),
    ("v0_checkpointer_cancel_benchmark.yaml", "asserts that its cancel lands"),
]


@pytest.mark.parametrize(("name", "why"), REFUSED)
def test_orbax_generators_tpupod_cannot_run_are_refused_with_why(name: str, why: str) -> None:
    with pytest.raises(BenchConfigError) as caught:
        load_config(configs() / name)
    assert "benchmarks[0].generator:" in caught.value.message and why in caught.value.message


def test_a_refused_generator_by_its_short_name() -> None:
    config = json.loads(json.dumps(EVERY))
    config["benchmarks"] = [{"generator": "PyTorchCheckpointBenchmark"}]
    with pytest.raises(BenchConfigError, match=r"torch\.distributed checkpoints, not JAX"):
        parse_config(config)


def test_the_tensorboard_stand_in_answers_probes_as_a_module_does() -> None:
    """With torch installed, Orbax's harness imports torch.distributed, and torch's import
    probes modules for dunder names: an ImportError there left torch half imported and
    'tpupod bench checkpoint' failed with an internal error."""
    from tpupod.bench.orbax_harness import _Unavailable

    stand_in = _Unavailable("clu.metric_writers")
    assert getattr(stand_in, "__file__", None) is None
    assert not hasattr(stand_in, "__path__")
    with pytest.raises(ImportError, match="TensorBoard output needs clu"):
        stand_in.create_default_writer  # noqa: B018
