"""Host time per decode call of the builtin engine, 2 against 24 layers (issue 24 §3).

A tiny random Qwen (hidden 64, vocabulary 1,024, 64 slots of 256 positions)
with 2 and with 24 decoder layers. Each call's host time is the time until
the jitted call returns (JAX dispatches asynchronously; the device's work is
waited for after the clock stops). Two ways to call the same decode step:

- *per call (before)*: the model passed as ``(graphdef, state)`` with the
  graphdef a static argument, as the engine did before ``slots.Programs``:
  jit flattens nnx's ``State`` (a Python pytree) and hashes the graphdef on
  every call;
- *Programs (after)*: ``slots.Programs.decode``: the weights a list of
  arrays flattened once, the graphdef closed over.

    python benchmarks/decode_dispatch.py [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tpupod.model import QwenConfig, slots
from tpupod.model.qwen import random_model

TINY = dict(
    family="qwen2",
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    attention_bias=True,
)
SLOTS, LENGTH = 64, 256


def host_time(call: Callable[[Any], Any], caches: Any, calls: int) -> float:
    """Median seconds until ``call`` returns (the device's work waited for after)."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        caches, out = call(caches)
        times.append(time.perf_counter() - started)
        out.block_until_ready()
    return statistics.median(times)


def measure(layers: int, calls: int) -> tuple[float, float]:
    model = random_model(QwenConfig(num_layers=layers, **TINY))  # type: ignore[arg-type]
    fed = jnp.zeros((1, SLOTS), jnp.int32)
    ints = jnp.zeros((5, SLOTS), jnp.int32)
    floats = jnp.ones((2, SLOTS), jnp.float32)

    def old_decode(graphdef: Any, state: Any, caches: Any, *arrays: Any) -> Any:
        span = caches[0][0].shape[2]  # the whole cache, as Programs.decode by default
        return slots._decode(nnx.merge(graphdef, state), caches, *arrays, 1, span)

    before = jax.jit(old_decode, static_argnums=0, donate_argnums=2)
    programs = slots.Programs(model._graphdef, model._state)

    def old(caches: Any) -> Any:
        return before(model._graphdef, model._state, caches, fed, ints, floats)

    def new(caches: Any) -> Any:
        return programs.decode(caches, fed, ints, floats)

    results = []
    for call in (old, new):
        caches = slots.empty_caches(model.module, SLOTS, LENGTH)
        caches, out = call(caches)  # compile
        out.block_until_ready()
        results.append(host_time(call, caches, calls))
    return results[0], results[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    rows = [(layers, *measure(layers, args.calls)) for layers in (2, 24)]
    print(f"host time per decode call, median of {args.calls}, on {jax.devices()[0].device_kind}")
    print(f"{'layers':>6}{'per call (before) us':>22}{'Programs (after) us':>21}")
    for layers, old, new in rows:
        print(f"{layers:>6}{old * 1e6:>22.0f}{new * 1e6:>21.0f}")


if __name__ == "__main__":
    main()
