"""Compare a run with an earlier one (a results file, or the latest of the same suite).

Only like is compared with like: combinations match by generator, every option,
the mesh (axes, ICI and DCN parallelism), the checkpoint (its spec or path) and
the pod's worker count, so a run of another config under the same suite name
is compared only where a combination is truly the same, and the rest is named
with what differs. A comparison that compares nothing fails. The metrics
compared are save and restore times and GB/s, or, for a generator that does not
save and restore the tree, the seconds of every operation Orbax timed.

A metric regresses when two things hold: its median over the repeats is worse
than the baseline's by more than the threshold (slower by that fraction for a
time; a throughput divided by 1 + threshold), and the repeats tell the change
from noise: the noise band of the ratio (``results.noise_band``, the Mann-Whitney
test's interval) lies wholly on the worse side of 1. The test's 5 % is split among the
metrics compared (Bonferroni; a GB/s is its time's repeats inverted, so it counts
with its time), so two identical runs are called different in 1 comparison in 20
at most, however many metrics they have. A change beyond the threshold with too
few repeats for a band is inconclusive, never a regression. Memory growth is
reported but never compared: RSS deltas of a few MB are noise.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from pydantic import ValidationError
from pydantic_core import to_jsonable_python

from tpupod.base import storage
from tpupod.bench.config import BenchConfig, as_written
from tpupod.bench.results import (
    ALPHA,
    OP,
    TIMES,
    Band,
    CombinationResult,
    Results,
    Status,
    larger_is_better,
    noise_band,
    ratio_of,
)
from tpupod.errors import UsageError

RESULTS_FILE = "results.json"
COMPARED = ("save_blocking_s", "save_total_s", "restore_s", "save_gbps", "restore_gbps")
DEFAULT_THRESHOLD = 0.10


class Verdict(StrEnum):
    REGRESSION = "REGRESSION"  # worse beyond the threshold, and beyond the noise
    IMPROVED = "improved"  # better beyond both
    SAME = "ok"  # within the threshold (whatever the noise)
    NOISE = "ok, within noise"  # beyond the threshold, inside the noise band
    INCONCLUSIVE = "inconclusive"  # beyond the threshold; too few repeats for a band


@dataclass(frozen=True)
class Change:
    """One metric of one combination, now against the baseline: every repeat's value."""

    label: str
    metric: str
    before: list[float]
    now: list[float]
    band: Band | None  # the ratios now/before the repeats allow; None: too few
    verdict: Verdict

    @property
    def baseline(self) -> float:
        return statistics.median(self.before)

    @property
    def current(self) -> float:
        return statistics.median(self.now)

    @property
    def ratio(self) -> float:
        return ratio_of(self.current, self.baseline)

    @property
    def regressed(self) -> bool:
        return self.verdict == Verdict.REGRESSION


@dataclass(frozen=True)
class Comparison:
    baseline_commit: str
    current_commit: str
    baseline_path: str
    changes: list[Change]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (label, why not compared)
    threshold: float = DEFAULT_THRESHOLD
    tests: int = 1  # how many metrics the test's 5 % is split among

    @property
    def alpha(self) -> float:
        """Each metric's level (a side): the comparison's over its metrics (Bonferroni)."""
        return ALPHA / self.tests

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.regressed]

    @property
    def inconclusive(self) -> list[Change]:
        return [c for c in self.changes if c.verdict == Verdict.INCONCLUSIVE]


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
    """Every like combination's metrics, each with its noise band and verdict."""
    before_setups = _setups(baseline)
    before = {_key(p): c for (_, p), c in zip(before_setups, baseline.combinations, strict=True)}
    pairs: list[tuple[str, str, list[float], list[float]]] = []  # label, metric, before, now
    skipped: list[tuple[str, str]] = []
    for combo, (label, parts) in zip(current.combinations, _setups(current), strict=True):
        old = before.get(_key(parts))
        if old is None:
            skipped.append((label, _unlike(label, parts, before_setups)))
        elif combo.status != Status.OK or not combo.repeats:
            skipped.append((label, f"{combo.status.value} now"))
        elif old.status != Status.OK or not old.repeats:
            skipped.append((label, f"{old.status.value} in the baseline"))
        else:
            metrics = _compared(combo, old)
            if not metrics:
                skipped.append((label, "no metric in common with the baseline"))
            pairs += [(label, m, old.values(m), combo.values(m)) for m in metrics]
    tests = max(1, _tests([(label, m) for label, m, _, _ in pairs]))
    changes = [
        _change(label, metric, was, now, threshold=threshold, alpha=ALPHA / tests)
        for label, metric, was, now in pairs
    ]
    return Comparison(
        baseline.commit, current.commit, path, changes, skipped, threshold=threshold, tests=tests
    )


def _compared(combo: CombinationResult, old: CombinationResult) -> list[str]:
    """Save and restore where the generator has them, else every operation Orbax timed."""
    shared = [m for m in combo.repeats if m in old.repeats]
    return [m for m in COMPARED if m in shared] or [m for m in shared if m.startswith(OP)]


def _tests(metrics: list[tuple[str, str]]) -> int:
    """How many tests the (combination, metric) pairs are: a GB/s is its time's repeats
    inverted (the same ranks, the same verdict), so it counts only without its time."""
    compared = set(metrics)
    return sum(1 for label, m in metrics if m not in TIMES or (label, TIMES[m]) not in compared)


def _change(
    label: str,
    metric: str,
    before: list[float],
    now: list[float],
    *,
    threshold: float,
    alpha: float,
) -> Change:
    band = noise_band(before, now, alpha)
    slower, slower_band = ratio_of(statistics.median(now), statistics.median(before)), band
    if larger_is_better(metric):  # a throughput: worse is smaller, so turn it upside down
        slower = _inverse(slower)
        slower_band = None if band is None else Band(_inverse(band.high), _inverse(band.low))
    return Change(label, metric, before, now, band, _verdict(slower, slower_band, threshold))


def _inverse(ratio: float) -> float:
    return 1 / ratio if ratio else math.inf


def _verdict(slower: float, band: Band | None, threshold: float) -> Verdict:
    """From how many times slower now is (its medians) and the band of that ratio."""
    if 1 / (1 + threshold) <= slower <= 1 + threshold:
        return Verdict.SAME
    if band is None:
        return Verdict.INCONCLUSIVE
    if slower > 1 + threshold and band.low > 1:
        return Verdict.REGRESSION
    if slower < 1 / (1 + threshold) and band.high < 1:
        return Verdict.IMPROVED
    return Verdict.NOISE
