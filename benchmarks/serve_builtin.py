"""The builtin server under 32 concurrent chat clients beside ``QwenModel.generate``.

The same random-weight checkpoint (a public shape, cut to ``--layers`` decoder
layers so it runs on a CPU; the vocabulary and widths are the real ones, the
tokenizer and chat template are the tiny fixture's) serves both sides:

- *generate (anchor)*: ``QwenModel.generate`` on all ``--clients`` chat
  prompts as one batch, greedy, ``--new-tokens`` each: one jitted program,
  the whole decode loop on the device. The best a server can hope for.
- *builtin server*: ``python -m tpupod.serve.builtin`` (one engine) and
  ``--clients`` concurrent ``/v1/chat/completions`` requests (httpx, async;
  streamed with ``--tiny``, by aiohttp and by httpx in turn)
  for the same prompts, greedy, ``max_tokens`` = ``--new-tokens``: HTTP,
  chat template, tokenizing, continuous batching, a host round trip a step.

- *transformers, one at a time* (``--transformers``; needs torch and
  transformers, which ``make test`` does not install): ``generate`` of the same
  checkpoint's ``AutoModelForCausalLM`` on each prompt in turn, greedy, the
  same ``--new-tokens``, what a user serving by hand without batching gets.

Tokens/s is answer tokens over wall time; the rounds are interleaved so both
see the same machine, and medians are reported with their ratio.

``--tiny`` (issue 24): a tiny random Qwen (2 layers, hidden 64, vocabulary
1,024), where a device step costs a fraction of a millisecond, so what is
measured is the server's host cost per step: 64 *streaming* clients of 64
tokens against ``generate`` of the same 64 prompts, and, in this process, the
engine alone on the same requests with overlap on and off (``Engine(overlap=)``):
its tokens/s, wall time per decode call and the engine thread's CPU time per
decode call (the host's share of a step).

    python benchmarks/serve_builtin.py                     # this CPU, 4 of 24 layers
    python benchmarks/serve_builtin.py --tiny              # the host's cost per step
    python benchmarks/serve_builtin.py --tiny --stream-client httpx   # one client kind only
    python benchmarks/serve_builtin.py --engine-only       # 4 layers: overlap on and off, no server
    git worktree add /tmp/before HEAD~1                    # then, the server before and after:
    python benchmarks/serve_builtin.py --tiny --baseline-src /tmp/before/src
    python benchmarks/serve_builtin.py --layers 24 --clients 64 --dtype bfloat16  # a GPU
    pip install torch==2.13.0 transformers; python benchmarks/serve_builtin.py --transformers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tpupod.model import PRESETS, QwenConfig, QwenModel, load_model

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen2-tiny"
QUESTIONS = [
    "Who are you?",
    "Write a haiku about TPUs.",
    "What is continuous batching?",
    "Explain KV caches in one line.",
    "def fib(n):",
    "Translate 'good morning' to French.",
    "List three prime numbers.",
    "Why is the sky blue?",
]


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def checkpoint(cfg: QwenConfig, folder: Path, seed: int = 0) -> None:
    """A Hugging Face folder of random float32 weights (tied embeddings) of ``cfg``'s shape."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, k = cfg.num_heads * h, cfg.num_kv_heads * h

    def normal(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(cfg.vocab_size, d)}
    tensors["model.norm.weight"] = np.ones(d, np.float32)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
        for name, width in (("q", n), ("k", k), ("v", k)):
            tensors[p + f"self_attn.{name}_proj.weight"] = normal(width, d)
            tensors[p + f"self_attn.{name}_proj.bias"] = np.zeros(width, np.float32)
        tensors[p + "self_attn.o_proj.weight"] = normal(d, n)
        tensors[p + "mlp.gate_proj.weight"] = normal(f, d)
        tensors[p + "mlp.up_proj.weight"] = normal(f, d)
        tensors[p + "mlp.down_proj.weight"] = normal(d, f)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": True,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": list(cfg.eos_token_ids),
    }
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURE / name, folder / name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    folder: Path, port: int, args: argparse.Namespace, src: Path | None = None
) -> subprocess.Popen[str]:
    """The server, from this checkout or (``src``: an earlier commit's ``src`` folder)
    from other code."""
    argv = [
        sys.executable, "-m", "tpupod.serve.builtin", "--model", str(folder),
        "--host", "127.0.0.1", "--ports", str(port), "--dtype", args.dtype,
        "--max-batch", str(args.clients), "--max-length", str(args.max_length),
        "--served-model-name", "bench",
        *(["--decode-steps", str(args.decode_steps)] if args.decode_steps else []),
        *(["--prefill-tokens", str(args.prefill_tokens)] if args.prefill_tokens else []),
    ]  # fmt: skip
    env = os.environ.copy()
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)


