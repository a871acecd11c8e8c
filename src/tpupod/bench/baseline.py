"""Compare a run with an earlier one (a results file, or the latest of the same suite).

Only like is compared with like: combinations match by generator, every option,
the mesh (axes, ICI and DCN parallelism), the checkpoint (its spec or path) and
the pod's worker count, so a run of another config under the same suite name
is compared only where a combination is truly the same, and the rest is named
with what differs. A comparison that compares nothing fails. The metrics
compared are save and restore times and GB/s, or, for a generator that does not
save and restore the tree, the seconds of every operation Orbax timed. A metric
regresses when the pod's mean over repeats is worse than the baseline's by
more than the threshold (slower for times, fewer GB/s for throughput). Memory
growth is reported but never flagged: RSS deltas of a few MB are noise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError
from pydantic_core import to_jsonable_python

from tpupod import storage
from tpupod.bench.config import BenchConfig, as_written
from tpupod.bench.results import OP, Results, Status, larger_is_better
from tpupod.errors import UsageError

RESULTS_FILE = "results.json"
COMPARED = ("save_blocking_s", "save_total_s", "restore_s", "save_gbps", "restore_gbps")
DEFAULT_THRESHOLD = 0.10


@dataclass(frozen=True)
class Change:
    label: str
    metric: str
    baseline: float
    current: float
    regressed: bool

    @property
    def ratio(self) -> float:
        return self.current / self.baseline if self.baseline else float("inf")


@dataclass(frozen=True)
class Comparison:
    baseline_commit: str
    current_commit: str
    baseline_path: str
    changes: list[Change]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (label, why not compared)

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.regressed]


def suite_dir(output: str, suite_name: str) -> str:
    """Where a suite's runs are kept: OUTPUT/<suite name as a file name>/<launch id>/."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", suite_name).strip("-").lower() or "suite"
    return storage.join(output, slug)


def latest(output: str, suite_name: str) -> str:
    """The newest results file of the suite in ``output`` (launch ids sort by time)."""
    runs = sorted(storage.glob(suite_dir(output, suite_name), f"*/{RESULTS_FILE}"))
    if not runs:
        raise UsageError(
            f"--baseline latest: no earlier results of suite {suite_name!r} in {output}",
            hint="run the suite once without --baseline, or name a results file",
        )
    return runs[-1]


def load(path: str) -> Results:
    try:
        return Results.model_validate_json(storage.read_text(path))
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise UsageError(f"--baseline {path}: {why}", hint="name a results.json") from exc
    except ValidationError as exc:
        raise UsageError(
            f"--baseline {path}: not a tpupod bench results file "
            f"({exc.error_count()} problems, first at {exc.errors()[0]['loc']})",
            hint="name a results.json that 'tpupod bench checkpoint' wrote",
        ) from exc


class _Combo(Protocol):
    """A combination, planned (``config.Combination``) or run (``results.CombinationResult``)."""

    @property
    def label(self) -> str: ...
    @property
    def generator(self) -> str: ...
    @property
    def options(self) -> dict[str, Any]: ...
    @property
    def mesh(self) -> int | None: ...
    @property
    def checkpoint(self) -> int: ...


def setup(combo: _Combo, config: dict[str, Any], workers: int) -> dict[str, Any]:
    """Everything that makes a combination the benchmark it is, as JSON values (a hand-edited
    results file whose config lacks the combination's mesh or checkpoint matches nothing)."""
    meshes, checkpoints = as_written(config)
    mesh = combo.mesh
    return to_jsonable_python(  # type: ignore[no-any-return]
        {
            "generator": combo.generator,
            "options": combo.options,
            "mesh": None if mesh is None else _mesh(meshes[mesh] if mesh < len(meshes) else {}),
            "checkpoint": checkpoints[combo.checkpoint]
            if combo.checkpoint < len(checkpoints)
            else {},
            "workers": workers,
        }
    )


def _mesh(mesh: object) -> object:
    """A mesh with every axis's ICI and DCN size spelled out (an axis left out is 1)."""
    if not isinstance(mesh, dict) or not isinstance(mesh.get("mesh_axes"), list):
        return mesh
    axes = mesh["mesh_axes"]
    sizes = {k: {a: dict(mesh.get(k) or {}).get(a, 1) for a in axes} for k in PARALLELISM}
    return {**mesh, **sizes}


PARALLELISM = ("ici_parallelism", "dcn_parallelism")


def _key(parts: dict[str, Any]) -> str:
    return json.dumps(parts, sort_keys=True)


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """What differs between two setups, key by key: ``mesh.dcn_parallelism.data 2 -> 4``."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [*new, *(k for k in old if k not in new)]
        return [d for k in keys for d in differences(old.get(k), new.get(k), _at(where, k))]
    return [] if old == new else [f"{where} {_short(old)} -> {_short(new)}"]


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unlike(
    label: str, parts: dict[str, Any], baseline: Iterable[tuple[str, dict[str, Any]]]
) -> str:
    """Why a combination has no like in the baseline: how the nearest there differs (the one
    of its label, else the one with the fewest differences)."""
    found = list(baseline)
    same = [p for lbl, p in found if lbl == label] or [p for _, p in found]
    if not same:
        return "the baseline has no combination"
    shown = min((differences(p, parts) for p in same), key=len)
    return "the baseline's differs: " + "; ".join(shown[:3]) + (" ..." if len(shown) > 3 else "")


def _setups(results: Results) -> list[tuple[str, dict[str, Any]]]:
    return [(c.label, setup(c, results.config, results.workers)) for c in results.combinations]


def check_like(config: BenchConfig, workers: int, baseline: Results, path: str) -> None:
    """Before a run: refuse a baseline that has none of this config's combinations."""
    before = _setups(baseline)
    keys = {_key(p) for _, p in before}
    planned = [(c.label, setup(c, config.raw, workers)) for c in config.combinations]
    if any(_key(p) in keys for _, p in planned):
        return
    label, parts = planned[0]
    raise UsageError(
        f"--baseline {path}: no combination of this config ran there "
        f"({label}: {_unlike(label, parts, before)})",
        hint="compare with a run of the same config on as many workers, or run without --baseline",
    )


def compare(
    current: Results, baseline: Results, path: str, threshold: float = DEFAULT_THRESHOLD
) -> Comparison:
    before_setups = _setups(baseline)
    before = {_key(p): c for (_, p), c in zip(before_setups, baseline.combinations, strict=True)}
    changes: list[Change] = []
    skipped: list[tuple[str, str]] = []
    for combo, (label, parts) in zip(current.combinations, _setups(current), strict=True):
        old = before.get(_key(parts))
        if old is None:
            skipped.append((label, _unlike(label, parts, before_setups)))
            continue
        if combo.status != Status.OK or not combo.repeats:
            skipped.append((label, f"{combo.status.value} now"))
            continue
        if old.status != Status.OK or not old.repeats:
            skipped.append((label, f"{old.status.value} in the baseline"))
            continue
        shared = [m for m in combo.repeats if m in old.repeats]
        # save and restore where the generator has them, else every operation Orbax timed
        metrics = [m for m in COMPARED if m in shared] or [m for m in shared if m.startswith(OP)]
        if not metrics:
            skipped.append((label, "no metric in common with the baseline"))
        for metric in metrics:
            was, now = old.repeats[metric].mean, combo.repeats[metric].mean
            better = larger_is_better(metric)
            worse = now < was * (1 - threshold) if better else now > was * (1 + threshold)
            changes.append(Change(label, metric, was, now, worse))
    return Comparison(baseline.commit, current.commit, path, changes, skipped)
