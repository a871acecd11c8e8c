"""Do a device's XLA read a stacked weight's layer in place? (issue 24 §3's open question)

A decode call passes every layer's weights as separate arrays, so its host
time grows with the depth (about 2.6 us an array on this CPU: PJRT's per
argument and per result work). Stacking each weight over the layers (one
``[L, ...]`` array) makes the argument count flat, but only pays if reading
layer ``i`` of the stack costs what reading a separate array does. On this
CPU it does not: XLA copies each layer's slice before the dot (BENCHMARKS.md,
"Issue 24 §3"). This script asks the same of whatever device JAX has, with
the Qwen2.5-0.5B decode shape's matrices (hidden 896, MLP 4,864, q/k/v/o
projections; 64 rows, one step) and the layers three ways:

- *listed*: one array per weight per layer (what ``slots.Programs`` passes);
- *static*: stacked, layer ``i`` taken with a static index in an unrolled loop;
- *scan*: stacked, the layers run by ``lax.scan``.

For each: the median step time, and the compiled program's temporary bytes
against one layer's weights (a copied slice shows as temporaries of that size).

    python benchmarks/stacked_layers.py [--layers 24] [--steps 30] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# the Qwen2.5-0.5B projections: (name, in, out)
SHAPES = [
    ("q", 896, 896),
    ("k", 896, 128),
    ("v", 896, 128),
    ("o", 896, 896),
    ("gate", 896, 4864),
    ("up", 896, 4864),
    ("down", 4864, 896),
]


def layer(x: Any, w: dict[str, Any]) -> Any:
    """One decoder layer's matrix work on rows ``x`` (no attention: the weights' reads
    are the question)."""
    q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
    mixed = q + jnp.tile(k + v, (1, q.shape[1] // k.shape[1]))
    x = x + jnp.tanh(mixed) @ w["o"]
    return x + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


def programs() -> dict[str, Any]:
    def listed(weights: list[dict[str, Any]], x: Any) -> Any:
        for w in weights:
            x = layer(x, w)
        return x

    def static(stacked: dict[str, Any], x: Any) -> Any:
        for i in range(next(iter(stacked.values())).shape[0]):
            x = layer(x, {name: array[i] for name, array in stacked.items()})
        return x

    def scan(stacked: dict[str, Any], x: Any) -> Any:
        return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]

    return {"listed": jax.jit(listed), "static": jax.jit(static), "scan": jax.jit(scan)}


def step_time(program: Callable[..., Any], weights: Any, x: Any, steps: int) -> float:
    """Median seconds of one call, waited for."""
    program(weights, x).block_until_ready()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        program(weights, x).block_until_ready()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(layers: int, steps: int, dtype: Any, rows: int = 64) -> dict[str, dict[str, float]]:
    key = jax.random.key(0)
    weights = [
        {
            name: (0.02 * jax.random.normal(jax.random.fold_in(key, 100 * i + j), shape)).astype(
                dtype
            )
            for j, (name, *shape) in enumerate(SHAPES)
        }
        for i in range(layers)
    ]
    stacked = {name: jnp.stack([w[name] for w in weights]) for name, *_ in SHAPES}
    x = jnp.ones((rows, 896), dtype)
    layer_bytes = sum(a.nbytes for a in weights[0].values())
    results = {}
    for name, program in programs().items():
        given = weights if name == "listed" else stacked
        compiled = program.lower(given, x).compile()
        memory = compiled.memory_analysis()
        temp = getattr(memory, "temp_size_in_bytes", 0) if memory is not None else 0
        results[name] = {
            "ms": 1e3 * step_time(program, given, x, steps),
            "temp_per_layer_weights": temp / layer_bytes,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    results = measure(args.layers, args.steps, jnp.dtype(args.dtype))
    device = jax.devices()[0]
    print(
        f"{args.layers} layers of the Qwen2.5-0.5B matrices, 64 rows, {args.dtype}, "
        f"on {device.platform} ({device.device_kind}); median of {args.steps} steps"
    )
    print(f"{'weights':>8}{'ms a step':>12}{'ratio':>8}{'temp / one layer':>18}")
    anchor = results["listed"]["ms"]
    for name, r in results.items():
        print(
            f"{name:>8}{r['ms']:>12.2f}{r['ms'] / anchor:>7.2f}x"
            f"{r['temp_per_layer_weights']:>17.2f}x"
        )


if __name__ == "__main__":
    main()
