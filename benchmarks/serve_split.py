"""The builtin server split (front end and engine in their own processes) against ``--no-split``.

Both servers run at once on the tiny fixture checkpoint (qwen2-tiny: hidden
64, 3 layers, a vocabulary of 416), where a device step costs a fraction of
a millisecond, so the host's work is what is measured. Each round sends
``--clients`` concurrent streaming chat requests (greedy, ``--new-tokens``
each) to one server, then to the other, interleaved so both see the same
machine; medians of tokens/s and of the time to the first token are reported
with the split server's ratio to the single process.

    python benchmarks/serve_split.py                    # 64 clients, 64 tokens, 3 rounds
    python benchmarks/serve_split.py --clients 32 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from serve_builtin import FIXTURE, QUESTIONS, free_port, progress, streaming_round, wait_ready


def start(port: int, args: argparse.Namespace, *extra: str) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "tpupod.serve.builtin", "--model", str(FIXTURE),
        "--host", "127.0.0.1", "--ports", str(port), "--served-model-name", "bench",
        "--max-batch", str(args.clients), "--max-length", "256", *extra,
    ]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())


async def split_round(port: int, questions: list[str], new: int) -> dict[str, float]:
    """All requests at once, streamed: tokens/s and the median time to the first text."""
    wall, tokens, firsts = await streaming_round(port, questions, new)
    return {"tok_s": tokens / wall, "ttft_ms": 1000 * statistics.median(firsts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(args.clients)]
    ports = {"split": free_port(), "no-split": free_port()}
    progress("starting both servers (each loads and compiles)")
    servers = {
        "split": start(ports["split"], args),
        "no-split": start(ports["no-split"], args, "--no-split"),
    }
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    try:
        for name, proc in servers.items():
            wait_ready(proc, ports[name])
        for name in servers:  # a first round each, not counted: connections, caches
            asyncio.run(split_round(ports[name], questions, args.new_tokens))
        for r in range(args.rounds):
            for name in servers:
                progress(f"round {r + 1}: {name}")
                rounds[name].append(
                    asyncio.run(split_round(ports[name], questions, args.new_tokens))
                )
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(30)
    result: dict[str, Any] = {"clients": args.clients, "new_tokens": args.new_tokens}
    for name, runs in rounds.items():
        result[name] = {
            "runs": runs,
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        }
    result["ratio"] = result["split"]["tok_s"] / result["no-split"]["tok_s"]
    print(f"{args.clients} streaming clients x {args.new_tokens} tokens, {args.rounds} rounds")
    print(f"{'server':<10} {'tok/s':>9} {'first token p50':>16}")
    for name in servers:
        print(f"{name:<10} {result[name]['tok_s']:>9.0f} {result[name]['ttft_ms']:>13.1f} ms")
    print(f"split / no-split: {result['ratio']:.2f}x tokens/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
