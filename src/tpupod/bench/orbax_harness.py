"""The one module that touches Orbax's benchmark harness (``orbax.checkpoint._src.testing``).

The orbax-checkpoint wheel ships the harness its authors run: options
dataclasses, generators whose ``test_fn`` saves and restores a pytree and
measures it, the mesh and pytree builders of its YAML format, and its metrics.
It lives under a private path, so every name of it is spelled here and only
here: when Orbax moves it, this module breaks and nothing else does. Tested
with orbax-checkpoint 0.12.8 (pinned in the ``bench`` extra).

Two adjustments, both made here:

- ``core/metrics_manager.py`` imports ``clu.metric_writers`` (and through it
  TensorFlow) for TensorBoard output, which tpupod does not use. When that
  import fails, a stand-in module whose every attribute raises takes its place,
  so the generators import without TensorFlow and a use of it would say why.
- A generator's ``test_fn`` deletes what it restored; tpupod keeps that tree so
  the worker can check it against what was saved (values and sharding).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import re
import sys
import types
import typing
from importlib.metadata import version
from typing import Any

from tpupod.extras import require

HARNESS = "orbax.checkpoint._src.testing.benchmarks"
PYTREE = f"{HARNESS}.pytree_checkpoint_benchmark.PyTreeCheckpointBenchmark"


@dataclasses.dataclass(frozen=True)
class Ops:
    """Which of a generator's timed operations (Orbax's names, as regexes) are its saves,
    the waits that complete them, and its restores: tpupod's save/restore times and GB/s."""

    save: str = ""
    wait: str = ""
    restore: str = ""


# Generators that run on CPU hosts without Pathways or TPU slices, and what their ops mean.
GENERATORS = {
    PYTREE: Ops("save", "wait_until_finished", "restore"),
    f"{HARNESS}.checkpoint_manager_benchmark.CheckpointManagerBenchmark": Ops(
        r"save_\d+", r"wait_until_finished_\d+", r"restore_\d+"
    ),
    # each save_<step> there waits for its save to finish
    f"{HARNESS}.checkpoint_manager_perf_benchmark.CheckpointManagerPerfBenchmark": Ops(
        r"save_\d+", "", "restore"
    ),
    f"{HARNESS}.deleter_benchmark.DeleterBenchmark": Ops(
        r"save_\d+", r"wait_until_finished_\d+", ""
    ),
    f"{HARNESS}.array_handler_benchmark.ArrayHandlerBenchmark": Ops(
        "serialize", "merge_ocdbt", "deserialize"
    ),
    f"{HARNESS}.v1.benchmark.Benchmark": Ops("save", "", "load"),  # save waits for the result
    f"{HARNESS}.v1_checkpointer_cancel_benchmark.V1CheckpointerCancelBenchmark": Ops(),
    f"{HARNESS}.checkpoint_policy_benchmark.CheckpointPolicyBenchmark": Ops(),
}
_SLICES = "needs several TPU slices (devices with a slice_index) and replica broadcasts"
# Generators the wheel ships that tpupod refuses, and why (checked on CPU hosts, 0.12.8).
REFUSED = {
    "v0_checkpointer_cancel_benchmark.V0CheckpointerCancelBenchmark": "asserts that its cancel "
    "lands before the save ends, which a save to a local disk wins: it fails there",
    "single_replica_benchmark.SingleReplicaBenchmark": _SLICES,
    "emergency_checkpoint_manager_benchmark.EmergencyCheckpointManagerBenchmark": _SLICES,
    "p2p_checkpoint_manager_benchmark.P2pCheckpointManagerBenchmark": _SLICES,
    "multislice_broadcast_benchmark.MultisliceBroadcastBenchmark": _SLICES,
    "v1.replica_parallel_multislice_benchmark.ReplicaParallelMultislice": _SLICES,
    "v1.restore_and_broadcast_benchmark.RestoreAndBroadcastBenchmark": _SLICES,
    "multihost_dispatchers_benchmark.MultihostDispatchersBenchmark": "needs a Pathways "
    "(colocated Python) dispatcher, which plain JAX processes do not have",
    "v1.snapshotter_benchmark.SnapshotterBenchmark": "needs pathwaysutils (Pathways)",
    "v1.resharding_benchmark.ReshardingBenchmark": "restores a reference checkpoint named in "
    "its options instead of a generated or loaded pytree",
    "pytorch_checkpoint_benchmark.PyTorchCheckpointBenchmark": "measures torch.distributed "
    "checkpoints, not JAX ones; tpupod installs no torch",
}
# Short names besides the class paths Orbax's own configs use: the class name, and "pytree".
ALIASES = {"pytree": PYTREE} | {p.rpartition(".")[2]: p for p in GENERATORS}
SUPPORTED = tuple(GENERATORS)
TESTED_ORBAX = "0.12.8"