def wait_ready(proc: subprocess.Popen[str], port: int) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != f"ready port={port}":
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r} (exit {proc.wait()})")


TINY = QwenConfig(
    family="qwen2",
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    attention_bias=True,
)


async def clients_round(
    port: int, conversations: list[str], new: int, stream: str | None = None
) -> tuple[float, int]:
    """All requests at once (streamed by the client ``stream`` names); wall seconds and
    answer tokens."""
    import httpx

    if stream:
        wall, tokens, _ = await streaming_round(port, conversations, new, stream)
        return wall, tokens

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=len(conversations) * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:

        async def one(question: str) -> int:
            body = {
                "model": "bench",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": new,
                "temperature": 0,
            }
            response = await client.post(url, json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(q) for q in conversations))
        return time.perf_counter() - started, sum(counts)


STREAM_CLIENTS = ("aiohttp", "httpx")  # aiohttp first: the lighter (see --tiny's report)


def _chunk_seen(line: str | bytes, sent: float, seen: dict[str, float]) -> None:
    """One SSE line read by a streaming client: its first text's time, the usage's count."""
    if not line.startswith(b"data: {" if isinstance(line, bytes) else "data: {"):
        return
    chunk = json.loads(line[6:])
    choices = chunk.get("choices")
    if "first" not in seen and choices and choices[0]["delta"].get("content"):
        seen["first"] = time.perf_counter() - sent
    if chunk.get("usage"):
        seen["tokens"] = chunk["usage"]["completion_tokens"]


