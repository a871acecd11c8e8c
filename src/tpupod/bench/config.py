"""A benchmark config in Orbax's harness format -> a checked BenchConfig and its sweep.

The format is Orbax's (``configs/pytree_checkpoint_benchmark.yaml`` runs
unchanged): ``suite_name``, ``num_repeats``, ``checkpoint_config`` (a ``spec``
of named arrays with dtype, shape and sharding), ``mesh_config`` or
``mesh_configs`` (``mesh_axes``, ``ici_parallelism``, ``dcn_parallelism``),
and ``benchmarks``, each a ``generator`` (Orbax's class path, or ``pytree``)
with ``options`` whose list values are swept as a cartesian product. Every
problem is found before anything runs and named by its key, with what is
allowed; they are reported together, each at its line and column in the file
(``Marks``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tpupod.bench import orbax_harness
from tpupod.errors import BenchConfigError

TOP_KEYS = (
    "suite_name",
    "num_repeats",
    "checkpoint_config",
    "checkpoint_configs",
    "mesh_config",
    "mesh_configs",
    "benchmarks",
    "baseline_path",  # Orbax's own baseline keys: read, ignored (--baseline does this)
    "baseline_capture_path",
)
CHECKPOINT_KEYS = (
    "spec",
    "random_seed",
    "path",
    "sharding_config_path",
    "load_with_colocated_python",
)
MESH_KEYS = (
    "mesh_axes",
    "ici_parallelism",
    "dcn_parallelism",
    "allow_split_physical_axes",
    "process_is_granule",
)
ARRAY_KEYS = ("dtype", "shape", "sharding")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8")


# -- the file -----------------------------------------------------------------------------
# A config file's YAML, with the line and column of every key, so a problem names its place.
#
# Problems are named by key path (``benchmarks[0].options.use_zarr3``, as the checks
# below write them); ``Marks.place`` finds the line and column of that path, or of the
# nearest mapping or list above it (a missing key: the mapping it is missing from).
# PyYAML's nodes carry those marks; the document is composed, walked, then built
# from the same nodes. A key given twice, which PyYAML would settle silently by
# keeping the last, is a problem here (a merge key's ``<<: *defaults`` overridden
# is not).

MERGE = "tag:yaml.org,2002:merge"
# the last step of a key path: ".name" or "[index]"
LAST_STEP = re.compile(r"(?:\.[^.\[\]]+|\[\d+\])$")


@dataclass
class Marks:
    """Where each key path of a config is in its file (1-based line and column)."""

    places: dict[str, tuple[int, int]] = field(default_factory=dict)
    duplicates: list[str] = field(default_factory=list)  # problems: keys given twice

    def place(self, problem: str) -> str | None:
        """``LINE:COLUMN`` of the key a problem names (its text up to the first ': '), or of
        the nearest mapping or list above it; None where there is none (a top-level key)."""
        path = problem.split(": ", 1)[0]
        while path:
            if path in self.places:
                line, column = self.places[path]
                return f"{line}:{column}"
            shorter = LAST_STEP.sub("", path)
            if shorter == path:
                return None
            path = shorter
        return None


def _read(path: Path) -> tuple[object, Marks]:
    """The file's YAML and its marks; a file that cannot be read or parsed is one error."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BenchConfigError(f"{path}: {exc.strerror}", hint="check the path") from exc
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line, column = before.count(b"\n") + 1, exc.start - before.rfind(b"\n")
        raise BenchConfigError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{raw[exc.start]:02x})",
            hint="save the config as UTF-8",
        ) from exc
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        marks = Marks()
        if node is not None:
            _walk(loader, node, "", marks, ())
        data = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise BenchConfigError(
            f"{path}:{_yaml_problem(exc)}",
            hint="fix the YAML there; the format is Orbax's benchmark YAML, see "
            "'tpupod bench checkpoint --help'",
        ) from exc
    except yaml.YAMLError as exc:
        raise BenchConfigError(
            f"{path}: not valid YAML: {exc}",
            hint="the format is Orbax's benchmark YAML; see 'tpupod bench checkpoint --help'",
        ) from exc
    finally:
        loader.dispose()
    return data, marks


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """``LINE:COLUMN: not valid YAML: PROBLEM (CONTEXT at line L, column C)``."""
    mark = exc.problem_mark or exc.context_mark
    where = f"{mark.line + 1}:{mark.column + 1}: " if mark is not None else " "
    said = f"{where}not valid YAML: {exc.problem or exc.context}"
    at = exc.context_mark
    if exc.problem and exc.context and at is not None:  # where the construct began
        said += f" ({exc.context} at line {at.line + 1}, column {at.column + 1})"
    return said


