"""Fan-out latency: `hostname` on every host of a simulated pod, tpupod beside the usual tools.

Run as root (it builds simulated pods of network namespaces with real sshd):

    .venv/bin/python benchmarks/fanout.py                  # 4, 8, 16, 32 hosts; 10 runs each
    .venv/bin/python benchmarks/fanout.py --hosts 16 --runs 20

Every row is measured in the same run, on the same simulated pod, and
reported as a median with its ratio to parallel OpenSSH (one `ssh` process per
host, the by-hand anchor). Needs `pip install -e '.[bench]'` (fabric, parallel-ssh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import SSH_OPTIONS, TPUPOD, sim_pod

from tpupod.fanout.execute import execute_async
from tpupod.holder.client import stop_holder
from tpupod.pod.state import StateDir
from tpupod.providers import connect
from tpupod.sim import SimPod

FABRIC = """
import sys
from fabric import ThreadingGroup
hosts, key = sys.argv[1].split(","), sys.argv[2]
group = ThreadingGroup(*hosts, user="root", connect_kwargs={"key_filename": key,
                       "look_for_keys": False, "allow_agent": False})
results = group.run("hostname", hide=True)
assert all(r.ok for r in results.values())
"""

PSSH = """
import sys
from pssh.clients import ParallelSSHClient
hosts, key = sys.argv[1].split(","), sys.argv[2]
client = ParallelSSHClient(hosts, user="root", pkey=key)
output = client.run_command("hostname", stop_on_errors=False)
client.join(output, consume_output=True)  # exit codes can stay None otherwise
bad = [(o.host, o.exit_code, repr(o.exception)) for o in output if o.exit_code != 0]
assert not bad, bad[:3]
"""


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    """``runs`` timings after one warm-up call; an empty list if the tool failed (reported)."""
    samples = []
    try:
        fn()  # warm-up: page cache, known_hosts, the holder if any
        for _ in range(runs):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
    except RuntimeError as exc:
        print(f"  failed after {len(samples)} runs: {str(exc)[-300:]}", file=sys.stderr)
        return []
    return samples


def run_ok(argv: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({proc.returncode}): {proc.stderr[-500:]}")


def openssh_parallel(sim: SimPod) -> None:
    procs = [
        subprocess.Popen(
            ["ssh", *SSH_OPTIONS, "-i", str(sim.key), f"root@{h.address}", "hostname"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for h in sim.hosts
    ]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"ssh failed: {proc.stderr.read() if proc.stderr else ''}")


def measure_pod(sim: SimPod, runs: int, home: Path) -> dict[str, list[float]]:
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    os.environ["TPUPOD_HOME"] = str(home)
    name = f"bench{len(sim.hosts)}"
    pod = sim_pod(sim, name)
    hosts = ",".join(h.address for h in sim.hosts)
    rows: dict[str, list[float]] = {}

    async def api_warm() -> list[float]:
        connector = connect(pod)
        try:

            async def once() -> None:
                (await execute_async(pod, "hostname", connector=connector)).raise_for_failures()

            await once()
            samples = []
            for _ in range(runs):
                started = time.perf_counter()
                await once()
                samples.append(time.perf_counter() - started)
            return samples
        finally:
            await connector.close()

    rows["tpupod Python API, warm connections"] = asyncio.run(api_warm())
    cli = [TPUPOD, "exec", "-q", "--pod", name, "--", "hostname"]
    rows["tpupod exec CLI, fresh process"] = timed(lambda: run_ok(cli, env), runs)

    def first_call() -> None:
        stop_holder(StateDir(), name)
        started = time.perf_counter()
        run_ok(cli, env)
        first.append(time.perf_counter() - started)

    first: list[float] = []
    for _ in range(runs):
        first_call()
    rows["tpupod exec CLI, first call (starts the holder)"] = first
    rows["OpenSSH, one ssh process per host"] = timed(lambda: openssh_parallel(sim), runs)
    rows["fabric ThreadingGroup, fresh process"] = timed(
        lambda: run_ok([sys.executable, "-c", FABRIC, hosts, str(sim.key)]), runs
    )
    rows["parallel-ssh ParallelSSHClient, fresh process"] = timed(
        lambda: run_ok([sys.executable, "-c", PSSH, hosts, str(sim.key)]), runs
    )
    return rows


def measure_sync(sim: SimPod, runs: int, home: Path) -> list[float]:
    """`tpupod sync --from-local` of a one-file change, as a fresh CLI process each time."""
    env = {
        **os.environ,
        "TPUPOD_HOME": str(home),
        "GIT_AUTHOR_NAME": "b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@example.com",
        "GIT_COMMITTER_EMAIL": "b@example.com",
    }
    name = f"bench{len(sim.hosts)}"
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-repo-") as tmp:
        repo = Path(tmp)
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        for i in range(50):  # a small project
            (repo / f"module_{i}.py").write_text(f"VALUE = {i}\n" * 40)
        git = ["git", "-C", str(repo)]
        subprocess.run([*git, "add", "-A"], check=True, env=env)
        subprocess.run([*git, "commit", "-q", "-m", "initial"], check=True, env=env)
        sync = [TPUPOD, "sync", "-q", "--pod", name, "--from-local", "--dir", "bench-code"]
        subprocess.run(sync, cwd=repo, env=env, check=True, capture_output=True)
        samples = []
        for i in range(runs):
            (repo / "module_0.py").write_text(f"VALUE = {i}\n")
            subprocess.run([*git, "commit", "-q", "-am", f"change {i}"], check=True, env=env)
            started = time.perf_counter()
            proc = subprocess.run(
                sync, cwd=repo, env=env, capture_output=True, text=True, check=False
            )
            samples.append(time.perf_counter() - started)
            if proc.returncode != 0:
                raise RuntimeError(f"sync failed: {proc.stderr[-800:]}")
        return samples


def print_table(hosts: int, rows: dict[str, list[float]]) -> None:
    anchor = statistics.median(rows["OpenSSH, one ssh process per host"])
    print(f"\n{hosts} hosts ({max(len(v) for v in rows.values())} runs each)")
    print(f"| {'method':<48} | median ms | p90 ms | vs OpenSSH |")
    print(f"|{'-' * 50}|----------:|-------:|-----------:|")
    for name, samples in rows.items():
        if not samples:
            print(f"| {name:<48} | {'failed':>9} | {'':>6} | {'':>10} |")
            continue
        median = statistics.median(samples)
        p90 = sorted(samples)[max(0, int(len(samples) * 0.9) - 1)]
        print(
            f"| {name:<48} | {median * 1000:9.1f} | {p90 * 1000:6.1f} | {median / anchor:9.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--sync-hosts", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the samples here")
    args = parser.parse_args()
    if shutil.which("ssh") is None:
        sys.exit("needs OpenSSH's ssh client (apt-get install openssh-client)")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-") as home:
        for count in args.hosts:
            with SimPod(count) as sim:
                rows = measure_pod(sim, args.runs, Path(home))
                print_table(count, rows)
                results[str(count)] = rows
                if count == args.sync_hosts:
                    sync = measure_sync(sim, args.runs, Path(home))
                    results["sync"] = sync
                    print(
                        f"\ntpupod sync --from-local of a one-file change to {count} hosts: "
                        f"median {statistics.median(sync) * 1000:.0f} ms over {len(sync)} runs"
                    )
            subprocess.run(
                [TPUPOD, "down", "--pod", f"bench{count}"],
                env={**os.environ, "TPUPOD_HOME": home},
                capture_output=True,
                check=False,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
