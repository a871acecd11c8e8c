"""Launch overhead and barrier latency.

    .venv/bin/python benchmarks/launch.py              # 2, 4, 8 local workers; 16/256/1024 clients

1. Time from starting ``tpupod run`` to the first line of the program on
   every worker, beside the same JAX program started by hand (one background
   process per worker, its environment set in the script) in the same run;
   also over SSH on a simulated pod (as root), beside one ``ssh`` per host.
2. Latency of one barrier for 16, 256 and 1,024 clients of one rendezvous
   service (asyncio clients in this process).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from common import SSH_OPTIONS, TPUPOD, sim_pod

from tpupod.launch.rendezvous import AsyncMember, RendezvousServer
from tpupod.pod.lifecycle import up
from tpupod.pod.spec import LocalPodSpec
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod

# The program: meet the others, start JAX, print one line (what "first line" times).
PROGRAM = (
    "import tpupod; me = tpupod.init_jax(); import jax; "
    "print(f'ready {me.id} {jax.device_count()}', flush=True)"
)
BY_HAND = (
    "import os, jax; n = int(os.environ['N']); i = int(os.environ['I']); "
    "jax.config.update('jax_cpu_collectives_implementation', 'gloo'); "
    "jax.distributed.initialize(os.environ['COORD'], n, i); "
    "print(f'ready {i} {jax.device_count()}', flush=True)"
)


def first_lines(argv: list[str], count: int, env: dict[str, str]) -> float:
    """Start ``argv`` and wait until ``count`` 'ready' lines have arrived; seconds taken."""
    with tempfile.TemporaryFile("w+") as errors:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        assert proc.stdout is not None
        seen = 0
        for line in proc.stdout:
            seen += line.count("ready")  # by hand, two workers can share one line
            if seen == count:
                break
        elapsed = time.perf_counter() - started
        proc.wait()
        proc.stdout.close()
        if seen != count:
            errors.seek(0)
            tail = [line for line in errors.read().splitlines() if "Gloo" not in line][-5:]
            raise RuntimeError(f"{argv[:2]}: only {seen} of {count} workers reported: {tail}")
    return elapsed


def by_hand(count: int) -> float:
    """One background process per worker, the way the seed runbook starts them."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = (
        " ".join(
            f"N={count} I={i} COORD=127.0.0.1:{port} JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 "
            f"{sys.executable} -c {BY_HAND!r} &"
            for i in range(count)
        )
        + " wait"
    )
    return first_lines(["bash", "-c", script], count, dict(os.environ))


def by_hand_ssh(sim: SimPod, port: int) -> float:
    """One `ssh` per host, each starting the program with its identity in the environment."""
    count = len(sim.hosts)
    env = f"N={count} COORD={sim.hosts[0].address}:{port} JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2"
    ssh = f"ssh {' '.join(SSH_OPTIONS)} -i {sim.key}"
    script = " ".join(
        f"{ssh} root@{h.address} "
        + shlex.quote(f"I={h.index} {env} {sys.executable} -c {shlex.quote(BY_HAND)}")
        + " &"
        for h in sim.hosts
    )
    return first_lines(["bash", "-c", script + " wait"], count, dict(os.environ))


def measure_ssh_launch(hosts: int, runs: int) -> None:
    with SimPod(hosts) as sim:
        sim_pod(sim, "launchssh", env={"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"})
        command = [TPUPOD, "run", "--pod", "launchssh", "--", sys.executable, "-c", PROGRAM]
        ours = [first_lines(command, hosts, dict(os.environ)) for _ in range(runs)]
        hand = [by_hand_ssh(sim, 8477 + i) for i in range(runs)]
        a, b = statistics.median(ours), statistics.median(hand)
        print(f"| {hosts:4d} SSH | {a:20.2f} | {b:17.2f} | {a - b:10.2f} | {a / b:5.2f} |")


def measure_launch(counts: list[int], runs: int) -> None:
    print("\n| workers | tpupod run, median s | by hand, median s | overhead s | ratio |")
    print("|--------:|---------------------:|------------------:|-----------:|------:|")
    for count in counts:
        name = f"launch{count}"
        up(LocalPodSpec(name=name, workers=count, devices_per_worker=2), StateDir())
        env = dict(os.environ)
        command = [TPUPOD, "run", "--pod", name, "--", sys.executable, "-c", PROGRAM]
        ours = [first_lines(command, count, env) for _ in range(runs)]
        hand = [by_hand(count) for _ in range(runs)]
        a, b = statistics.median(ours), statistics.median(hand)
        print(f"| {count:7d} | {a:20.2f} | {b:17.2f} | {a - b:10.2f} | {a / b:5.2f} |")


async def barrier_latency(clients: int, rounds: int) -> float:
    server = RendezvousServer("L", "t", clients)
    address = await server.start("127.0.0.1")
    members = []
    for i in range(clients):
        member, reply = await AsyncMember.join(
            address,
            {"token": "t", "launch_id": "L", "worker": i, "hostname": "h", "pid": i, "digest": ""},
        )
        assert reply.get("ok"), reply
        members.append(member)
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        replies = await asyncio.gather(
            *(m.request({"op": "barrier", "name": "b", "timeout": 60}) for m in members)
        )
        samples.append(time.perf_counter() - started)
        assert all(r == {"ok": True} for r in replies)
    for member in members:
        await member.close()
    await server.close()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ssh-hosts", type=int, default=2, help="0 skips the SSH row (needs root)")
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-") as home:
        os.environ["TPUPOD_HOME"] = home
        measure_launch(args.workers, args.runs)
        if args.ssh_hosts:
            measure_ssh_launch(args.ssh_hosts, args.runs)
    print("\n| clients | one barrier, median ms (10 rounds) |")
    print("|--------:|-----------------------------------:|")
    for clients in args.clients:
        latency = asyncio.run(barrier_latency(clients, 10))
        print(f"| {clients:7d} | {latency * 1000:34.1f} |")


if __name__ == "__main__":
    main()
