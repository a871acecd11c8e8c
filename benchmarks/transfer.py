"""put / get over SFTP beside the tar stream over an exec channel, on a simulated pod.

Run as root (it builds simulated pods of network namespaces with real sshd):

    .venv/bin/python benchmarks/transfer.py                 # 1 host, 128 MiB, 1,000 files, 5 runs
    .venv/bin/python benchmarks/transfer.py --hosts 4 --large-mib 256 --runs 7

Two workloads, made in a temporary folder (nothing is committed): one large
file of random bytes and a folder of 1,000 small files (1-4 KiB, in 10
subfolders). Each is put to every host and got back with tpupod's Python API
over warm connections, over SFTP (the anchor) and as a tar stream, in the same
run on the same machine, the two interleaved run by run. Both go through
tpupod's own code, on two simulated pods: one whose sshd has no SFTP
subsystem (so everything goes by tar), one whose sessions find no ``tar`` (so
everything goes over SFTP).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

from common import sim_pod

from tpupod.fanout.results import FanoutResult
from tpupod.ops.transfer import get, put
from tpupod.pod.record import Pod
from tpupod.providers import Connector, connect
from tpupod.sim import SimPod


def make_large(root: Path, mib: int) -> Path:
    path = root / "large.bin"
    with path.open("wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    return path


def make_small(root: Path, count: int) -> Path:
    folder = root / "small"
    for i in range(count):
        sub = folder / f"d{i % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.txt").write_bytes(os.urandom(1024 + (i * 37) % 3072))
    return folder


async def once(step: Awaitable[FanoutResult]) -> float:
    started = time.perf_counter()
    result = await step
    if not result.ok:
        raise SystemExit(f"failed: {[w.error for w in result.workers if w.error]}")
    return time.perf_counter() - started


async def measure(
    pods: dict[str, Pod], source: Path, back: Path, runs: int
) -> dict[str, dict[str, list[float]]]:
    """{direction: {method: samples}}: one warm-up, then ``runs`` rounds, methods interleaved."""
    connectors: dict[str, Connector] = {method: connect(pod) for method, pod in pods.items()}
    remote = f"bench/{source.name}"
    samples: dict[str, dict[str, list[float]]] = {"put": {}, "get": {}}
    try:
        for run in range(runs + 1):
            order = list(pods) if run % 2 else list(reversed(pods))
            for method in order:
                pod, connector = pods[method], connectors[method]
                local = back / method
                shutil.rmtree(local, ignore_errors=True)
                took = {
                    "put": await once(put(pod, source, remote, connector=connector)),
                    "get": await once(get(pod, remote, local, connector=connector)),
                }
                for direction, seconds in took.items():
                    if run:  # the first round warms connections and caches up
                        samples[direction].setdefault(method, []).append(seconds)
        return samples
    finally:
        for connector in connectors.values():
            await connector.close()


def print_table(results: dict[tuple[str, str], dict[str, list[float]]], runs: int) -> None:
    print(f"\n({runs} runs each; medians)")
    print("| workload                | direction | SFTP s | tar stream s | tar / SFTP |")
    print("|-------------------------|-----------|-------:|-------------:|-----------:|")
    for (workload, direction), rows in results.items():
        sftp, tar = statistics.median(rows["sftp"]), statistics.median(rows["tar"])
        print(
            f"| {workload:<23} | {direction:<9} | {sftp:6.2f} | {tar:12.2f} | {tar / sftp:9.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--large-mib", type=int, default=128)
    parser.add_argument("--small-files", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-transfer-") as tmp:
        root = Path(tmp)
        os.environ["TPUPOD_HOME"] = str(root / "state")
        data = root / "data"
        data.mkdir()
        workloads = {
            f"1 file, {args.large_mib} MiB": make_large(data, args.large_mib),
            f"{args.small_files:,} files, 1-4 KiB": make_small(data, args.small_files),
        }
        with (
            SimPod(args.hosts, sshd_options={"SetEnv": "SHLVL=1 PATH=/var/empty"}) as no_tar,
            SimPod(args.hosts, sshd_options={"Subsystem": None}) as no_sftp,
        ):
            pods = {"sftp": sim_pod(no_tar, "sftp"), "tar": sim_pod(no_sftp, "tar")}
            for workload, source in workloads.items():
                rows = asyncio.run(measure(pods, source, root / "back", args.runs))
                for direction, methods in rows.items():
                    results[(workload, direction)] = methods
                print(f"  {workload}: done", flush=True)
    print_table(results, args.runs)


if __name__ == "__main__":
    main()
