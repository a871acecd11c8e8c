"""Prefill and decode throughput of tpupod.model beside transformers, same shapes and dtype.

Random-weight models of the public shapes (presets). Prefill is one forward
pass over a [batch, length] block that returns the last position's logits
(what generation needs), once without and once with every hidden state.
Decode is greedy generation of ``--new-tokens`` after a ``--prompt``-token
prompt at batch ``--decode-batch``; its rate excludes the prefill (the time of
a one-token generation is subtracted). transformers runs the same work: the
forward with ``logits_to_keep=1`` (and ``output_hidden_states``) and
``generate`` with its KV cache, ``sdpa`` attention.

    python benchmarks/model.py                                  # this CPU, float32
    python benchmarks/model.py --dtype bfloat16 --batch 32 --length 1024   # a GPU

Prints a table per shape (medians, tokens/s, the ratio to transformers, and
model FLOP utilisation against a measured matmul rate) and with ``--json``
writes the numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpupod.model import PRESETS, QwenConfig, QwenModel, random_model


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any], reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def matmul_rate(dtype: str, size: int) -> float:
    """FLOP/s of one large square matmul in JAX (the utilisation anchor)."""
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda x: x @ x)
    seconds = statistics.median(timed(lambda: f(a).block_until_ready(), 3))
    return 2 * size**3 / seconds


def jax_side(cfg: QwenConfig, args: argparse.Namespace) -> dict[str, float]:
    side = "tpupod"
    progress(f"{side}: building the model")
    model = random_model(cfg, args.dtype)
    progress(f"{side}: prefill")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (args.batch, args.length), dtype=np.int32)
    every = list(range(cfg.num_hidden_states))
    result = {}
    xla = QwenModel(model.module, attention="xla")
    if model._fused(np.ones((1, 4), np.int32)):  # a GPU: time XLA's attention as well
        try:
            prefill(model, ids, None, 1)
        except Exception as exc:
            print(f"cuDNN attention failed, timing XLA's only: {str(exc)[:300]}")
            model = xla
        else:
            result["prefill_xla"] = prefill(xla, ids, None, args.reps)
    result["prefill"] = prefill(model, ids, None, args.reps)
    result["prefill_hidden"] = prefill(model, ids, every, args.reps)
    prompt = rng.integers(0, cfg.vocab_size, (args.decode_batch, args.prompt), dtype=np.int32)

    def generate(n: int) -> Callable[[], None]:
        return lambda: model.generate(prompt, max_new_tokens=n, stop_tokens=()) and None

    progress(f"{side}: generate")
    result["generate_1"] = statistics.median(timed(generate(1), args.reps))
    result["generate_n"] = statistics.median(timed(generate(args.new_tokens), args.reps))
    return result


def prefill(model: QwenModel, ids: np.ndarray, layers: list[int] | None, reps: int) -> float:
    """Median seconds of a forward pass returning the last logits (and ``layers``)."""

    def run() -> None:
        out = model.forward(ids, layers=layers, logits="last")
        jax.block_until_ready((out.logits, out.hidden_states))

    return statistics.median(timed(run, reps))


def hf_config(cfg: QwenConfig) -> Any:
    import transformers

    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    if cfg.family == "qwen3":
        return transformers.Qwen3Config(head_dim=cfg.head_dim, **common)
    return transformers.Qwen2Config(**common)


def hf_side(cfg: QwenConfig, args: argparse.Namespace) -> dict[str, float]:
    import torch
    import transformers

    side = "transformers"
    progress(f"{side}: building the model")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(cfg), dtype=dtype, attn_implementation="sdpa"
        ).eval()
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.length), device=device)
    mask = torch.ones_like(ids)
    result = {}
    progress(f"{side}: prefill")
    for label, hidden in (("prefill", False), ("prefill_hidden", True)):

        def run(hidden: bool = hidden) -> None:
            with torch.inference_mode():
                model(ids, attention_mask=mask, logits_to_keep=1, output_hidden_states=hidden)
            sync()

        result[label] = statistics.median(timed(run, args.reps))
    prompt = torch.randint(0, cfg.vocab_size, (args.decode_batch, args.prompt), device=device)
    prompt_mask = torch.ones_like(prompt)

    def generate(n: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                model.generate(
                    prompt,
                    attention_mask=prompt_mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )
            sync()

        return run

    progress(f"{side}: generate")
    result["generate_1"] = statistics.median(timed(generate(1), args.reps))
    result["generate_n"] = statistics.median(timed(generate(args.new_tokens), args.reps))
    return result


def rates(raw: dict[str, float], cfg: QwenConfig, args: argparse.Namespace) -> dict[str, float]:
    tokens = args.batch * args.length
    decode_s = max(raw["generate_n"] - raw["generate_1"], 1e-9)
    extra = {"prefill_xla_tok_s": tokens / raw["prefill_xla"]} if "prefill_xla" in raw else {}
    return extra | {
        "prefill_tok_s": tokens / raw["prefill"],
        "prefill_hidden_tok_s": tokens / raw["prefill_hidden"],
        "decode_tok_s": args.decode_batch * (args.new_tokens - 1) / decode_s,
        "prefill_flops": 2 * cfg.non_embedding_params() * tokens / raw["prefill"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen3-1.7b"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--matmul-size", type=int, default=4096)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    peak = matmul_rate(args.dtype, args.matmul_size)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), dtype {args.dtype}")
    print(f"anchor: {args.matmul_size}^3 matmul in JAX, {peak / 1e12:.2f} TFLOP/s")
    report: dict[str, Any] = {"device": device.device_kind, "args": vars(args) | {"json": None}}
    report["matmul_tflops"] = peak / 1e12
    for name in args.shapes:
        cfg = PRESETS[name]()
        ours = rates(jax_side(cfg, args), cfg, args)
        gc.collect()  # the JAX model's weights go before transformers' arrive
        theirs = None if args.no_transformers else rates(hf_side(cfg, args), cfg, args)
        gc.collect()
        report[name] = {"tpupod": ours, "transformers": theirs}
        print_table(name, ours, theirs, peak, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def print_table(
    name: str,
    ours: dict[str, float],
    theirs: dict[str, float] | None,
    peak: float,
    args: argparse.Namespace,
) -> None:
    print(f"\n{name}: prefill {args.batch} x {args.length}, decode batch {args.decode_batch}")
    print(f"after a {args.prompt}-token prompt ({args.new_tokens} new tokens), {args.dtype}")
    print(f"| {'what':<34} | {'tpupod tok/s':>13} | {'transformers':>13} | {'ratio':>6} |")
    print(f"|{'-' * 36}|{'-' * 15}|{'-' * 15}|{'-' * 8}|")
    rows = [("prefill_tok_s", "prefill")]
    if "prefill_xla_tok_s" in ours:
        rows = [("prefill_tok_s", "prefill (cuDNN flash attention)")]
        rows.append(("prefill_xla_tok_s", "prefill (XLA attention)"))
    for key, label in (
        *rows,
        ("prefill_hidden_tok_s", "prefill + all hidden states"),
        ("decode_tok_s", "decode (greedy, KV cache)"),
    ):
        base = theirs and theirs["prefill_tok_s" if key == "prefill_xla_tok_s" else key]
        other = f"{base:13,.0f}" if base else f"{'-':>13}"
        ratio = f"{ours[key] / base:5.2f}x" if base else f"{'-':>6}"
        print(f"| {label:<34} | {ours[key]:13,.0f} | {other} | {ratio} |")
    mfu = ours["prefill_flops"] / peak
    line = f"prefill model FLOP utilisation: tpupod {mfu:.0%}"
    if theirs:
        line += f", transformers {theirs['prefill_flops'] / peak:.0%}"
    print(line + " of the anchor (2 x non-embedding parameters x tokens)")


if __name__ == "__main__":
    main()
