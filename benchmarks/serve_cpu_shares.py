"""Where the CPU goes in serve_builtin.py --tiny's streaming rounds: the clients (this
process), the builtin server's front end and its engine, in microseconds per streamed token.

    python benchmarks/serve_cpu_shares.py --rounds 5
    python benchmarks/serve_cpu_shares.py --rounds 4 --spy frontend,engine   # py-spy profiles
    python benchmarks/serve_cpu_shares.py --client httpx      # the clients: aiohttp by default

Wall-clock ratios against ``generate`` move 10-20 % between runs on 2 shared cores; the CPU
each process spends per token is the steadier measure of a change to one of them.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_builtin as sb


def roles(server: psutil.Process) -> dict[str, psutil.Process]:
    """The server's processes by role: the launcher, the front end, the engine."""
    found = {"launcher": server}
    for child in server.children(recursive=True):
        command = " ".join(child.cmdline())
        for role in ("frontend", "engine"):
            if f"--role {role}" in command:
                found[role] = child
    return found


def spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` at 200 Hz into ``out`` (raw, folded stacks) until SIGINT."""
    argv = ["py-spy", "record", "-p", str(pid), "-o", str(out), "-f", "raw", "-r", "200"]
    return subprocess.Popen(
        [*argv, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spy", default="", help="py-spy record these roles: frontend,engine")
    parser.add_argument("--client", choices=sb.STREAM_CLIENTS, default="aiohttp")
    parser.add_argument("--decode-steps", type=int, default=None, help="the server's")
    options = parser.parse_args()
    args = argparse.Namespace(
        tiny=True, shape="tiny", layers=2, dtype="float32", clients=64, max_length=512,
        decode_steps=options.decode_steps, prefill_tokens=None, new_tokens=64,
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="serve-cpu-shares-"))
    _, questions, _ = sb.prepared(args, work / "checkpoint")
    port = sb.free_port()
    server = sb.start_server(work / "checkpoint", port, args)
    try:
        sb.wait_ready(server, port)
        procs = roles(psutil.Process(server.pid))
        client = options.client
        asyncio.run(sb.streaming_round(port, questions, args.new_tokens, client))  # warm
        spies = [
            spy(procs[role].pid, work / f"{role}.txt") for role in options.spy.split(",") if role
        ]
        time.sleep(1 if spies else 0)

        def cpu() -> dict[str, float]:
            return {role: sum(p.cpu_times()[:2]) for role, p in procs.items()}

        before, client_before, started = cpu(), time.process_time(), time.perf_counter()
        tokens = 0
        for _ in range(options.rounds):
            wall, n, _ = asyncio.run(sb.streaming_round(port, questions, args.new_tokens, client))
            tokens += n
            print(f"round: {wall:.3f} s, {n} tokens, {n / wall:,.0f} tok/s", flush=True)
        wall = time.perf_counter() - started
        spent = {role: seconds - before[role] for role, seconds in cpu().items()}
        spent["clients"] = time.process_time() - client_before
        print(f"{options.rounds} rounds in {wall:.2f} s; CPU per streamed token:")
        for role, seconds in spent.items():
            print(f"  {role:9} {1e6 * seconds / tokens:6.0f} us  ({seconds:.2f} s)")
        for profiler in spies:
            profiler.send_signal(2)
            profiler.wait()
        if spies:
            print(f"profiles (py-spy raw format): {work}/<role>.txt")
    finally:
        server.terminate()
        server.wait(20)


if __name__ == "__main__":
    main()
