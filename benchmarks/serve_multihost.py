"""A replica served by 2 processes in lockstep beside the same model in 1 process.

The cost of multi-host serving's step broadcast (and of collectives crossing a
process boundary): the same random-weight checkpoint (a public shape cut to
``--layers`` decoder layers, as ``benchmarks/serve_builtin.py`` writes it)
served over the same 4 devices, tensor-parallel ``model=4``, two ways:

- *one process (anchor)*: ``python -m tpupod.serve.builtin`` with 4 devices;
- *2-process replica*: two ``python -m tpupod.serve.replica`` members with 2
  devices each (JAX's distributed runtime, gloo collectives, the leader
  broadcasting every step's work over the side channel).

Both serve ``--clients`` concurrent greedy chat requests of ``--new-tokens``
each; tokens/s is answer tokens over wall time. Rounds are interleaved (only
one side works at a time), medians are reported with their ratio.

    python benchmarks/serve_multihost.py            # this CPU: 2 of 24 layers, 16 clients
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_builtin import (
    QUESTIONS,
    checkpoint,
    clients_round,
    free_port,
    model_arguments,
    progress,
    run_and_report,
)

from tpupod.model import PRESETS


def env(devices: int) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}


def common(folder: Path, args: argparse.Namespace) -> list[str]:
    return [
        "--model", str(folder), "--host", "127.0.0.1", "--dtype", args.dtype,
        "--max-batch", str(args.clients), "--max-length", str(args.max_length),
        "--served-model-name", "bench",
    ]  # fmt: skip


def start_single(folder: Path, port: int, args: argparse.Namespace) -> list[subprocess.Popen[str]]:
    argv = [sys.executable, "-m", "tpupod.serve.builtin", "--ports", str(port)]
    proc = subprocess.Popen(
        [*argv, *common(folder, args)], stdout=subprocess.PIPE, text=True, env=env(4)
    )
    return [proc]


def start_replica(
    folder: Path, port: int, args: argparse.Namespace, mesh: str
) -> list[subprocess.Popen[str]]:
    side, coordinator = free_port(), free_port()
    procs = []
    for rank in range(2):
        argv = [
            sys.executable, "-m", "tpupod.serve.replica", "--port", str(port),
            "--rank", str(rank), "--size", "2", "--leader", f"127.0.0.1:{side}",
            "--coordinator-port", str(coordinator), "--worker", str(rank), "--mesh", mesh,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                [*argv, *common(folder, args)], stdout=subprocess.PIPE, text=True, env=env(2)
            )
        )
    return procs


def wait_ready(proc: subprocess.Popen[str], port: int, timeout: float = 600) -> None:
    assert proc.stdout is not None
    found = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == f"ready port={port}":
                found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server on :{port} did not start (exit {proc.poll()})")


def broadcast_cost(slots: int, steps: int = 2000) -> float:
    """Seconds per step broadcast alone: a leader and a follower over loopback in this
    process, decode-shaped work (6 arrays of ``slots``), until the follower has all."""
    import socket

    import numpy as np

    from tpupod.serve.replica.lockstep import Follower, Hello, Leader

    listener = socket.create_server(("127.0.0.1", 0))
    leader = Leader(listener, 1, timeout=30)
    follower = Follower(timeout=30)
    hello = Hello(1, 1, "code", "config")
    joined = threading.Thread(
        target=follower.join, args=(listener.getsockname(), hello, 10), daemon=True
    )
    joined.start()
    leader.gather(Hello(0, 0, "code", "config"), 10)
    leader.welcome("bench", "127.0.0.1:0")
    joined.join()
    leader.watch(lambda reason: None)
    follower.watch(lambda reason: None)
    work = [np.zeros(slots, np.int32) for _ in range(3)]
    work += [np.zeros(slots, np.float32), np.ones(slots, np.float32), np.zeros(slots, np.uint32)]
    started = time.perf_counter()
    for _ in range(steps):
        leader.broadcast("decode", work)
        follower.next_step()
    took = time.perf_counter() - started
    leader.close()
    return took / steps


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cfg = PRESETS[args.shape]()
    cfg = type(cfg)(**{**cfg.__dict__, "num_layers": args.layers})
    progress(f"{args.shape} cut to {args.layers} layers: writing a random checkpoint")
    folder = work / "checkpoint"
    checkpoint(cfg, folder)
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(args.clients)]
    meshes = args.meshes.split(",")
    single_port, ports = free_port(), [free_port() for _ in meshes]
    progress("starting all (each loads and compiles)")
    began = time.perf_counter()
    procs = start_single(folder, single_port, args)
    leaders = [procs[0]]
    for port, mesh in zip(ports, meshes, strict=True):
        members = start_replica(folder, port, args, mesh)
        leaders.append(members[0])
        procs += members
    every = [single_port, *ports]
    try:
        for proc, port in zip(leaders, every, strict=True):
            wait_ready(proc, port)
        startup = time.perf_counter() - began
        for port in every:  # one small round each to warm the HTTP paths, not counted
            asyncio.run(clients_round(port, questions[:2], 4))
        rounds: list[list[tuple[float, int]]] = [[] for _ in every]
        for r in range(args.rounds):
            for i, port in enumerate(every):
                progress(f"round {r + 1}: {'one process' if i == 0 else meshes[i - 1]}")
                rounds[i].append(asyncio.run(clients_round(port, questions, args.new_tokens)))
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    one, two = rounds[0], rounds[1]
    per_step = broadcast_cost(args.clients)
    one_rate = statistics.median(n / s for s, n in one)
    two_rate = statistics.median(n / s for s, n in two)
    return {
        "shape": args.shape,
        "layers": args.layers,
        "dtype": args.dtype,
        "clients": args.clients,
        "new_tokens": args.new_tokens,
        "max_length": args.max_length,
        "cpus": os.cpu_count(),
        "startup_s": startup,
        "one_process": one,
        "replica": two,
        "one_process_tok_s": one_rate,
        "replica_tok_s": two_rate,
        "ratio": two_rate / one_rate,
        "meshes": meshes,
        "replicas": {m: rounds[i + 1] for i, m in enumerate(meshes)},
        "broadcast_s_per_step": per_step,
    }


def report(r: dict[str, Any]) -> None:
    print(
        f"{r['shape']} cut to {r['layers']} layers, {r['dtype']}, random weights, 4 CPU "
        f"devices (model=4) on {r['cpus']} cores: {r['clients']} concurrent chat requests, "
        f"{r['new_tokens']} new tokens each (greedy), {len(r['replica'])} rounds"
    )
    print(f"{'':40}{'wall s (median)':>16}{'tok/s':>10}{'ratio':>9}")
    one_s = statistics.median(s for s, _ in r["one_process"])
    label = "one process, 4 devices (anchor)"
    print(f"{label:40}{one_s:>16.2f}{r['one_process_tok_s']:>10.0f}{1:>8.2f}x")
    one_rate = r["one_process_tok_s"]
    for mesh, rounds in r["replicas"].items():
        wall = statistics.median(s for s, _ in rounds)
        rate = statistics.median(n / s for s, n in rounds)
        label = f"2-process replica, {mesh}"
        print(f"{label:40}{wall:>16.2f}{rate:>10.0f}{rate / one_rate:>8.2f}x")
    print(
        f"the step broadcast alone (leader to follower over loopback, decode-shaped work): "
        f"{r['broadcast_s_per_step'] * 1e6:.0f} us a step"
    )
    print(f"both started and compiled in {r['startup_s']:.1f} s")


def main() -> None:
    parser = model_arguments(__doc__, layers=2, clients=16, max_length=128)
    parser.add_argument(
        "--meshes",
        default="model=4",
        help="the replicas' meshes, comma-separated",
    )
    run_and_report(parser.parse_args(), "tpupod-bench-multihost-", measure, report)


if __name__ == "__main__":
    main()
