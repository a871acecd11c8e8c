"""What a checkpoint benchmark measured: per-host samples, and their aggregates.

A sample is one host's run of a generator in one repeat of one combination:
tpupod's save and restore figures where the generator saves and restores, and
every operation Orbax timed (``op:NAME``, step numbers folded into ``#`` and
summed, so twenty ``save_<step>`` are one ``op:save_#``). Across hosts (each
host's mean over repeats): max, min, mean, p50, p99. Across repeats (the
pod's value in each: the slowest host's time, the bytes over that time):
mean and std. One ``Results`` is one run, written as one JSON file.
"""

from __future__ import annotations

import re
import statistics
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

SCHEMA = 1
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
    mean: float
    std: float


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
        self.repeats = {m: _repeat_stats(self.samples, m) for m in metrics}


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


def _repeat_stats(samples: list[Sample], metric: str) -> RepeatStats:
    per_repeat: dict[int, list[Sample]] = {}
    for s in samples:
        per_repeat.setdefault(s.repeat, []).append(s)
    values = [pod_value(group, metric) for group in per_repeat.values()]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return RepeatStats(mean=statistics.fmean(values), std=std)
