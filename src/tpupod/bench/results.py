"""What a checkpoint benchmark measured: per-host samples, and their aggregates.

A sample is one host's run of a generator in one repeat of one combination:
tpupod's save and restore figures where the generator saves and restores, and
every operation Orbax timed (``op:NAME``, step numbers folded into ``#`` and
summed, so twenty ``save_<step>`` are one ``op:save_#``). Across hosts (each
host's mean over repeats): max, min, mean, p50, p99. Across repeats (the
pod's value in each: the slowest host's time, the bytes over that time):
every value, their median, mean and std. One ``Results`` is one run, written
as one JSON file. Last, the noise band of two runs' ratio, from their repeats,
which ``baseline`` decides regressions by.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

# 2: each metric's repeats keep their values and median; a file of schema 1 has mean and std
# only, and its values are taken from its samples (``CombinationResult.values``).
SCHEMA = 2
# The metrics tpupod reports, and whether a larger value is better.
METRICS = {
    "save_blocking_s": False,
    "save_total_s": False,
    "restore_s": False,
    "save_gbps": True,
    "restore_gbps": True,
    "rss_save_mb": False,
    "rss_restore_mb": False,
}
TIMES = {"save_gbps": "save_total_s", "restore_gbps": "restore_s"}
COUNTS = {"save_gbps": "saves", "restore_gbps": "restores"}
OP = "op:"  # an operation Orbax timed, in seconds (smaller is better)


def op_metric(name: str) -> str:
    """The metric an Orbax operation counts toward: step numbers folded (save_12 -> save_#)."""
    return OP + re.sub(r"\d+", "#", name)


def larger_is_better(metric: str) -> bool:
    return METRICS.get(metric, False)


class Sample(BaseModel):
    """One host, one repeat of one combination."""

    worker: int
    hostname: str
    repeat: int
    # None where the generator does not save (or restore) the tree, such as a cancel benchmark
    save_blocking_s: float | None  # until save() returned (async: the rest goes on in the bg)
    save_total_s: float | None  # until the checkpoint was complete on disk
    restore_s: float | None
    rss_save_mb: float | None  # host RSS growth over the save
    rss_restore_mb: float | None
    nbytes: int  # the checkpoint's arrays, all hosts together
    saves: int = 1  # how many saves the times cover (a CheckpointManager saves every step)
    restores: int = 1
    ops: dict[str, float] = Field(default_factory=dict)  # every op Orbax timed, its names, s
    seconds: float = 0.0  # the generator's whole test_fn, wall time (timed ops and the rest)
    problems: list[str] = Field(default_factory=list)  # restored != saved, one line per leaf

    def value(self, metric: str) -> float | None:
        if metric.startswith(OP):
            found = [v for k, v in self.ops.items() if op_metric(k) == metric]
            return sum(found) if found else None
        if metric in TIMES:
            seconds = getattr(self, TIMES[metric])
            count = getattr(self, COUNTS[metric])
            return None if seconds is None else _gbps(self.nbytes * count, seconds)
        found = getattr(self, metric)
        return None if found is None else float(found)

    def metrics(self) -> list[str]:
        """The metrics this sample has a value of."""
        ops = sorted({op_metric(k) for k in self.ops})
        return [m for m in [*METRICS, *ops] if self.value(m) is not None]


class HostStats(BaseModel):
    max: float
    min: float
    mean: float
    p50: float
    p99: float


class RepeatStats(BaseModel):
    """A metric across repeats: the pod's value in each repeat, in repeat order."""

    mean: float
    std: float
    median: float | None = None  # None in a file of schema 1
    values: list[float] = Field(default_factory=list)

    @classmethod
    def of(cls, values: list[float]) -> RepeatStats:
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        return cls(
            mean=statistics.fmean(values),
            std=std,
            median=statistics.median(values),
            values=values,
        )


class Status(StrEnum):
    OK = "ok"
    SKIPPED = "skipped"  # the mesh does not fit this pod (Orbax skips such meshes too)
    MISMATCH = "mismatch"  # restored arrays differ from the saved ones


class CombinationResult(BaseModel):
    index: int
    label: str
    generator: str
    options: dict[str, Any]
    swept: dict[str, Any]
    mesh: int | None
    checkpoint: int
    status: Status
    reason: str = ""
    samples: list[Sample] = Field(default_factory=list)
    hosts: dict[str, HostStats] = Field(default_factory=dict)
    repeats: dict[str, RepeatStats] = Field(default_factory=dict)

    def mismatch_check(self) -> None:
        """A combination where any host restored something else is a mismatch, not a result."""
        if any(s.problems for s in self.samples):
            self.status = Status.MISMATCH
            self.reason = "restored arrays differ from the saved ones"

    def aggregate(self) -> None:
        if not self.samples:
            return
        metrics = [
            m for m in self.samples[0].metrics() if all(m in s.metrics() for s in self.samples)
        ]
        self.hosts = {m: _host_stats(self.samples, m) for m in metrics}
        self.repeats = {m: RepeatStats.of(repeat_values(self.samples, m)) for m in metrics}

    def values(self, metric: str) -> list[float]:
        """The pod's value of a metric in each repeat: as written, else (a results file of
        schema 1) from the samples, else (a file with neither) its mean, as one repeat."""
        stats = self.repeats[metric]
        if stats.values:
            return stats.values
        return repeat_values(self.samples, metric) or [stats.mean]


class Results(BaseModel):
    schema_version: int = SCHEMA
    suite_name: str
    launch_id: str
    started: str
    seconds: float
    commit: str
    pod: str
    workers: int
    machine: dict[str, Any]
    versions: dict[str, str]
    config: dict[str, Any]
    combinations: list[CombinationResult]

    def problems(self) -> list[str]:
        return [
            f"{c.label}: w{s.worker} repeat {s.repeat}: {p}"
            for c in self.combinations
            for s in c.samples
            for p in s.problems
        ]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e9 / seconds if seconds > 0 else 0.0


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _host_stats(samples: list[Sample], metric: str) -> HostStats:
    per_host: dict[int, list[float]] = {}
    for s in samples:
        per_host.setdefault(s.worker, []).append(_value(s, metric))
    means = [statistics.fmean(v) for v in per_host.values()]
    return HostStats(
        max=max(means),
        min=min(means),
        mean=statistics.fmean(means),
        p50=_percentile(means, 0.5),
        p99=_percentile(means, 0.99),
    )


def pod_value(samples: list[Sample], metric: str) -> float:
    """One repeat's value for the pod: the slowest host's time (and the bytes over it)."""
    if metric in TIMES:
        first = samples[0]
        nbytes = first.nbytes * getattr(first, COUNTS[metric])
        return _gbps(nbytes, max(float(getattr(s, TIMES[metric])) for s in samples))
    return max(_value(s, metric) for s in samples)


def _value(sample: Sample, metric: str) -> float:
    found = sample.value(metric)
    assert found is not None, f"{metric} of a sample that lacks it"
    return found


def repeat_values(samples: list[Sample], metric: str) -> list[float]:
    """The pod's value in each repeat, in repeat order (empty where no sample has it)."""
    per_repeat: dict[int, list[Sample]] = {}
    for s in samples:
        if s.value(metric) is not None:
            per_repeat.setdefault(s.repeat, []).append(s)
    return [pod_value(per_repeat[r], metric) for r in sorted(per_repeat)]


# -- the noise band ------------------------------------------------------------------------
# Whether two runs' repeats tell a change from noise: a band for the ratio of two runs.
#
# A run repeats each benchmark; how far the repeats spread is the noise. The band of
# the ratio now/before is the confidence interval that goes with the one-sided
# Mann-Whitney U test (Hodges-Lehmann's, on the ratios): of the n x m ratios of a
# current repeat to a baseline repeat, sorted, it leaves out the k - 1 lowest and the
# k - 1 highest, k from the test's exact distribution. It lies wholly above 1 exactly
# where the test finds the current repeats larger at that level, and wholly below 1
# where it finds them smaller. With 3 repeats each at 5 % it is the lowest to the
# highest ratio: the two runs' ranges must not overlap. With fewer repeats than the
# test needs (2 and 2: the most extreme ordering has a chance of 1 in 6) there is no
# band at all, and nothing can be told. No distribution is assumed, only that a run's
# repeats are exchangeable with another run's when nothing changed.

ALPHA = 0.05  # the chance, over a whole comparison, of calling noise a change (per side)


@dataclass(frozen=True)
class Band:
    """The ratios now/before that the repeats cannot rule out."""

    low: float
    high: float


def noise_band(before: Sequence[float], now: Sequence[float], alpha: float) -> Band | None:
    """The band at level ``alpha`` on each side; None where the repeats are too few for it."""
    k = _critical(len(before), len(now), alpha)
    if k is None:
        return None
    ratios = sorted(ratio_of(b, a) for a in before for b in now)
    return Band(low=ratios[len(ratios) - k], high=ratios[k - 1])


def ratio_of(now: float, before: float) -> float:
    if before > 0:
        return now / before
    return math.inf if now > 0 else 1.0


def repeats_needed(alpha: float) -> int:
    """The fewest repeats, the same in both runs, that give a band at level ``alpha``."""
    repeats = 1
    while 1 / math.comb(2 * repeats, repeats) > alpha:
        repeats += 1
    return repeats


def _critical(n: int, m: int, alpha: float) -> int | None:
    """The smallest u with P(U >= u) <= alpha where nothing changed (None: even U = n*m,
    every current repeat above every baseline one, is likelier than alpha)."""
    if n == 0 or m == 0:
        return None
    counts = _u_counts(n, m)
    allowed = alpha * math.comb(n + m, n)
    tail = 0
    for u in range(n * m, -1, -1):
        tail += counts[u]
        if tail > allowed:
            return u + 1 if u < n * m else None
    return 0


def _u_counts(n: int, m: int) -> list[int]:
    """How many of the C(n + m, n) equally likely orderings of two runs' repeats give each
    U: the coefficients of the Gaussian binomial [n + m choose n], the product over i of
    (1 - q^(m+i)) / (1 - q^i), computed as power series cut at degree n*m (exact, since
    the result is a polynomial of that degree)."""
    n, m = sorted((n, m))
    size = n * m + 1
    counts = [1] + [0] * (size - 1)
    for i in range(1, n + 1):
        for u in range(size - 1, m + i - 1, -1):  # times (1 - q^(m+i))
            counts[u] -= counts[u - m - i]
        for u in range(i, size):  # over (1 - q^i)
            counts[u] += counts[u - i]
    return counts