# Orbax's metric keys ("operation::tag") for what tpupod reports.
TIME = "0_basics/time_s"
RSS = "0_basics/host_rss_diff_mb"


class _Unavailable(types.ModuleType):
    """Stands in for ``clu.metric_writers`` (TensorBoard output, which needs TensorFlow)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # what tools probe every module for (torch's import does)
            raise AttributeError(name)
        raise ImportError(
            f"clu.metric_writers.{name}: Orbax's TensorBoard output needs clu and TensorFlow, "
            "which tpupod does not install"
        )


def _module(name: str) -> Any:
    try:
        importlib.import_module("clu.metric_writers")
    except ImportError:
        sys.modules.setdefault("clu", types.ModuleType("clu"))
        sys.modules["clu.metric_writers"] = _Unavailable("clu.metric_writers")
    require("'tpupod bench checkpoint'", "checkpoint-bench")
    return importlib.import_module(name)


def resolve(generator: str) -> str | None:
    """The class path of a supported generator (a class path or an alias), else None."""
    path = ALIASES.get(generator, generator)
    return path if path in SUPPORTED else None


def refused(generator: str) -> str | None:
    """Why tpupod does not run this generator of Orbax's (its class path or name), else None."""
    for name, why in REFUSED.items():
        if generator in (name, name.rpartition(".")[2], f"{HARNESS}.{name}"):
            return why
    return None


def generator_names() -> list[str]:
    """What a config may name as a generator."""
    return [*ALIASES, *SUPPORTED]


def _generator_class(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(_module(module), name)


def option_defaults(path: str) -> dict[str, Any]:
    """The generator's options dataclass fields and their defaults."""
    fields = dataclasses.fields(_generator_class(path).options_class)
    return {f.name: f.default for f in fields}


def option_types(path: str) -> dict[str, set[type]]:
    """Each option's value types, as its dataclass field declares them (``bool |
    Sequence[bool]`` -> {bool}: a value or a list of values to sweep)."""
    cls = _generator_class(path).options_class
    return {name: _scalars(hint) for name, hint in typing.get_type_hints(cls).items()}


def _scalars(hint: Any) -> set[type]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_scalars(a) for a in args))
    if origin in (collections.abc.Sequence, list):
        return _scalars(args[0]) if args else {object}
    return {hint} if isinstance(hint, type) else {object}