async def streaming_round(
    port: int, conversations: list[str], new: int, client: str = "aiohttp"
) -> tuple[float, int, list[float]]:
    """All requests at once, each streamed (server-sent events, usage in the last), by
    ``client`` (aiohttp or httpx): wall seconds, answer tokens, and each request's
    seconds to its first text. Both clients read every line and parse every chunk's JSON;
    on a shared CPU the client's own cost per token is part of what is measured (httpx
    spends 2-3x aiohttp's, whose HTTP parser is C)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def body(question: str) -> dict[str, Any]:
        return {
            "model": "bench",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": new,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=len(conversations) * 2)
        session: Any = httpx.AsyncClient(timeout=600, limits=limits, trust_env=False)

        async def one(question: str) -> dict[str, float]:
            sent, seen = time.perf_counter(), {}
            async with session.stream("POST", url, json=body(question)) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    _chunk_seen(line, sent, seen)
            return seen

    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def one(question: str) -> dict[str, float]:
            sent, seen = time.perf_counter(), {}
            async with session.post(url, json=body(question)) as response:
                response.raise_for_status()
                async for line in response.content:  # one line at a time
                    _chunk_seen(line, sent, seen)
            return seen

    async with session:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(q) for q in conversations))
        wall = time.perf_counter() - started
    return (
        wall,
        sum(int(r.get("tokens", 0)) for r in results),
        [r.get("first", 0.0) for r in results],
    )


class EngineRounds:
    """The engine alone (no HTTP) on the same requests, one warm engine per overlap
    setting for every round (a round measures no compile): tokens/s, and per decode call
    its wall time and its thread's CPU time (the host's share; the device's threads apart)."""

    def __init__(self, model: QwenModel, args: argparse.Namespace) -> None:
        import threading

        from tpupod.serve.builtin.engine import Engine

        self.args = args
        self.engines = {
            on: Engine(
                model,
                max_batch=args.clients,
                max_length=args.max_length,
                overlap=on,
                decode_steps=args.decode_steps or 1,  # the server's on a CPU
            )
            for on in (True, False)
        }
        self.done = threading.Semaphore(0)
        for engine in self.engines.values():
            engine.warmup()
            engine.start()

    def round(self, prompts: list[list[int]], overlap: bool) -> dict[str, float]:
        from tpupod.serve.builtin.events import Event, Finished, SamplingParams, Tokens

        engine = self.engines[overlap]
        counts: list[int] = []

        def sink(event: Event) -> None:
            if isinstance(event, Finished):
                counts.append(event.completion_tokens)
            if not isinstance(event, Tokens):  # its end (the engine sends token ids, no text)
                self.done.release()

        steps = engine.steps
        cpu = self._thread_cpu(engine)
        started = time.perf_counter()
        for prompt in prompts:
            engine.submit(prompt, SamplingParams(max_tokens=self.args.new_tokens), sink)
        for _ in prompts:
            self.done.acquire()
        wall = time.perf_counter() - started
        steps = engine.steps - steps
        cpu = self._thread_cpu(engine) - cpu
        return {
            "tok_s": sum(counts) / wall,
            "steps": steps,
            "wall_ms_per_step": 1e3 * wall / steps,
            "host_cpu_ms_per_step": 1e3 * cpu / steps,
        }

    @staticmethod
    def _thread_cpu(engine: Any) -> float:
        """The engine thread's CPU seconds so far (its own clock, read from here)."""
        return time.clock_gettime(time.pthread_getcpuclockid(engine._thread.ident))

    def terminate(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


def prepared(
    args: argparse.Namespace, folder: Path
) -> tuple[QwenModel, list[str], list[list[int]]]:
    """The random checkpoint written to ``folder`` and loaded; the questions, the prompts."""
    if args.tiny:
        cfg = TINY
        args.shape, args.layers = "tiny", cfg.num_layers
    else:
        cfg = PRESETS[args.shape]()
        cfg = type(cfg)(**{**cfg.__dict__, "num_layers": args.layers})
    progress(f"{args.shape} cut to {args.layers} layers: writing a random checkpoint")
    checkpoint(cfg, folder)
    model = load_model(folder, dtype=args.dtype)
    assert model.tokenizer is not None
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(args.clients)]
    prompts = [
        model.tokenizer.encode(
            model.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        )
        for q in questions
    ]
    return model, questions, prompts


