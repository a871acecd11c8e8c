"""The router's overhead: 4 stub backends that answer at once, direct vs tpupod vs sgl-router.

    .venv/bin/pip install sglang-router          # the anchor (not a test dependency)
    .venv/bin/python benchmarks/serve_router.py  # about a minute
    .venv/bin/python benchmarks/serve_router.py --rounds 3 --json out.json

Same run, same backends (``tests/serve_stub.py``, aiohttp + uvloop, 8 tokens,
no delay), three targets:

* direct: the load generator spreads its connections over the 4 backends itself,
* tpupod: ``python -m tpupod.serve.router`` (least outstanding, bearer auth on),
* sgl-router: ``python -m sglang_router.launch_router --policy round_robin``.

The targets take turns, ``--rounds`` times (the medians are reported), so
load from neighbours on a shared machine hits them alike. For each:
requests/s and p50/p99 latency of non-streaming chat completions at
concurrency 32 (keep-alive connections), then the time to the first byte of a
streamed answer's first event, one request at a time (Nagle would show here
as a ~40 ms stall). The load generator is raw asyncio streams on uvloop with
minimal HTTP parsing, so it costs far less per request than any target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "tests" / "serve_stub.py"
BODY = json.dumps(
    {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
).encode()
STREAM_BODY = json.dumps(
    {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.send_signal(signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()


def request_bytes(port: int, path: str, body: bytes, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one non-streamed response (Content-Length or chunked); its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lower = head.lower()
    if b"content-length:" in lower:
        length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    else:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


async def load(
    ports: list[int], token: str | None, concurrency: int, seconds: float, warmup: float
) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    measure_from = time.perf_counter() + warmup
    end = measure_from + seconds

    async def connection(port: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = request_bytes(port, "/v1/chat/completions", BODY, token)
        while (now := time.perf_counter()) < end:
            writer.write(request)
            status = await read_response(reader)
            done = time.perf_counter()
            if now >= measure_from:
                latencies.append(done - now)
                errors += status != 200
        writer.close()

    await asyncio.gather(*(connection(ports[i % len(ports)]) for i in range(concurrency)))
    latencies.sort()
    return {
        "rps": len(latencies) / seconds,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
        "errors": errors,
    }


async def first_token(ports: list[int], token: str | None, count: int) -> float:
    """Median ms from sending a streamed request to the first byte of its first event."""
    times = []
    connections = [await asyncio.open_connection("127.0.0.1", p) for p in ports]
    for _, writer in connections:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(count):
        reader, writer = connections[i % len(connections)]
        port = ports[i % len(ports)]
        began = time.perf_counter()
        writer.write(request_bytes(port, "/v1/chat/completions", STREAM_BODY, token))
        data = await reader.readuntil(b"data:")
        times.append(time.perf_counter() - began)
        while not data.endswith(b"0\r\n\r\n"):  # the rest of the chunked stream
            data += await reader.read(65536)
    for _, writer in connections:
        writer.close()
    return statistics.median(times) * 1000


def measure(
    targets: dict[str, tuple[list[int], str | None]], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Every target in turn, ``--rounds`` times over (neighbours' load hits all alike); medians."""
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    for _ in range(args.rounds):
        for name, (ports, token) in targets.items():
            r = asyncio.run(load(ports, token, args.concurrency, args.seconds, 0.3))
            r["p50_c1_ms"] = asyncio.run(load(ports, token, 1, args.seconds / 3, 0.1))["p50_ms"]
            r["ttft_p50_ms"] = asyncio.run(first_token(ports, token, args.streams))
            rounds[name].append(r)
    return {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per target per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--streams", type=int, default=20, help="streamed requests per round")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="another router.py to measure beside, e.g. the code before a change: "
        "git show HEAD~1:src/tpupod/serve/router/server.py > /tmp/router_before.py",
    )
    args = parser.parse_args()
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    python = sys.executable
    targets: dict[str, tuple[list[int], str | None]] = {}
    with processes() as procs, tempfile.TemporaryDirectory() as tmp:
        backends = [free_port() for _ in range(4)]
        for port in backends:
            # stderr: sgl-router's gRPC health probes make the stub log HTTP/2 noise
            procs.append(
                subprocess.Popen(
                    [python, str(STUB), "--port", str(port)], stderr=subprocess.DEVNULL
                )
            )
        for port in backends:
            wait_port(port)
        addresses = ",".join(f"127.0.0.1:{p}" for p in backends)
        targets["direct"] = (backends, None)

        routers = {"tpupod router": ["-m", "tpupod.serve.router"]}
        if args.before is not None:
            routers["tpupod router, before"] = [str(args.before)]
        for name, program in routers.items():
            ours = free_port()
            procs.append(
                subprocess.Popen(
                    [python, *program, "--state-dir", tmp, "--port", str(ours),
                     "--backends", addresses, "--model", "stub-model"],
                    stdout=subprocess.DEVNULL,
                )
            )  # fmt: skip
            wait_port(ours)
            token = (Path(tmp) / "router.token").read_text().strip()
            targets[name] = ([ours], token)

        if _has_module("sglang_router"):
            sgl = free_port()
            procs.append(
                subprocess.Popen(
                    [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                     "--port", str(sgl), "--policy", "round_robin", "--log-level", "error",
                     "--prometheus-port", str(free_port()), "--worker-urls",
                     *(f"http://127.0.0.1:{p}" for p in backends)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
            wait_port(sgl, 60)
            time.sleep(1.0)  # it checks the workers' health before routing
            targets["sgl-router 0.3.2"] = ([sgl], None)
        report(measure(targets, args), args)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    direct = results["direct"]
    sgl = results.get("sgl-router 0.3.2")
    print(
        f"machine: {platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"concurrency {args.concurrency}, {args.rounds} rounds of {args.seconds:g} s per target "
        "(medians)"
    )
    print(
        "| target | requests/s | vs sgl-router | p50 ms | p50 added ms | p99 ms | "
        "p50 ms, 1 at a time | added, 1 at a time | stream first token p50 ms | errors |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        ratio = f"{r['rps'] / sgl['rps']:.2f}x" if sgl else "-"
        added = r["p50_ms"] - direct["p50_ms"]
        added_c1 = r["p50_c1_ms"] - direct["p50_c1_ms"]
        print(
            f"| {name} | {r['rps']:.0f} | {ratio} | {r['p50_ms']:.2f} | {added:+.2f} | "
            f"{r['p99_ms']:.2f} | {r['p50_c1_ms']:.3f} | {added_c1:+.3f} | "
            f"{r['ttft_p50_ms']:.2f} | {r['errors']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
