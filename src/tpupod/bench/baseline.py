"""Compare a run with an earlier one (a results file, or the latest of the same suite).

Combinations match by generator, options, mesh and checkpoint. The metrics
compared are save and restore times and GB/s, or, for a generator that does not
save and restore the tree, the seconds of every operation Orbax timed. A metric
regresses when the pod's mean over repeats is worse than the baseline's by
more than the threshold (slower for times, fewer GB/s for throughput). Memory
growth is reported but never flagged: RSS deltas of a few MB are noise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError

from tpupod.bench import storage
from tpupod.bench.results import OP, Results, larger_is_better
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


def compare(
    current: Results, baseline: Results, path: str, threshold: float = DEFAULT_THRESHOLD
) -> Comparison:
    before = {c.key(): c for c in baseline.combinations if c.repeats}
    changes = []
    for combo in current.combinations:
        old = before.get(combo.key())
        if old is None or not combo.repeats:
            continue
        shared = [m for m in combo.repeats if m in old.repeats]
        # save and restore where the generator has them, else every operation Orbax timed
        metrics = [m for m in COMPARED if m in shared] or [m for m in shared if m.startswith(OP)]
        for metric in metrics:
            was, now = old.repeats[metric].mean, combo.repeats[metric].mean
            better = larger_is_better(metric)
            worse = now < was * (1 - threshold) if better else now > was * (1 + threshold)
            changes.append(Change(combo.label, metric, was, now, worse))
    return Comparison(baseline.commit, current.commit, path, changes)