def stop_all(*running: Any) -> None:
    """Terminate the servers and engines that were started (None: not started), then
    wait for the processes among them."""
    started = [r for r in running if r]
    for one in started:
        one.terminate()
    for one in started:
        if isinstance(one, subprocess.Popen):
            one.wait(30)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import jax

    folder = work / "checkpoint"
    model, questions, prompts = prepared(args, folder)
    hand = by_hand(folder, prompts, args) if args.transformers else None

    def generate() -> tuple[float, int]:
        started = time.perf_counter()
        out = model.generate(prompts, max_new_tokens=args.new_tokens)
        return time.perf_counter() - started, sum(len(t) for t in out.tokens)

    port, base_port = free_port(), free_port()
    progress("server: starting (loads and compiles); generate: compiling")
    started = time.perf_counter()
    # the two compile side by side
    server = None if args.engine_only else start_server(folder, port, args)
    baseline = args.baseline_src and start_server(folder, base_port, args, args.baseline_src)
    engines = None
    try:
        generate()
        if server is not None:
            wait_ready(server, port)
        startup = time.perf_counter() - started
        if baseline:
            wait_ready(baseline, base_port)
        if args.tiny or args.engine_only:  # warm, so that no round measures a compile
            engines = EngineRounds(model, args)
        gen: list[tuple[float, int]] = []
        # without --tiny the clients do not stream: one kind of round, not two the same
        kinds = [args.stream_client] if args.stream_client != "both" else list(STREAM_CLIENTS)
        kinds = kinds if args.tiny else kinds[:1]
        by_client: dict[str, list[tuple[float, int]]] = {k: [] for k in kinds}
        srv = by_client[kinds[0]]  # the ratio reported: the first client's
        base: list[tuple[float, int]] = []
        tfs: list[tuple[float, int]] = []
        engine: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for r in range(args.rounds):
            progress(f"round {r + 1}: generate")
            gen.append(generate())
            servers = [(by_client[k], port, k) for k in kinds] if server is not None else []
            servers += [(base, base_port, kinds[0])] if baseline else []
            for rounds, on, kind in servers[:: 1 if r % 2 else -1]:  # each first in turn
                progress(f"round {r + 1}: server{' (baseline code)' if rounds is base else ''}")
                stream = kind if args.tiny else None
                rounds.append(asyncio.run(clients_round(on, questions, args.new_tokens, stream)))
            if engines is not None:
                for overlap in (r % 2 == 0, r % 2 == 1):  # each goes first in turn
                    progress(f"round {r + 1}: the engine alone, overlap {overlap}")
                    engine[overlap].append(engines.round(prompts, overlap))
            if hand is not None:
                progress(f"round {r + 1}: transformers, one request at a time")
                tfs.append(hand())
    finally:
        stop_all(server, baseline, engines)
    gen_rate = statistics.median(n / s for s, n in gen)
    srv_rate = statistics.median(n / s for s, n in srv) if srv else float("nan")
    return {
        "shape": args.shape,
        "layers": args.layers,
        "dtype": args.dtype,
        "clients": args.clients,
        "new_tokens": args.new_tokens,
        "max_length": args.max_length,
        "decode_steps": args.decode_steps,
        "prefill_tokens": args.prefill_tokens,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "device": str(jax.devices()[0].device_kind),
        "server_startup_s": startup,
        "generate": gen,
        "server": srv,
        "baseline_src": str(args.baseline_src) if args.baseline_src else None,
        "baseline": base,
        "baseline_tok_s": statistics.median(n / s for s, n in base) if base else None,
        "generate_tok_s": gen_rate,
        "server_tok_s": srv_rate,
        "ratio": srv_rate / gen_rate,
        "transformers": tfs,
        "transformers_tok_s": statistics.median(n / s for s, n in tfs) if tfs else None,
        "streaming": bool(args.tiny),
        "stream_clients": kinds if args.tiny else [],
        "server_by_client": {
            k: statistics.median(n / s for s, n in rounds)
            for k, rounds in by_client.items()
            if rounds
        },
        "engine": {
            ("overlap" if on else "no_overlap"): {
                key: statistics.median(r[key] for r in rounds) for key in rounds[0]
            }
            for on, rounds in engine.items()
            if rounds
        },
    }