def sweep(path: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Orbax's own cartesian product of list-valued options, invalid combinations left out."""
    cls = _generator_class(path)
    configs = _module(f"{HARNESS}.core.configs")
    generator = cls(
        checkpoint_configs=[configs.CheckpointConfig()],
        options=cls.options_class.from_dict(options),
    )
    return [dataclasses.asdict(o) for o in generator._get_options_product()]


def make_mesh(mesh: dict[str, Any]) -> Any:
    """A ``jax.sharding.Mesh`` from a ``mesh_config`` mapping, built as Orbax builds it."""
    configs = _module(f"{HARNESS}.core.configs")
    return _module(f"{HARNESS}.core.device_mesh").create_mesh(configs.MeshConfig(**mesh))


def make_pytree(checkpoint: dict[str, Any], mesh: Any) -> Any:
    """A ``checkpoint_config``'s pytree, as Orbax's harness makes it: generated from its
    ``spec`` (seeded: the same on every host) on the mesh, or loaded from its ``path``
    (sharded as its ``sharding_config_path`` says, else over every device)."""
    configs = _module(f"{HARNESS}.core.configs")
    generation = _module(f"{HARNESS}.core.checkpoint_generation")
    config = configs.CheckpointConfig(**checkpoint)
    if config.path is not None:
        return generation.load_checkpoint(config)
    return generation.generate_checkpoint(config, mesh=mesh)


@dataclasses.dataclass
class Measured:
    """One run of a generator's own ``test_fn``."""

    metrics: dict[str, float]  # "save::0_basics/time_s" -> value, as Orbax names them
    restored: Any  # the restored tree (PyTreeCheckpointBenchmark only; Orbax checks the others)
    failed: str = ""  # the assertion of Orbax's own correctness check that failed

    @property
    def ops(self) -> dict[str, float]:
        """Every timed operation, in seconds: {"save": 0.1, "restore": 0.2, ...}."""
        tail = f"::{TIME}"
        return {k[: -len(tail)]: v for k, v in self.metrics.items() if k.endswith(tail)}

    def rss_mb(self, pattern: str) -> float:
        """Host RSS growth over the operations matching ``pattern``."""
        tail = f"::{RSS}"
        return sum(
            v
            for k, v in self.metrics.items()
            if k.endswith(tail) and re.fullmatch(pattern, k[: -len(tail)])
        )


def measure(
    path: str, options: dict[str, Any], pytree: Any, directory: Any, *, mesh: Any, repeat: int
) -> Measured:
    """The generator's ``test_fn`` once on ``pytree`` (which it may delete), checkpointing
    into ``directory`` (a local folder or a ``gs://`` URL, as a path or an ``epath.Path``).

    PyTreeCheckpointBenchmark's restored tree is kept for the caller to check.
    The other generators check what they restored themselves (Orbax's
    ``assert_pytree_equal``); a failed check comes back in ``failed``.
    """
    cls = _generator_class(path)
    core = _module(f"{HARNESS}.core.core")
    configs = _module(f"{HARNESS}.core.configs")
    epath = importlib.import_module("etils.epath")

    class Keeping(cls):  # type: ignore[misc, valid-type]
        """test_fn clears the saved tree before restoring, then the restored one: keep that."""

        restored: Any = None
        cleared = 0

        def _clear_pytree(self, tree: Any) -> Any:
            self.cleared += 1
            if self.cleared == 1:
                return super()._clear_pytree(tree)
            self.restored = tree
            return None

    opts = _point(cls, options)
    kind = Keeping if path == PYTREE else cls
    generator = kind(checkpoint_configs=[configs.CheckpointConfig()], options=opts)
    context = core.TestContext(
        pytree=pytree, path=epath.Path(directory), options=opts, mesh=mesh, repeat_index=repeat
    )
    try:
        result = generator.test_fn(context)
    except AssertionError as exc:
        why = str(exc).splitlines()[0] if str(exc) else "an assertion without a message"
        return Measured(metrics={}, restored=None, failed=f"Orbax's check failed: {why}")
    metrics = {k: float(v) for k, (v, _unit) in result.metrics.results.items() if _number(v)}
    restored = generator.restored if isinstance(generator, Keeping) else None
    return Measured(metrics=metrics, restored=restored)


def _point(cls: Any, point: dict[str, Any]) -> Any:
    """One point of a sweep (as ``sweep`` gave it) as the generator's options object, built
    as Orbax builds it: ``from_dict`` (nested options, such as policies, become objects), then
    its product, which a sweep of one value each makes one point."""
    configs = _module(f"{HARNESS}.core.configs")
    wrapped = cls.options_class.from_dict({k: [v] for k, v in point.items()})
    generator = cls(checkpoint_configs=[configs.CheckpointConfig()], options=wrapped)
    (opts,) = generator._get_options_product()
    return opts


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def versions() -> dict[str, str]:
    """The versions that decide what was measured."""
    return {name: version(name) for name in ("orbax-checkpoint", "jax", "jaxlib", "tensorstore")}
