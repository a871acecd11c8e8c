"""`tpupod bench checkpoint`'s results for the dashboard: every run of every suite under the
folder (or gs:// URL) given with ``--bench``, read as the suite reads its baselines
(bench/baseline.py), with the plots the suite wrote beside them."""

from __future__ import annotations

from typing import Any

from tpupod.base import storage
from tpupod.bench.baseline import RESULTS_FILE, load
from tpupod.errors import StateError


def runs(output: str | None) -> list[dict[str, Any]]:
    """Every run's summary, newest first (launch ids sort by time)."""
    if not output:
        return []
    found = sorted(storage.glob(output, f"*/*/{RESULTS_FILE}"), reverse=True)
    return [_summary(path) for path in found]


def _summary(path: str) -> dict[str, Any]:
    results = load(path)
    suite = path.rsplit("/", 3)[-3]
    return {
        "suite": suite,
        "suite_name": results.suite_name,
        "launch_id": results.launch_id,
        "started": results.started,
        "pod": results.pod,
        "workers": results.workers,
        "combinations": len(results.combinations),
        "problems": len(results.problems()),
    }


def detail(output: str | None, suite: str, launch_id: str) -> dict[str, Any]:
    """One run: every combination's status and mean per metric; its plots' names."""
    folder = _folder(output, suite, launch_id)
    results = load(storage.join(folder, RESULTS_FILE))
    combos = [
        {
            "label": c.label,
            "status": c.status.value,
            "reason": c.reason,
            "means": {metric: stats.mean for metric, stats in c.repeats.items()},
        }
        for c in results.combinations
    ]
    metrics = sorted({m for c in combos for m in c["means"]})
    plots = [name for name in storage.names(folder) if name.endswith(".png")]
    return {
        "suite": suite,
        "suite_name": results.suite_name,
        "launch_id": launch_id,
        "pod": results.pod,
        "workers": results.workers,
        "combinations": combos,
        "metrics": metrics,
        "plots": sorted(plots),
        "problems": results.problems(),
    }


def plot(output: str | None, suite: str, launch_id: str, name: str) -> bytes:
    """A plot's PNG bytes (only a name the run's folder lists)."""
    folder = _folder(output, suite, launch_id)
    if not name.endswith(".png") or name not in storage.names(folder):
        raise StateError(f"no plot {name!r} in run {launch_id}", hint="the run's page lists them")
    data = storage.read(storage.join(folder, name))
    if data is None:
        raise StateError(f"no plot {name!r} in run {launch_id}", hint="the run's page lists them")
    return data


def _folder(output: str | None, suite: str, launch_id: str) -> str:
    known = {(r["suite"], r["launch_id"]) for r in runs(output)}
    if (suite, launch_id) not in known:
        raise StateError(
            f"no checkpoint benchmark run {suite}/{launch_id}",
            hint="start the dashboard with --bench OUTPUT (the suite's --output)",
        )
    assert output is not None
    return storage.join(output, suite, launch_id)
