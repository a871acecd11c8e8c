"""The jitted programs: a forward pass with chosen activations, and generation.

Both are pure functions of ``(graphdef, state, ...)`` so ``jax.jit`` caches
one program per static shape; callers pad batches and lengths to buckets
(see ``buckets``) so a run compiles a handful of programs. Generation keeps
the whole decode loop inside one program (``lax.while_loop`` over a KV
cache), so a token costs one device step, not a Python round trip.

Prompts for generation are left-padded: every row then writes its next key
and value at the same cache index, and a row's positions come from its mask.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tpupod.model.modeling import ActivationSharding, CausalLengths, KVCache, Mask, Qwen, run_layers

Array = jax.Array


def _positions(mask: Array) -> Array:
    """Each real token's position counts only the real tokens before it."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


def _last_index(valid: Array) -> Array:
    """Index of each row's last real token ([B] from [B, T] bool)."""
    t = valid.shape[1]
    return t - 1 - jnp.argmax(valid[:, ::-1], axis=1)


@partial(
    jax.jit,
    static_argnames=("graphdef", "keep", "logits", "fused", "act_sharding", "logits_sharding"),
)
def forward(
    graphdef: nnx.GraphDef[Qwen],
    state: Any,
    input_ids: Array,  # [B, T]
    mask: Array,  # [B, T]
    *,
    keep: frozenset[int],
    logits: str,
    fused: bool = False,
    act_sharding: NamedSharding | None = None,
    logits_sharding: NamedSharding | None = None,
) -> tuple[Array | None, dict[int, Array]]:
    """Logits (``"all"`` [B, T, V], ``"last"`` [B, V] at each row's last token, or
    ``"none"``) and the hidden states named in ``keep``. ``fused``: the rows are
    right-padded, so attention may run as cuDNN flash attention (GPU)."""
    model = nnx.merge(graphdef, state)
    valid = mask.astype(bool)
    t = input_ids.shape[1]
    attn_mask: Mask
    if fused:
        attn_mask = CausalLengths(jnp.maximum(valid.sum(axis=1), 1).astype(jnp.int32))
    else:
        attn_mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
    constrain = ActivationSharding(act_sharding) if act_sharding is not None else None
    hidden = run_layers(
        model, input_ids, _positions(mask), attn_mask, keep=keep, constrain=constrain
    )
    out: Array | None = None
    if logits == "all":
        out = model.logits(hidden.last)
    elif logits == "last":
        index = _last_index(valid)
        last = jnp.take_along_axis(hidden.last, index[:, None, None], axis=1)
        out = model.logits(last)[:, 0]
    if logits_sharding is not None and out is not None:
        spec = (
            logits_sharding.spec
            if out.ndim == 3
            else (logits_sharding.spec[0], logits_sharding.spec[2])
        )
        out = jax.lax.with_sharding_constraint(
            out, NamedSharding(logits_sharding.mesh, PartitionSpec(*spec))
        )
    return out, hidden.states


def _choose(
    logits: Array, step: Array, key: Array, temperature: Array, top_p: Array, *, sample: bool
) -> Array:
    """The next token of each row: argmax, or a temperature / top-p sample."""
    if not sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    # keep the smallest set of most likely tokens whose probability reaches top_p
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(before < top_p, ordered, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    return jax.random.categorical(jax.random.fold_in(key, step), scaled).astype(jnp.int32)


@partial(
    jax.jit,
    static_argnames=("graphdef", "new_capacity", "sample", "act_sharding", "cache_sharding"),
)
def generate(  # noqa: PLR0917 (jit takes the arrays positionally)
    graphdef: nnx.GraphDef[Qwen],
    state: Any,
    input_ids: Array,  # [B, T], left-padded
    mask: Array,  # [B, T]
    max_new: Array,  # scalar int32, at most new_capacity
    stop: Array,  # [stop tokens], -1 for none
    temperature: Array,
    top_p: Array,
    key: Array,
    pad_id: Array,
    *,
    new_capacity: int,
    sample: bool,
    act_sharding: NamedSharding | None,
    cache_sharding: NamedSharding | None,
) -> tuple[Array, Array]:
    """New tokens [B, new_capacity] (``pad_id`` after a row stops) and the step count."""
    model = nnx.merge(graphdef, state)
    b, t = input_ids.shape
    valid = mask.astype(bool)
    positions = _positions(mask)
    constrain = ActivationSharding(act_sharding) if act_sharding is not None else None
    causal = jnp.tril(jnp.ones((t, t), bool))
    prefill = run_layers(
        model, input_ids, positions, causal[None] & valid[:, None, :], constrain=constrain
    )

    def grow(kv: Array) -> Array:
        cache = jnp.pad(kv, ((0, 0), (0, 0), (0, new_capacity), (0, 0)))
        if cache_sharding is not None:
            cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
        return cache

    caches: list[KVCache] = [(grow(k), grow(v)) for k, v in prefill.caches]
    first = _choose(
        model.logits(prefill.last[:, -1:])[:, 0],
        jnp.int32(0),
        key,
        temperature,
        top_p,
        sample=sample,
    )
    # rows with no real token (batch padding) are done before they start
    done = jnp.isin(first, stop) | ~valid.any(axis=1)
    out = jnp.full((b, new_capacity), pad_id, jnp.int32).at[:, 0].set(first)
    key_valid = jnp.concatenate([valid, jnp.zeros((b, new_capacity), bool)], axis=1)
    last_position = positions[:, -1]

    def cond(carry: tuple[Any, ...]) -> Array:
        step, _, _, _, _, done = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        step, token, caches, key_valid, out, done = carry
        index = t + step - 1  # where the previous token's key and value go
        key_valid = jax.lax.dynamic_update_slice(key_valid, jnp.ones((b, 1), bool), (0, index))
        hidden = run_layers(
            model,
            token[:, None],
            (last_position + step)[:, None],
            key_valid[:, None, :],
            caches=caches,
            cache_index=index,
            constrain=constrain,
        )
        logits = model.logits(hidden.last)[:, 0]
        token = _choose(logits, step, key, temperature, top_p, sample=sample)
        token = jnp.where(done, pad_id, token)
        out = jax.lax.dynamic_update_slice(out, token[:, None], (0, step))
        return step + 1, token, hidden.caches, key_valid, out, done | jnp.isin(token, stop)

    carry = (jnp.int32(1), first, caches, key_valid, out, done)
    step, _, _, _, out, _ = jax.lax.while_loop(cond, body, carry)
    return out, step