def by_hand(
    folder: Path, prompts: list[list[int]], args: argparse.Namespace
) -> Callable[[], tuple[float, int]]:
    """transformers' ``generate`` on each prompt in turn (greedy; stops at EOS as the
    server does), on the same checkpoint, in this process's threads."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    def run() -> tuple[float, int]:
        started, count = time.perf_counter(), 0
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.new_tokens,
                    do_sample=False,
                )
                count += out.shape[1] - ids.shape[1]
        return time.perf_counter() - started, count

    run()  # warm up
    return run


def report(r: dict[str, Any]) -> None:
    print(
        f"{r['shape']} cut to {r['layers']} layers, {r['dtype']}, random weights, on "
        f"{r['device']}: {r['clients']} chat prompts of {r['prompt_tokens'][0]}-"
        f"{r['prompt_tokens'][1]} tokens, {r['new_tokens']} new tokens each (greedy), "
        f"{len(r['generate'])} rounds"
    )
    print(f"{'':36}{'wall s (median)':>16}{'tok/s':>10}{'ratio':>9}")
    gen_s = statistics.median(s for s, _ in r["generate"])
    srv_s = statistics.median(s for s, _ in r["server"]) if r["server"] else 0.0
    print(
        f"{'QwenModel.generate, one batch':36}{gen_s:>16.2f}{r['generate_tok_s']:>10.0f}{1:>8.2f}x"
    )
    label = f"builtin server, {r['clients']} {'streaming ' if r['streaming'] else ''}clients"
    if r["server"] and r["streaming"]:
        for kind, rate in r["server_by_client"].items():
            ratio = rate / r["generate_tok_s"]
            print(f"{label:36}{'':>16}{rate:>10.0f}{ratio:>8.2f}x   (clients: {kind})")
    elif r["server"]:
        print(f"{label:36}{srv_s:>16.2f}{r['server_tok_s']:>10.0f}{r['ratio']:>8.2f}x")
    if r["baseline"]:
        base_s = statistics.median(s for s, _ in r["baseline"])
        base_ratio = r["baseline_tok_s"] / r["generate_tok_s"]
        label = "the same, baseline code"
        print(f"{label:36}{base_s:>16.2f}{r['baseline_tok_s']:>10.0f}{base_ratio:>8.2f}x")
        print(f"  (baseline: {r['baseline_src']})")
    if r["transformers_tok_s"]:
        tf_s = statistics.median(s for s, _ in r["transformers"])
        tf_ratio = r["transformers_tok_s"] / r["generate_tok_s"]
        label = "transformers, one at a time"
        print(f"{label:36}{tf_s:>16.2f}{r['transformers_tok_s']:>10.0f}{tf_ratio:>8.2f}x")
        speedup = r["server_tok_s"] / r["transformers_tok_s"]
        print(f"builtin server / transformers one at a time: {speedup:.1f}x")
    for name, e in r["engine"].items():
        label = f"engine alone, {name.replace('_', ' ')}"
        print(
            f"{label:36}{'':>16}{e['tok_s']:>10.0f}{e['tok_s'] / r['generate_tok_s']:>8.2f}x"
            f"   per decode call: {e['wall_ms_per_step']:.2f} ms wall, "
            f"{e['host_cpu_ms_per_step']:.2f} ms engine-thread CPU"
        )
    if r["server"]:
        print(f"server start to ready (beside generate's compile): {r['server_startup_s']:.1f} s")


def model_arguments(doc: str | None, layers: int, clients: int, max_length: int) -> Any:
    """The options the serving benchmarks share (the model, its load, the output)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b"])
    parser.add_argument("--layers", type=int, default=layers, help="decoder layers kept")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--clients", type=int, default=clients)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--max-length", type=int, default=max_length, help="the servers' slot length"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path)
    return parser


def run_and_report(
    args: argparse.Namespace,
    prefix: str,
    measure: Callable[[argparse.Namespace, Path], dict[str, Any]],
    report: Callable[[dict[str, Any]], None],
) -> None:
    """Measure in a scratch folder (removed after), print the report, save the JSON."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=args.workdir))
    try:
        result = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = model_arguments(__doc__, layers=4, clients=32, max_length=256)
    parser.add_argument(
        "--decode-steps", type=int, default=None, help="the server's (default: its own)"
    )
    parser.add_argument(
        "--prefill-tokens", type=int, default=None, help="the server's (default: its own)"
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also transformers' generate one request at a time (needs torch)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random Qwen, 64 streaming clients of 64 tokens, the engine with "
        "overlap on and off (the host's cost per step)",
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="also serve from this src folder (e.g. a worktree of an earlier commit), "
        "its rounds interleaved with this checkout's server",
    )
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="no server: generate and the engine alone with overlap on and off",
    )
    parser.add_argument(
        "--stream-client",
        choices=[*STREAM_CLIENTS, "both"],
        default="both",
        help="--tiny's streaming clients: aiohttp, httpx, or both in turn (the default); "
        "the ratio in the JSON is the first's",
    )
    args = parser.parse_args()
    if args.tiny:
        args.clients, args.new_tokens = 64, 64
    run_and_report(args, "tpupod-bench-serve-", measure, report)


if __name__ == "__main__":
    main()
