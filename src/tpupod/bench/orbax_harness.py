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

import dataclasses
import importlib
import sys
import types
from pathlib import Path
from typing import Any

from tpupod.errors import UsageError

HARNESS = "orbax.checkpoint._src.testing.benchmarks"
PYTREE = f"{HARNESS}.pytree_checkpoint_benchmark.PyTreeCheckpointBenchmark"
# Short names besides the class paths Orbax's own configs use.
ALIASES = {"pytree": PYTREE, "PyTreeCheckpointBenchmark": PYTREE}
# Generators whose test_fn saves then restores one pytree (what tpupod measures and checks).
SUPPORTED = (PYTREE,)
TESTED_ORBAX = "0.12.8"

# Orbax's metric keys ("operation::tag") for what tpupod reports.
TIME = "0_basics/time_s"
RSS = "0_basics/host_rss_diff_mb"


class _Unavailable(types.ModuleType):
    """Stands in for ``clu.metric_writers`` (TensorBoard output, which needs TensorFlow)."""

    def __getattr__(self, name: str) -> Any:
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
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"Orbax's benchmark harness cannot be imported: {exc}",
            hint=f"pip install 'tpupod[checkpoint-bench]' (orbax-checkpoint=={TESTED_ORBAX})",
        ) from exc


def resolve(generator: str) -> str | None:
    """The class path of a supported generator (a class path or an alias), else None."""
    path = ALIASES.get(generator, generator)
    return path if path in SUPPORTED else None


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


def sweep(path: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Orbax's own cartesian product of list-valued options, invalid combinations left out."""
    cls = _generator_class(path)
    configs = _module(f"{HARNESS}.core.configs")
    generator = cls(
        checkpoint_configs=[configs.CheckpointConfig()], options=cls.options_class(**options)
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
    """One save and restore by the generator's own ``test_fn``."""

    metrics: dict[str, float]  # "save::0_basics/time_s" -> value, as Orbax names them
    restored: Any


def save_and_restore(path: str, options: dict[str, Any], pytree: Any, directory: Path) -> Measured:
    """The generator's ``test_fn`` once on ``pytree`` (which it deletes); the restored tree kept."""
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

    opts = cls.options_class(**options)
    generator = Keeping(checkpoint_configs=[configs.CheckpointConfig()], options=opts)
    context = core.TestContext(pytree=pytree, path=epath.Path(directory), options=opts)
    result = generator.test_fn(context)
    metrics = {k: float(v) for k, (v, _unit) in result.metrics.results.items() if _number(v)}
    return Measured(metrics=metrics, restored=generator.restored)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def versions() -> dict[str, str]:
    """The versions that decide what was measured."""
    from importlib.metadata import version

    return {name: version(name) for name in ("orbax-checkpoint", "jax", "jaxlib", "tensorstore")}