def _walk(
    loader: yaml.SafeLoader,
    node: yaml.Node,
    where: str,
    marks: Marks,
    above: tuple[int, ...],
) -> None:
    """Record the marks of every key and list item under ``node`` (at key path ``where``)."""
    if id(node) in above:  # an alias of a node that holds it: YAML allows such cycles
        return
    above = (*above, id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[object, int] = {}
        for key_node, value in node.value:
            if key_node.tag == MERGE or not isinstance(key_node, yaml.ScalarNode):
                continue  # a merge (its keys are the anchor's), or a key no config has
            key = loader.construct_object(key_node)
            path = f"{where}.{key}" if where else str(key)
            line = key_node.start_mark.line + 1
            if key in first:
                marks.duplicates.append(f"{path}: given twice (first on line {first[key]})")
            first.setdefault(key, line)
            marks.places[path] = (line, key_node.start_mark.column + 1)
            _walk(loader, value, path, marks, above)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{where}[{i}]"
            marks.places[path] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _walk(loader, item, path, marks, above)


# -- the config ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Combination:
    """One benchmark to run: a generator's options (one point of the sweep) on one mesh."""

    index: int
    generator: str  # Orbax's class path
    options: dict[str, Any]  # every field of the options dataclass
    swept: dict[str, Any]  # the fields the config sweeps (lists of several), this point's values
    mesh: int | None  # index into BenchConfig.meshes
    checkpoint: int  # index into BenchConfig.checkpoints
    meshes: int = 1  # how many meshes the config has (the label names one only among several)
    checkpoints: int = 1
    # swept values that are mappings (Orbax's policy options) by their place in the list: #0
    shown: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        name = self.generator.rpartition(".")[2]
        parts = [f"{k}={self.shown.get(k, v)}" for k, v in self.swept.items()]
        if self.meshes > 1:
            parts.append(f"mesh={self.mesh}")
        if self.checkpoints > 1:
            parts.append(f"checkpoint={self.checkpoint}")
        return " ".join([name, *parts])


@dataclass(frozen=True)
class BenchConfig:
    suite_name: str
    num_repeats: int
    checkpoints: list[dict[str, Any]]
    meshes: list[dict[str, Any]]
    combinations: list[Combination]
    raw: dict[str, Any] = field(repr=False)
    marks: Marks = field(default_factory=Marks, repr=False)  # where its keys are in its file


def load_config(path: Path) -> BenchConfig:
    """Read and check a config file; every problem at once, each at its line and column,
    as a BenchConfigError."""
    data, marks = _read(path)
    return parse_config(data, str(path), marks)


def parse_config(raw: object, source: str = "config", marks: Marks | None = None) -> BenchConfig:
    """Check a config mapping (from YAML, or sent to a worker) and build its sweep; ``marks``:
    where its keys are in its file, for the errors."""
    marks = marks or Marks()
    if not isinstance(raw, dict):
        raise BenchConfigError.of(source, ["a mapping with suite_name and benchmarks, please"])
    problems = [*marks.duplicates, *_unknown(raw, TOP_KEYS, "")]
    meshes = _meshes(raw, problems)
    checkpoints = _checkpoints(raw, meshes, problems)
    benchmarks = _benchmarks(raw.get("benchmarks"), problems)
    suite = raw.get("suite_name")
    if not isinstance(suite, str) or not suite.strip():
        problems.append("suite_name: missing; a name for the suite, which baselines go by")
    repeats = raw.get("num_repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        problems.append(f"num_repeats: {repeats!r}; allowed: a whole number from 1")
    if problems:
        raise BenchConfigError.of(source, problems, [marks.place(p) for p in problems])
    assert isinstance(suite, str) and isinstance(repeats, int)
    return BenchConfig(
        suite_name=suite,
        num_repeats=repeats,
        checkpoints=checkpoints,
        meshes=meshes,
        combinations=_combinations(benchmarks, len(meshes), len(checkpoints)),
        raw=raw,
        marks=marks,
    )


def _unknown(mapping: dict[str, Any], allowed: tuple[str, ...], where: str) -> list[str]:
    return [
        f"{where}{key}: unknown key; allowed: {', '.join(allowed)}"
        for key in mapping
        if key not in allowed
    ]


def _listed(raw: dict[str, Any], one: str, many: str, problems: list[str]) -> list[tuple[str, Any]]:
    if many in raw:
        items = raw[many]
        if not isinstance(items, list) or not items:
            problems.append(f"{many}: a non-empty list, please")
            return []
        return [(f"{many}[{i}]", item) for i, item in enumerate(items)]
    return [(one, raw[one])] if one in raw else []


def _meshes(raw: dict[str, Any], problems: list[str]) -> list[dict[str, Any]]:
    meshes = []
    for where, mesh in _listed(raw, "mesh_config", "mesh_configs", problems):
        if not isinstance(mesh, dict):
            problems.append(f"{where}: a mapping with mesh_axes, please")
            continue
        problems += _unknown(mesh, MESH_KEYS, f"{where}.")
        axes = mesh.get("mesh_axes")
        if not isinstance(axes, list) or not axes or not all(isinstance(a, str) for a in axes):
            problems.append(f"{where}.mesh_axes: a list of axis names, please")
            continue
        for key in ("ici_parallelism", "dcn_parallelism"):
            sizes = mesh.get(key) or {}
            if not isinstance(sizes, dict):
                problems.append(f"{where}.{key}: a mapping of axis name to size, please")
                continue
            for axis, size in sizes.items():
                if axis not in axes:
                    problems.append(
                        f"{where}.{key}.{axis}: not a mesh axis; allowed: {', '.join(axes)}"
                    )
                elif not isinstance(size, int) or size < 1:
                    problems.append(
                        f"{where}.{key}.{axis}: {size!r}; allowed: a whole number from 1"
                    )
        meshes.append(mesh)
    return meshes


def as_written(raw: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """A config's meshes and checkpoints as written, unchecked (such as a results file's)."""
    unused: list[str] = []
    meshes = _listed(raw, "mesh_config", "mesh_configs", unused)
    checkpoints = _listed(raw, "checkpoint_config", "checkpoint_configs", unused)
    return [m for _, m in meshes], [c for _, c in checkpoints]


def axis_sizes(mesh: dict[str, Any]) -> dict[str, int]:
    """Each axis's size in the global mesh: its ICI times its DCN parallelism."""
    ici = mesh.get("ici_parallelism") or {}
    dcn = mesh.get("dcn_parallelism") or {}
    return {a: int(ici.get(a, 1)) * int(dcn.get(a, 1)) for a in mesh["mesh_axes"]}


def _checkpoints(
    raw: dict[str, Any], meshes: list[dict[str, Any]], problems: list[str]
) -> list[dict[str, Any]]:
    found = _listed(raw, "checkpoint_config", "checkpoint_configs", problems)
    if not found:
        problems.append("checkpoint_config: missing; a spec of named arrays to save and restore")
    checkpoints = []
    for where, checkpoint in found:
        if not isinstance(checkpoint, dict) or ("spec" in checkpoint) == ("path" in checkpoint):
            problems.append(f"{where}: a spec of arrays to generate, or the path of a checkpoint")
            continue
        problems += _unknown(checkpoint, CHECKPOINT_KEYS, f"{where}.")
        if "path" in checkpoint:  # Orbax loads it, sharded as sharding_config_path says
            if not isinstance(checkpoint["path"], str):
                problems.append(f"{where}.path: the checkpoint's folder (or gs:// URL)")
        elif not isinstance(checkpoint["spec"], dict):
            problems.append(f"{where}.spec: a mapping of names to arrays, please")
        else:
            for name, array in checkpoint["spec"].items():
                problems += _array_problems(f"{where}.spec.{name}", array, meshes)
        if "sharding_config_path" in checkpoint and "path" not in checkpoint:
            problems.append(f"{where}.sharding_config_path: only with a path")
        checkpoints.append(checkpoint)
    return checkpoints


def _array_problems(where: str, array: object, meshes: list[dict[str, Any]]) -> list[str]:
    if array in ("int", "str"):
        return []
    if not isinstance(array, dict):
        return [f"{where}: 'int', 'str' or a mapping with dtype, shape, sharding"]
    problems = _unknown(array, ARRAY_KEYS, f"{where}.")
    if array.get("dtype") not in DTYPES:
        problems.append(f"{where}.dtype: {array.get('dtype')!r}; allowed: {', '.join(DTYPES)}")
    shape = array.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
        return [*problems, f"{where}.shape: a list of positive whole numbers, please"]
    sharding = array.get("sharding")
    if sharding is None:
        return problems
    if not isinstance(sharding, list) or len(sharding) != len(shape):
        return [
            *problems,
            f"{where}.sharding: one entry (an axis, a list of axes or null) per dimension",
        ]
    if not meshes:
        return [*problems, f"{where}.sharding: needs a mesh_config to name its axes"]
    for i, mesh in enumerate(meshes):
        problems += _divides(
            where, shape, sharding, axis_sizes(mesh), i if len(meshes) > 1 else None
        )
    return problems


def _divides(
    where: str, shape: list[int], sharding: list[Any], sizes: dict[str, int], mesh: int | None
) -> list[str]:
    on = "" if mesh is None else f" (mesh_configs[{mesh}])"
    problems = []
    for dim, (length, entry) in enumerate(zip(shape, sharding, strict=True)):
        axes = [] if entry is None else entry if isinstance(entry, list) else [entry]
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            problems.append(
                f"{where}.sharding[{dim}]: {unknown[0]!r} is not a mesh axis{on}; "
                f"allowed: {', '.join(sizes)}"
            )
            continue
        parts = math.prod(sizes[a] for a in axes)
        if length % parts:
            problems.append(
                f"{where}.sharding[{dim}]: {'x'.join(axes)} splits dimension {dim} "
                f"({length}) into {parts} parts{on}, which does not divide it"
            )
    return problems


Sweep = tuple[str, dict[str, Any], list[dict[str, Any]]]  # generator, options, their points


def _benchmarks(items: object, problems: list[str]) -> list[Sweep]:
    if not isinstance(items, list) or not items:
        problems.append("benchmarks: missing or empty; a list of {generator, options}")
        return []
    found = []
    for i, item in enumerate(items):
        where = f"benchmarks[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: a mapping with generator and options, please")
            continue
        problems += _unknown(item, ("generator", "options"), f"{where}.")
        name = str(item.get("generator"))
        path = orbax_harness.resolve(name)
        why = orbax_harness.refused(name)
        if why is not None:
            problems.append(f"{where}.generator: {name!r} is not supported here: it {why}")
            continue
        if path is None:
            allowed = ", ".join(orbax_harness.generator_names())
            problems.append(f"{where}.generator: {name!r} is not supported; allowed: {allowed}")
            continue
        options = item.get("options") or {}
        if not isinstance(options, dict):
            problems.append(f"{where}.options: a mapping, please")
            continue
        fields = orbax_harness.option_defaults(path)
        bad = _unknown(options, tuple(fields), f"{where}.options.")
        problems += [p.replace("unknown key", "unknown option") for p in bad]
        # the known options' values too: one run names every bad key (an unknown one has
        # no declared type, so it is not said twice)
        wrong = _type_problems(f"{where}.options.", options, orbax_harness.option_types(path))
        problems += wrong
        if bad or wrong:
            continue
        try:
            points = orbax_harness.sweep(path, options)
        except (TypeError, ValueError, KeyError, AssertionError) as exc:
            problems.append(f"{where}.options: Orbax refuses them: {exc}")
            continue
        if not points:
            problems.append(
                f"{where}.options: Orbax's is_valid() rejects every combination here "
                "(use_colocated_python needs Pathways; a separate replica folder needs "
                "use_replica_parallel and use_ocdbt)"
            )
            continue
        found.append((path, options, points))
    return found


# An option's declared value types (its dataclass field's, a list of them sweeps) in words.
KINDS = (
    ({bool}, "true or false"),
    ({int}, "a whole number"),
    ({int, type(None)}, "a whole number or null"),
    ({float}, "a number"),
)


def _type_problems(
    where: str, options: dict[str, Any], declared: dict[str, set[type]]
) -> list[str]:
    """Values of another type than the option's: Orbax's dataclasses check none (a string
    such as ``use_zarr3: maybe`` would run, as a true value wherever Orbax tests it)."""
    problems = []
    for name, value in options.items():
        kinds = declared.get(name, {object})
        allowed = next((words for types, words in KINDS if types == kinds), None)
        bad = [v for v in (value if isinstance(value, list) else [value]) if not _is(v, kinds)]
        if allowed is not None and bad:
            problems.append(f"{where}{name}: {bad[0]!r}; allowed: {allowed}, or a list of them")
    return problems


def _is(value: object, kinds: set[type]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    if value is None:
        return type(None) in kinds
    if isinstance(value, int):
        return bool(kinds & {int, float})
    return isinstance(value, float) and float in kinds


def mesh_devices(mesh: dict[str, Any]) -> int:
    """How many devices a mesh spans: the product of its axes' ICI x DCN sizes."""
    return math.prod(axis_sizes(mesh).values())


def fit_problems(config: BenchConfig, devices: int) -> list[str]:
    """Why no mesh of the config fits a pod of ``devices`` devices (empty where one does).

    A mesh that does not fit is skipped, as Orbax's harness skips it, so a config written
    for several pod sizes (Orbax's own) runs on each; a config none of whose meshes fits
    would run nothing at all, so it is refused before anything starts.
    """
    if not config.meshes or any(mesh_devices(m) == devices for m in config.meshes):
        return []
    many = "mesh_configs" in config.raw
    return [
        f"{f'mesh_configs[{i}]' if many else 'mesh_config'}: needs {mesh_devices(mesh)} devices "
        f"({' x '.join(f'{a} {n}' for a, n in axis_sizes(mesh).items())}), the pod has {devices}"
        for i, mesh in enumerate(config.meshes)
    ]


def check_fits(config: BenchConfig, devices: int, source: str) -> None:
    """``fit_problems`` as one BenchConfigError."""
    problems = fit_problems(config, devices)
    if problems:
        error = BenchConfigError.of(source, problems, [config.marks.place(p) for p in problems])
        error.hint = (
            f"give a mesh whose ICI x DCN parallelism multiplies to the pod's {devices} devices "
            "(workers x devices per worker)"
        )
        raise error


def _combinations(benchmarks: list[Sweep], meshes: int, checkpoints: int) -> list[Combination]:
    combos: list[Combination] = []
    for path, options, points in benchmarks:
        swept = [k for k, v in options.items() if isinstance(v, list) and len(v) > 1]
        places: dict[str, list[Any]] = {k: [] for k in swept}
        for point in points:
            for k in swept:
                if point[k] not in places[k]:
                    places[k].append(point[k])
            shown = {
                k: f"#{places[k].index(point[k])}"
                for k in swept
                if isinstance(point[k], dict | list)
            }
            for mesh in range(meshes) if meshes else [None]:
                for checkpoint in range(checkpoints):
                    combos.append(
                        Combination(
                            index=len(combos),
                            generator=path,
                            options=point,
                            swept={k: point[k] for k in swept},
                            mesh=mesh,
                            checkpoint=checkpoint,
                            meshes=meshes,
                            checkpoints=checkpoints,
                            shown=shown,
                        )
                    )
    return combos
