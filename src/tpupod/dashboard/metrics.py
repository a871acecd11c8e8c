"""The sampled numbers in Prometheus' text format (prometheus-client), for /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tpupod.dashboard.feed import Feed

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Snapshot(Collector):
    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    def collect(self) -> Iterator[Metric]:
        sources = self.feed.sources
        up = GaugeMetricFamily(
            "tpupod_worker_up", "worker answered the last probe", labels=["pod", "worker", "host"]
        )
        load = GaugeMetricFamily(
            "tpupod_worker_load", "1-minute load per core", labels=["pod", "worker"]
        )
        memory = GaugeMetricFamily(
            "tpupod_worker_memory_used_ratio", "memory in use", labels=["pod", "worker"]
        )
        for pod in sources["pods"].data or ():
            for w in pod["workers"]:
                ids = [pod["name"], str(w["worker"])]
                up.add_metric([*ids, w["hostname"]], 1.0 if w["reachable"] else 0.0)
                if w["load"] is not None:
                    load.add_metric(ids, w["load"])
                if w["memory"] is not None:
                    memory.add_metric(ids, w["memory"])
        jobs = GaugeMetricFamily("tpupod_jobs", "jobs by status", labels=["status"])
        for status, count in (sources["jobs"].data or {"counts": {}})["counts"].items():
            jobs.add_metric([status], count)
        rate = GaugeMetricFamily(
            "tpupod_backend_requests_per_second",
            "requests/s per backend",
            labels=["pod", "backend"],
        )
        for fleet in sources["serving"].data or ():
            for b in fleet["backends"]:
                if b["requests_per_s"] is not None:
                    rate.add_metric([fleet["pod"], b["address"]], b["requests_per_s"])
        runs = GaugeMetricFamily("tpupod_runs", "runs by state", labels=["state"])
        for state, count in (sources["runs"].data or {"states": {}})["states"].items():
            runs.add_metric([state], count)
        yield from (up, load, memory, jobs, rate, runs)


def exposition(feed: Feed) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(feed))
    return generate_latest(registry)
