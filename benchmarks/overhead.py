"""Per-command overhead of the supervision work: wrapper and engine beside their old selves.

    .venv/bin/python benchmarks/overhead.py --hosts 16 --runs 15 --against 40044db   # as root

Times ``hostname`` on every host of a simulated pod through the warm Python
API, alternating run by run, with:

* the current remote wrapper (``transport.base.command_script``: a TERM trap,
  a command-not-found handler, the re-raise of a killing signal) and a bare
  one with only the re-raise (the wrapper before issue 10, the anchor);
* with ``--against REV``, the fan-out engine (``fanout.py``) of that git
  revision beside the current one.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from common import sim_pod

import tpupod.transport.ssh as ssh_transport
from tpupod.fanout.execute import execute as fanout
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.providers import provider_for
from tpupod.sim import SimPod
from tpupod.transport import base


def bare(command: str, *, guard: bool = False, grace: float = 0.0) -> str:
    return "\n".join([command, "tpupod_rc=$?", *base.RERAISE, 'exit "$tpupod_rc"'])


ANCHOR = "bare wrapper, current engine (the anchor)"


def old_engine(revision: str) -> ModuleType:
    """``fanout.py`` as it was at ``revision``, loaded beside the current one."""
    source = subprocess.run(
        ["git", "show", f"{revision}:src/tpupod/fanout/execute.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    path = Path(tempfile.mkdtemp()) / "fanout_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fanout_then", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fanout_then"] = module
    spec.loader.exec_module(module)
    return module


async def measure(pod: Pod, runs: int, against: str | None) -> dict[str, list[float]]:
    cases: dict[str, tuple[Callable[..., str], ModuleType]] = {
        "current wrapper, current engine": (base.command_script, fanout),
        ANCHOR: (bare, fanout),
    }
    if against:
        cases[f"current wrapper, engine of {against}"] = (base.command_script, old_engine(against))
    connector = provider_for(pod.provider).connect(pod, StateDir())
    samples: dict[str, list[float]] = {name: [] for name in cases}
    try:
        await fanout.execute_async(pod, "hostname", connector=connector)  # connections up
        for _ in range(runs):
            for name, (script, engine) in cases.items():
                ssh_transport.command_script = script
                started = time.perf_counter()
                await engine.execute_async(pod, "hostname", connector=connector)
                samples[name].append((time.perf_counter() - started) * 1000)
    finally:
        ssh_transport.command_script = base.command_script
        await connector.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--against", metavar="REV", help="also the fan-out engine of REV")
    args = parser.parse_args()
    os.environ["TPUPOD_HOME"] = tempfile.mkdtemp(prefix="tpupod-bench-")
    with SimPod(args.hosts) as sim:
        pod = sim_pod(sim, "overhead")
        samples = asyncio.run(measure(pod, args.runs, args.against))
    anchor = statistics.median(samples[ANCHOR])
    print(f"{args.hosts} hosts, warm Python API, medians of {args.runs} alternating runs\n")
    print("| case | median ms | vs anchor |\n|---|--:|--:|")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / anchor:.2f}x |")


if __name__ == "__main__":
    main()
