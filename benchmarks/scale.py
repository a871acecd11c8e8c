"""Pod scale: 16 to 256 simulated hosts, a 256 to 8,192-client barrier, a local exec beside a shell.

Run as root (it builds simulated pods of network namespaces with real sshd):

    .venv/bin/python benchmarks/scale.py                       # 16, 64, 256 hosts; 3 runs
    .venv/bin/python benchmarks/scale.py --hosts 16 --runs 5 --clients 256 1024
    .venv/bin/python benchmarks/scale.py --local-only --local-runs 25  # part 4 alone

In one run:

1. ``hostname`` on every host through the CLI, cold (the connection holder
   starts first) and warm, beside parallel OpenSSH (one ``ssh`` per host, the
   anchor) and fabric; the simulated pod's start-up time per size.
2. ``tpupod sync --from-local`` of a one-file change on the largest pod.
3. One rendezvous barrier of 256 to 8,192 clients (clients and service in this
   process): wall time and this process's CPU time, the best of 3 rounds.
4. ``tpupod exec -- true`` on a 4-worker local pod beside ``python -c pass``,
   run in turn, wall and CPU (the children's user + system time). Python writes its
   bytecode for these runs (``PYTHONDONTWRITEBYTECODE`` is dropped): an installed
   tpupod has it, and without it every run compiles each module it imports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import TPUPOD, sim_pod
from fanout import FABRIC, measure_sync, openssh_parallel, run_ok, timed

from tpupod.base import limits
from tpupod.holder.client import stop_holder
from tpupod.launch.rendezvous import AsyncMember, RendezvousServer
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod

ANCHOR = "OpenSSH, one ssh process per host"


def measure_hosts(sim: SimPod, runs: int, home: Path) -> dict[str, list[float]]:
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    name = f"bench{len(sim.hosts)}"
    sim_pod(sim, name)
    hosts = ",".join(h.address for h in sim.hosts)
    cli = [TPUPOD, "exec", "-q", "--pod", name, "--", "hostname"]
    cold: list[float] = []
    for _ in range(runs):
        stop_holder(StateDir(), name)
        started = time.perf_counter()
        run_ok(cli, env)
        cold.append(time.perf_counter() - started)
    return {
        "tpupod exec CLI, cold (starts the holder)": cold,
        "tpupod exec CLI, warm": timed(lambda: run_ok(cli, env), runs),
        ANCHOR: timed(lambda: openssh_parallel(sim), runs),
        "fabric ThreadingGroup, fresh process": timed(
            lambda: run_ok([sys.executable, "-c", FABRIC, hosts, str(sim.key)]), runs
        ),
    }


async def barrier(clients: int, rounds: int) -> tuple[float, float]:
    """The best (wall s, CPU s) of ``rounds`` barriers of ``clients``."""
    server = RendezvousServer("L", "t", clients)
    address = await server.start("127.0.0.1")
    registration = {"token": "t", "launch_id": "L", "hostname": "h", "digest": ""}
    members = [
        (await AsyncMember.join(address, {**registration, "worker": i, "pid": i}))[0]
        for i in range(clients)
    ]
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        replies = await asyncio.gather(
            *(m.request({"op": "barrier", "name": "b", "timeout": 120}) for m in members)
        )
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        assert all(r == {"ok": True} for r in replies)
    await asyncio.gather(*(m.close() for m in members))
    await server.close()
    return min(walls), min(cpus)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def local_exec(runs: int, home: Path) -> dict[str, tuple[list[float], list[float]]]:
    """(wall, CPU) samples of a local 4-worker ``exec -- true`` and of ``python -c pass``."""
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    run_ok([TPUPOD, "up", "--name", "local4", "--local", "4"], env)
    commands = {
        "tpupod exec -- true (4 local workers)": [TPUPOD, "exec", "--pod", "local4", "--", "true"],
        "python -c pass": [sys.executable, "-c", "pass"],
    }
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in commands}
    for i in range(runs + 1):  # in turn, so a drift in the machine's speed hits both
        for label, argv in commands.items():
            wall, cpu = time.perf_counter(), children_cpu()
            subprocess.run(argv, env=env, check=True, capture_output=True)
            if i:  # the first round warms the page cache
                samples[label][0].append(time.perf_counter() - wall)
                samples[label][1].append(children_cpu() - cpu)
    run_ok([TPUPOD, "down", "--pod", "local4"], env)
    return samples


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    parser.add_argument("--local-runs", type=int, default=15)
    parser.add_argument("--local-only", action="store_true", help="only part 4 (no root needed)")
    args = parser.parse_args()
    if args.local_only:
        args.hosts, args.clients = [], []
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    limits.open_files(2 * max(args.clients, default=0))
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-") as tmp:
        home = Path(tmp)
        os.environ["TPUPOD_HOME"] = str(home)
        if args.hosts:
            print("\n| hosts | sim start s | method | median ms | vs OpenSSH |")
            print("|------:|------------:|--------|----------:|-----------:|")
        for count in args.hosts:
            with SimPod(count) as sim:
                rows = measure_hosts(sim, args.runs, home)
                anchor = statistics.median(rows[ANCHOR]) if rows[ANCHOR] else float("nan")
                for label, samples in rows.items():
                    median = statistics.median(samples) if samples else float("nan")
                    print(
                        f"| {count} | {sim.startup_s:.1f} | {label} | {ms(median)} | "
                        f"{median / anchor:.2f}x |",
                        flush=True,
                    )
                if count == max(args.hosts):
                    synced = statistics.median(measure_sync(sim, args.runs, home))
                    print(f"| {count} | | tpupod sync --from-local, one-file change | "
                          f"{ms(synced)} | |")  # fmt: skip
                stop_holder(StateDir(), f"bench{count}")
        if args.clients:
            print("\n| clients | barrier wall ms (best of 3) | CPU ms | CPU per client us |")
            print("|--------:|----------:|-------:|-------:|")
        for clients in args.clients:
            wall, cpu = asyncio.run(barrier(clients, 3))
            per = cpu / clients * 1e6
            print(f"| {clients} | {ms(wall)} | {ms(cpu)} | {per:.0f} |", flush=True)
        local = local_exec(args.local_runs, home)
        base_wall, base_cpu = (statistics.median(s) for s in local["python -c pass"])
        print("\n| command | wall ms (median) | CPU ms (median) | wall vs python | CPU vs python |")
        print("|---------|-----:|----:|----:|----:|")
        for label, (walls, cpus) in local.items():
            wall, cpu = statistics.median(walls), statistics.median(cpus)
            print(
                f"| {label} | {ms(wall)} | {ms(cpu)} | {wall / base_wall:.1f}x | "
                f"{cpu / base_cpu:.1f}x |"
            )


if __name__ == "__main__":
    main()
