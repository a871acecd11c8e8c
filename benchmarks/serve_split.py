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
import time
from pathlib import Path
from typing import Any

from serve_builtin import FIXTURE, QUESTIONS, free_port, progress, wait_ready


def start(port: int, args: argparse.Namespace, *extra: str) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "tpupod.serve.builtin", "--model", str(FIXTURE),
        "--host", "127.0.0.1", "--ports", str(port), "--served-model-name", "bench",
        "--max-batch", str(args.clients), "--max-length", "256", *extra,
    ]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())


async def streaming_round(port: int, questions: list[str], new: int) -> dict[str, float]:
    """All requests at once, streamed: tokens/s and the median time to the first text."""
    import httpx

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=len(questions) * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def one(question: str) -> tuple[float, int]:
            body = {
                "model": "bench",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": new,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            sent = time.perf_counter()
            first, tokens = 0.0, 0
            async with client.stream("POST", url, json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if (
                        not first
                        and chunk["choices"]
                        and chunk["choices"][0]["delta"].get("content")
                    ):
                        first = time.perf_counter() - sent
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return first, tokens

        started = time.perf_counter()
        results = await asyncio.gather(*(one(q) for q in questions))
        wall = time.perf_counter() - started
    return {
        "tok_s": sum(n for _, n in results) / wall,
        "ttft_ms": 1000 * statistics.median(f for f, _ in results),
    }


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
            asyncio.run(streaming_round(ports[name], questions, args.new_tokens))
        for r in range(args.rounds):
            for name in servers:
                progress(f"round {r + 1}: {name}")
                rounds[name].append(
                    asyncio.run(streaming_round(ports[name], questions, args.new_tokens))
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
