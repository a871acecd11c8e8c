"""One sample of a pod's workers: reachable or not, CPU load and memory, through the same
fan-out every command uses (one short shell line per worker, on kept connections); on a
worker with TPU devices also HBM and duty cycle from libtpu's metrics (libtpu.py)."""

from __future__ import annotations

import dataclasses
import re
import shlex
import time
from dataclasses import dataclass
from typing import Any

from tpupod import settings
from tpupod.dashboard import libtpu
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult, slice_of
from tpupod.pod.record import Pod
from tpupod.providers import Connector

# load average, cores, memory: one line each, read from /proc (no tools needed on the host)
PROBE = (
    "read a b c _ < /proc/loadavg; echo load $a; echo cores $(nproc); "
    "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo"
)
# a TPU host's chips (v4: /dev/accel*, v5e and later: /dev/vfio/N; TPUPOD_ACCELERATOR_DEVICES
# names others); only there does the probe start Python to ask libtpu
TPU_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*")
GLOB = re.compile(r"[A-Za-z0-9_./*?\[\]-]+")  # a pattern left unquoted for the shell to expand
METRICS_ENV = "TPUPOD_LIBTPU_METRICS"  # libtpu's metrics address (default localhost:8431)


def probe(python: str) -> str:
    """The shell line: load, cores, memory; ``tpu ...`` lines where TPU devices exist."""
    patterns = [p for p in settings.accelerator_devices(TPU_DEVICES) if GLOB.fullmatch(p)]
    address = settings.named(METRICS_ENV) or libtpu.ADDRESS
    ask = shlex.join([python, "-m", "tpupod.dashboard.libtpu", address])
    return (
        f'{PROBE}; for d in {" ".join(patterns)}; do if [ -e "$d" ]; then {ask}; break; fi; '
        "done; true"
    )


@dataclass(frozen=True)
class WorkerSample:
    worker: int
    hostname: str
    reachable: bool
    at: float
    load: float | None = None  # 1-minute load average per core (1.0: every core busy)
    memory: float | None = None  # share of memory in use, 0..1
    accelerator: str = "no TPU"  # on TPU hosts: HBM and duty cycle, or "idle" (libtpu.summary)
    error: str = ""
    slice: int | None = None  # on a pod of slices

    def to_json(self) -> dict[str, Any]:
        # its fields are plain values: a copy of them, where asdict's deep copy of 256
        # samples every interval was half the sampling process's CPU
        return dict(vars(self))


def parse(lines: list[str]) -> tuple[float | None, float | None]:
    """(load per core, memory in use) from the probe's lines; None where a line is missing."""
    values: dict[str, float] = {}
    for line in lines:
        parts = line.replace(":", "").split()
        if len(parts) >= 2:
            try:
                values[parts[0]] = float(parts[1])
            except ValueError:
                continue
    load = values["load"] / max(values.get("cores", 1.0), 1.0) if "load" in values else None
    total, free = values.get("MemTotal"), values.get("MemAvailable")
    memory = (total - free) / total if total and free is not None else None
    return load, memory


async def sample_pod(pod: Pod, connector: Connector, timeout: float) -> list[WorkerSample]:
    """Every worker's sample; one that does not answer within ``timeout`` is unreachable.
    A local pod's workers are processes of this machine: one probe's answer (worker 0's)
    is every worker's, where probing each cost a process per worker per interval."""
    asked = pod.workers[:1] if pod.on_this_machine else pod.workers
    seen: dict[int, list[str]] = {w.id: [] for w in asked}
    result: FanoutResult = await execute_async(
        pod,
        probe(pod.worker_python()),
        workers=asked,
        timeout=timeout,
        grace=0.5,
        connector=connector,
        on_line=lambda worker, line: seen[worker.id].append(line.text),
    )
    now = time.time()
    samples = []
    for r in result.workers:
        lines = seen[r.worker.id] if r.ok else []
        load, memory = parse(lines)
        accelerator = libtpu.summary(lines) or "no TPU"
        error = "" if r.ok else f"{r.outcome_text()}: {r.last_line}".strip(": ")
        w = r.worker
        samples.append(
            WorkerSample(w.id, w.hostname, r.ok, now, load, memory, accelerator, error, slice_of(w))
        )
    if pod.on_this_machine:
        one = samples[0]
        return [
            dataclasses.replace(one, worker=w.id, hostname=w.hostname, slice=w.slice)
            for w in pod.workers
        ]
    return samples
